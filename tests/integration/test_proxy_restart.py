"""A proxy SIGKILLed mid-rollout and restarted on the same port serves the rest of its in-flight rollouts (#28 item 4).

A real proxy process (``python -m producers.proxy``) on a fixed port in front of the scripted engine: a rollout is
registered and makes two OpenAI Chat calls (the second extends the first); once the second call's event is on the
calls topic the proxy is SIGKILLed by pid and started again on the same port. The third call with the same secret
gets 200, its call event has seq 2, and its prompt ids (and delta encoding) equal those of a second proxy that was
never killed, given the same three calls; the seal reports 3 calls served and status ok, and the quotas' usage
(calls, prompt tokens) right after the restart counts the two replayed calls and at the seal equals the other
proxy's. The registrations topic
holds no secret; a forgotten rollout is not restored, a finished attempt still is refused again, a wrong key still
gets 401. Every process started here is SIGKILLed by pid at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from clawbase.kafka.clients import assign_from_beginning, create_topics, make_consumer, read_to_end
from clawbase.settings import KafkaSettings
from schemas.events import CallEvent
from schemas.topics import CATALOG, PROXY_REGISTRATIONS
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = pytest.mark.integration

TOKEN = "admin-restart"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
ANSWERS = [  # by the number of assistant turns already in the prompt: both proxies get the same answers
    tool_call_text("write_file", {"file_path": "hello.txt", "content": "hi"}),
    "Checking.\n" + tool_call_text("write_file", {"file_path": "check.txt", "content": "ok"}),
    "Done: hello.txt contains hi.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answer(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
    return ANSWERS[min(prompt_text.count("<|im_start|>assistant\n") - 1, len(ANSWERS) - 1)]


class ProxyProcess:
    """``python -m producers.proxy`` on a fixed port; its output in a log file."""

    def __init__(self, kafka: KafkaSettings, engine_url: str, port: int, log: Path) -> None:
        self.kafka, self.engine_url, self.port, self.log = kafka, engine_url, port, log
        self.admin_port = _free_port()
        self.url, self.admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{self.admin_port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env: dict[str, str] = {}  # more CLAWSTREAM_PROXY_* settings (test_proxy_replicas.py)

    def start(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap_servers or "",
            "CLAWSTREAM_KAFKA_TOPIC_PREFIX": self.kafka.topic_prefix,
            "HF_HUB_OFFLINE": "1",
            **self.env,
        }
        args = ["--model", str(H.tiny_model_dir()), "--engine-url", self.engine_url, "--port", str(self.port)]
        args += ["--admin-port", str(self.admin_port)]
        with self.log.open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "producers.proxy", *args, "--admin-token", TOKEN],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    async def ready(self, http: aiohttp.ClientSession, timeout: float = 120.0) -> None:
        proc, deadline = self.procs[-1], time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"proxy exited {proc.returncode}:\n{self.log.read_text()[-3000:]}"
            try:
                async with http.get(f"{self.admin}/healthz") as r:  # the admin listener opens last
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        raise AssertionError(f"proxy not ready in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)


async def _admin(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    async with http.request(method, url, headers=ADMIN, **kw) as r:
        return r.status, await r.json(content_type=None)


async def _register(http: aiohttp.ClientSession, url: str, rid: str, **body: Any) -> dict[str, Any]:
    status, data = await _admin(http, "POST", f"{url}/admin/rollouts", json={"rollout_id": rid, **body})
    assert status == 201, data
    return data


async def _call(http: aiohttp.ClientSession, url: str, rid: str, key: str, history: list) -> tuple[int, Any]:
    body = H.qwen_request(history, stream=False)
    async with http.post(
        f"{url}/r/{rid}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        return r.status, await r.json(content_type=None)


def _prompts(events: list[CallEvent]) -> dict[int, list[int]]:
    """seq → full prompt ids, undoing the delta encoding."""
    by_id: dict[str, tuple[list[int], list[int]]] = {}
    out = {}
    for e in sorted(events, key=lambda e: e.seq):
        base = [] if e.parent_call_id is None else by_id[e.parent_call_id][0] + by_id[e.parent_call_id][1]
        prompt = base[: e.shared_prefix_len] + e.new_tokens.tolist()
        assert len(prompt) == e.prompt_len
        by_id[e.call_id] = (prompt, e.generated_tokens.tolist())
        out[e.seq] = prompt
    return out


def _registration_values(kafka: KafkaSettings) -> list[bytes | None]:
    consumer = make_consumer(kafka, f"g-{uuid.uuid4().hex[:8]}")
    try:
        topic = kafka.topic(PROXY_REGISTRATIONS)
        ends = assign_from_beginning(consumer, topic)
        return [m.value() for m in read_to_end(consumer, topic, ends)]
    finally:
        consumer.close()


async def _three_calls(
    http: aiohttp.ClientSession, proxy: ProxyProcess, rid: str, secret: str, between: Any = None
) -> list[tuple[int, Any]]:
    """The rollout's three calls, each extending the one before; ``between`` runs after the second."""
    history: list[dict[str, Any]] = []
    out = []
    for k in range(3):
        if k == 2 and between is not None:
            await between()
        status, body = await _call(http, proxy.url, rid, secret, history)
        assert status == 200, body
        out.append((status, body))
        history += H.qwen_followup(body, f"result {k}")
    return out


