"""An inference engine SIGKILLed in the middle of a harness's call (fault point ``engine.in_call=hold``).

A real proxy in this process in front of a real CPU engine process on a fixed port. Restarted on that port, the
engine answers the call the proxy keeps asking (same prompt, sampling settings and seed): the harness gets 200 and
a well-formed answer in its dialect, one call event is published, the seal says ok, and the new engine serves the
weight version published while the old one was down. Not restarted: the harness gets its dialect's error once
``engine_retries`` run out, nothing is published, the seal says infra_failure (the sandbox worker then publishes
INFRA_FAILURE with a null reward, never a 0). Every process started here is SIGKILLed by pid at the end.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from clawbase import faults
from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from policy import DEFAULT_MODEL_NAME
from schemas.events import WeightVersion, now_ms
from schemas.topics import WEIGHTS
from tests.support import proxy_helpers as H
from tests.support.inference import Worker
from tests.support.proxy_server import consume_calls, register, running_proxy, seal

pytestmark = pytest.mark.integration

POINT = "engine.in_call"
PATHS = {"anthropic": "/v1/messages?beta=true", "chat": "/v1/chat/completions"}
CASES = [pytest.param("anthropic", True, id="anthropic-sse"), pytest.param("chat", False, id="chat-json")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_engine(kafka: KafkaSettings, port: int, fault_dir: Path | None = None) -> Worker:
    """A CPU engine on ``port`` following weights; held at its first completion when ``fault_dir`` is given."""
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        "CLAWSTREAM_INFER_TORCH_THREADS": "1",
        **(faults.fault_env(fault_dir, **{POINT: "hold"}) if fault_dir is not None else {}),
    }
    args = ["--model", str(H.tiny_model_dir()), "--port", str(port), "--metrics-interval-s", "0"]
    return Worker(args, env)


def _kill(workers: list[Worker]) -> None:
    for w in workers:
        if w.proc.poll() is None:
            os.kill(w.proc.pid, signal.SIGKILL)
        w.proc.wait(30)


def _publish_version(kafka: KafkaSettings, out: Path, version: int) -> None:
    """Perturbed weights of the tiny model in ``out/vN/model.safetensors`` and their WeightVersion."""
    path = out / f"v{version}" / "model.safetensors"
    path.parent.mkdir(parents=True)
    generator = torch.Generator().manual_seed(version)
    tensors = load_file(str(H.tiny_model_dir() / "model.safetensors"))
    save_file(
        {k: (v + 0.05 * torch.randn(v.shape, generator=generator)).contiguous() for k, v in tensors.items()}, str(path)
    )
    data = path.read_bytes()
    event = WeightVersion(
        policy_version=version,
        timestamp_ms=now_ms(),
        model_name=DEFAULT_MODEL_NAME,
        step=version,
        uri=path.as_uri(),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
    )
    producer = make_producer(kafka)
    producer.produce(kafka.topic(WEIGHTS), key=DEFAULT_MODEL_NAME.encode(), value=event.to_bytes())
    assert producer.flush(30) == 0


def _request(dialect: str, stream: bool) -> dict[str, Any]:
    if dialect == "anthropic":
        return H.claude_request([H.claude_first_user()], stream)
    return H.qwen_request([], stream)


async def _harness_call(
    http: aiohttp.ClientSession, url: str, reg: dict[str, Any], dialect: str, stream: bool
) -> tuple[int, bytes]:
    secret = reg["secret"]
    headers = {"x-api-key": secret} if dialect == "anthropic" else {"Authorization": f"Bearer {secret}"}
    async with http.post(
        f"{url}/r/{reg['rollout_id']}{PATHS[dialect]}", json=_request(dialect, stream), headers=headers
    ) as r:
        return r.status, await r.read()


async def _held_call(
    http: aiohttp.ClientSession, url: str, reg: dict[str, Any], dialect: str, stream: bool, fault_dir: Path, a: Worker
) -> asyncio.Task[tuple[int, bytes]]:
    """The harness's call, once it reached engine ``a`` (held there); then ``a`` is SIGKILLed by its pid."""
    call = asyncio.create_task(_harness_call(http, url, reg, dialect, stream))
    pid = await asyncio.to_thread(faults.wait_held, fault_dir, POINT, 120.0, a.proc)
    assert pid == a.proc.pid and not call.done()
    return call


def _check_answer(dialect: str, stream: bool, raw: bytes, generated: int) -> None:
    """A well-formed answer in the dialect, with the recorded call's tokens."""
    if stream:
        events, _ = H.read_sse(raw)
        names = [n for n, _ in events if n != "ping"]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
        answer = H.answer_from_sse(dialect, raw)
        assert answer["role"] == "assistant" and answer["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
        usage = next(d["usage"] for n, d in events if n == "message_delta")
        assert usage["output_tokens"] == generated
    else:
        body = json.loads(raw)
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
        assert body["usage"]["completion_tokens"] == generated


@pytest.mark.parametrize(("dialect", "stream"), CASES)
async def test_an_engine_killed_mid_call_and_restarted_serves_the_call(
    kafka_settings: KafkaSettings, tmp_path: Path, dialect: str, stream: bool
) -> None:
    port, fault_dir = _free_port(), tmp_path / "faults"
    workers: list[Worker] = []
    try:
        workers.append(await asyncio.to_thread(_start_engine, kafka_settings, port, fault_dir))
        async with (
            running_proxy(kafka_settings, f"http://127.0.0.1:{port}") as (_proxy, url),
            aiohttp.ClientSession() as http,
        ):
            reg = await register(http, url, rollout_id=f"restart-{dialect}", temperature=1.0, seed=7, max_tokens=12)
            call = await _held_call(http, url, reg, dialect, stream, fault_dir, workers[0])
            await asyncio.to_thread(_publish_version, kafka_settings, tmp_path, 1)  # the run moves on meanwhile
            os.kill(workers[0].proc.pid, signal.SIGKILL)
            await asyncio.to_thread(workers[0].proc.wait, 30)
            workers.append(await asyncio.to_thread(_start_engine, kafka_settings, port))  # same port, no fault
            assert "(policy version 1)" in workers[1].log()  # caught up before its port opened
            status, raw = await asyncio.wait_for(call, 180)
            assert status == 200 and b"event: error" not in raw, raw[-600:]  # a stream's error is its last event
            sealed = await seal(http, url, reg["rollout_id"])
            events = await asyncio.to_thread(consume_calls, kafka_settings, {reg["rollout_id"]}, 2, 8.0)
            assert len(events) == 1, [(e.seq, e.call_id) for e in events]  # exactly one: none lost, none doubled
            [event] = events
            # The call the engine answered is the harness's call: same prompt, sampling settings and seed.
            again = {
                "model": DEFAULT_MODEL_NAME,
                "prompt": event.new_tokens.tolist(),  # the first call: its new tokens are the whole prompt
                "max_tokens": 12,
                "temperature": event.temperature,
                "top_p": event.top_p,
                "seed": 7,
                "stop_token_ids": [H.tiny_tokenizer().convert_tokens_to_ids("<|im_end|>")],
                "logprobs": 1,
                "return_token_ids": True,
                "skip_special_tokens": False,
            }
            async with http.post(f"{workers[1].url}/v1/completions", json=again) as r:
                assert r.status == 200
                replay = await r.json()
    finally:
        await asyncio.to_thread(_kill, workers)
    assert sealed["status"] == "ok" and sealed["infra_failure"] is None and sealed["calls_served"] == 1, sealed
    assert event.seq == 0 and event.policy_version == 1 and event.prompt_len == len(event.new_tokens)
    assert replay["choices"][0]["token_ids"] == event.generated_tokens.tolist()
    _check_answer(dialect, stream, raw, len(event.generated_tokens))


@pytest.mark.parametrize(("dialect", "stream"), CASES)
async def test_an_engine_killed_mid_call_and_not_restarted_is_an_infra_failure(
    kafka_settings: KafkaSettings, tmp_path: Path, dialect: str, stream: bool
) -> None:
    port, fault_dir = _free_port(), tmp_path / "faults"
    workers: list[Worker] = []
    try:
        workers.append(await asyncio.to_thread(_start_engine, kafka_settings, port, fault_dir))
        async with (
            running_proxy(kafka_settings, f"http://127.0.0.1:{port}", engine_retries=3) as (_proxy, url),
            aiohttp.ClientSession() as http,
        ):
            reg = await register(http, url, rollout_id=f"gone-{dialect}")
            call = await _held_call(http, url, reg, dialect, stream, fault_dir, workers[0])
            os.kill(workers[0].proc.pid, signal.SIGKILL)
            status, raw = await asyncio.wait_for(call, 60)
            sealed = await seal(http, url, reg["rollout_id"])
    finally:
        await asyncio.to_thread(_kill, workers)
    if stream:  # the stream had opened: the error is its last event
        assert status == 200
        events, _ = H.read_sse(raw)
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        error = events[-1][1]["error"]
        assert events[-1][1]["type"] == "error" and error["type"] == "api_error"
    else:
        assert status == 502
        error = json.loads(raw)["error"]
        assert error["code"] == "engine_unavailable"
    assert "4 attempt(s)" in error["message"] and "engine_retries=3" in error["message"]
    assert consume_calls(kafka_settings, {reg["rollout_id"]}, 1, timeout=5) == []
    assert sealed["status"] == "infra_failure" and sealed["calls_served"] == 0, sealed
    assert "engine_retries=3" in sealed["infra_failure"]