async def test_a_killed_proxy_serves_the_rest_of_its_rollouts_after_a_restart(
    kafka_settings: KafkaSettings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    ref_kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"{kafka_settings.topic_prefix}ref.")
    create_topics(ref_kafka, CATALOG)
    rid, params = "r-restart", {"attempt_id": "r-restart.a0", "attempt": 0, "lease_s": 30, "seed": 5}
    async with ScriptedEngine(H.tiny_tokenizer(), script=_answer) as engine:
        killed = ProxyProcess(kafka_settings, engine.url, _free_port(), tmp_path / "killed.log")
        ref = ProxyProcess(ref_kafka, engine.url, _free_port(), tmp_path / "ref.log")
        try:
            killed.start()
            ref.start()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
                await killed.ready(http)
                await ref.ready(http)
                reg = await _register(http, killed.admin, rid, **params)
                secret = reg["secret"]
                assert reg["base_url"] == f"{killed.url}/r/{rid}"
                forgotten = await _register(http, killed.admin, "r-forgotten")
                assert (await _admin(http, "DELETE", f"{killed.admin}/admin/rollouts/r-forgotten"))[0] == 200
                await _register(http, killed.admin, "r-finished", attempt_id="f.a0", attempt=0)
                query = {"attempt_id": "f.a0", "finished": "1"}
                status, _ = await _admin(http, "DELETE", f"{killed.admin}/admin/rollouts/r-finished", params=query)
                assert status == 200

                async def kill_and_restart() -> None:
                    # The state chosen: the second call's event is on the calls topic.
                    before = consume_calls(kafka_settings, {rid}, 2, timeout=60)
                    assert [e.seq for e in before] == [0, 1]
                    pid = killed.procs[-1].pid
                    os.kill(pid, signal.SIGKILL)
                    assert killed.procs[-1].wait(30) == -signal.SIGKILL
                    killed.start()
                    await killed.ready(http)
                    # The quotas count on from the replayed calls: both calls and their prompt tokens.
                    status, state = await _admin(http, "GET", f"{killed.admin}/admin/rollouts/{rid}")
                    assert status == 200 and state["restored"] is True, state
                    assert state["usage"] == {"calls": 2, "prompt_tokens": sum(e.prompt_len for e in before)}, state

                await _three_calls(http, killed, rid, secret, between=kill_and_restart)
                status, body = await _call(http, killed.url, rid, "not-the-secret", [])
                assert status == 401, body
                status, body = await _call(http, killed.url, "r-forgotten", forgotten["secret"], [])
                assert status == 401, body
                assert (await _admin(http, "GET", f"{killed.admin}/admin/rollouts/r-forgotten"))[0] == 404
                status, body = await _admin(
                    http, "POST", f"{killed.admin}/admin/rollouts", json={"rollout_id": "r-finished", "attempt": 0}
                )
                assert status == 409 and body.get("finished") is True, body
                status, sealed = await _admin(http, "POST", f"{killed.admin}/admin/rollouts/{rid}/seal")
                assert status == 200 and sealed["restored"] is True
                assert (sealed["calls_served"], sealed["status"], sealed["infra_failure"]) == (3, "ok", None)

                ref_reg = await _register(http, ref.admin, rid, **params)
                await _three_calls(http, ref, rid, ref_reg["secret"])
                status, ref_sealed = await _admin(http, "POST", f"{ref.admin}/admin/rollouts/{rid}/seal")
                assert (ref_sealed["calls_served"], ref_sealed["status"]) == (3, "ok")
                assert sealed["usage"] == ref_sealed["usage"]  # the quotas' counts, as if never killed
        finally:
            killed.kill()
            ref.kill()

    calls = consume_calls(kafka_settings, {rid}, 3, timeout=60)
    ref_calls = consume_calls(ref_kafka, {rid}, 3, timeout=60)
    assert [e.seq for e in calls] == [e.seq for e in ref_calls] == [0, 1, 2]
    assert {e.attempt_id for e in calls} == {params["attempt_id"]}
    assert _prompts(calls) == _prompts(ref_calls)  # the third call rendered as if the proxy had never died
    for got, want in zip(calls, ref_calls, strict=True):
        assert got.generated_tokens.tolist() == want.generated_tokens.tolist()
        assert (got.shared_prefix_len, got.flags, got.conversation_digest) == (
            want.shared_prefix_len,
            want.flags,
            want.conversation_digest,
        )
        assert (got.parent_call_id is None) == (want.parent_call_id is None)
    assert calls[2].parent_call_id == calls[1].call_id and "full_render" not in calls[2].flags

    assert "restored 1 registrations (2 calls replayed)" in killed.log.read_text()
    values = _registration_values(kafka_settings)
    assert len(values) >= 6 and None in values  # register ×3, forget (tombstone), finished, seal, ...
    for value in [*values, *_registration_values(ref_kafka)]:
        assert value is None or (secret.encode() not in value and ref_reg["secret"].encode() not in value)
