"""Serving proxy end to end: real Kafka broker, real proxy HTTP server, scripted engine, harness-shaped requests.

Each dialect runs a 2-call tool-use episode streaming and non-streaming; the call events on the broker must show
call 2's prompt = call 1's prompt + call 1's generated ids + turn suffix + new ids (rebuilt with
``streams.tree.rebuild_prompts``), and equal what the engine received; the engine's cached prompt tokens and GPU
readings reach the call event, and the cached tokens the harness in its dialect's usage field. Every bad-input
row answers in the caller's dialect and publishes nothing. Last, the proxy and the real CPU engine, both started
with their default settings (no model-name flag), serve calls together.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from clawbase.settings import KafkaSettings
from policy import DEFAULT_MODEL_NAME
from schemas.events import CallKind
from streams.tree import TreeCall, rebuild_prompts
from tests.support import proxy_helpers as H
from tests.support.inference import Worker
from tests.support.proxy_server import admin_url, consume_calls, register, running_proxy, seal
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = pytest.mark.integration

DONE = "Done: hello.txt contains hi."
PATHS = {"anthropic": "/v1/messages?beta=true", "chat": "/v1/chat/completions", "responses": "/responses"}
TOOL_TEXT = {
    "anthropic": tool_call_text("Write", {"file_path": "/w/hello.txt", "content": "hi"}),
    "chat": tool_call_text("write_file", {"file_path": "hello.txt", "content": "hi"}),
    "responses": tool_call_text("exec_command", {"cmd": "printf hi > hello.txt"}),
}


def auth(dialect: str, secret: str) -> dict[str, str]:
    return {"x-api-key": secret} if dialect == "anthropic" else {"Authorization": f"Bearer {secret}"}


def request_body(dialect: str, history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    build = {"anthropic": H.claude_request, "chat": H.qwen_request, "responses": H.codex_request}[dialect]
    if dialect == "anthropic":
        return build([H.claude_first_user(), *history], stream)
    return build(history, stream)


def followup(dialect: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
    fn = {"anthropic": H.claude_followup, "chat": H.qwen_followup, "responses": H.codex_followup}[dialect]
    return fn(answer, "wrote hello.txt")


def cached_in_usage(dialect: str, raw: bytes, stream: bool) -> tuple[int, int]:
    """(cached prompt tokens, whole prompt) as the dialect's final usage reports them to the harness."""
    if not stream:
        usage = json.loads(raw)["usage"]
    else:
        events, _ = H.read_sse(raw)
        data = [d for _, d in events if d != "[DONE]"]
        if dialect == "anthropic":
            usage = next(d["usage"] for d in data if d["type"] == "message_delta")
        elif dialect == "chat":
            usage = next(d["usage"] for d in data if d.get("usage"))
        else:
            usage = next(d["response"]["usage"] for d in data if d["type"] == "response.completed")
    if dialect == "anthropic":  # input_tokens is the uncached rest
        return usage["cache_read_input_tokens"], usage["input_tokens"] + usage["cache_read_input_tokens"]
    if dialect == "chat":
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]
    return usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]


def check_stream_shape(dialect: str, raw: bytes) -> int:
    """Assert the dialect's SSE event order; return the number of keep-alives (Anthropic pings, SSE comments)."""
    events, comments = H.read_sse(raw)
    if dialect == "anthropic":
        names = [n for n, _ in events if n != "ping"]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        assert all(n == d["type"] for n, d in events)
        assert {"content_block_start", "content_block_delta", "content_block_stop"} <= set(names)
        return sum(1 for n, _ in events if n == "ping")
    elif dialect == "chat":
        assert events[0][1]["choices"][0]["delta"]["role"] == "assistant" and events[-1][1] == "[DONE]"
        assert events[-2][1]["choices"] == [] and events[-2][1]["usage"]["total_tokens"] > 0
        assert events[-3][1]["choices"][0]["finish_reason"] in ("tool_calls", "stop")
    else:
        names = [n for n, _ in events]
        assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert "response.output_item.added" in names and "response.output_item.done" in names
    return comments


async def call(http, url: str, rid: str, secret: str, dialect: str, body: Any, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth(dialect, secret)}
    async with http.post(f"{url}/r/{rid}{PATHS[dialect]}", data=data, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
async def test_two_call_tool_episode_is_append_only_on_the_broker(kafka_settings, dialect, stream) -> None:
    tok = H.tiny_tokenizer()
    telemetry = {"gpu_utilization": 61.0, "gpu_memory_used_bytes": 5_368_709_120}
    async with (
        ScriptedEngine(
            tok, [TOOL_TEXT[dialect], DONE], delay_s=0.5 if stream else 0, prefix_cache=True, engine_telemetry=telemetry
        ) as engine,
        running_proxy(kafka_settings, engine.url) as (proxy, url),
        aiohttp.ClientSession() as http,
    ):
        reg = await register(
            http,
            url,
            rollout_id=f"r-{dialect}-{stream}",
            temperature=0.9,
            top_p=0.95,
            top_k=20,
            max_tokens=512,
            attempt_id=f"r-{dialect}-{stream}.a0.abc",
        )
        rid, secret = reg["rollout_id"], reg["secret"]
        assert reg["base_url"] == f"{url}/r/{rid}"
        async with http.head(reg["base_url"]) as r:
            assert r.status == 200
        history: list[dict[str, Any]] = []
        answers = []
        usages = []
        for _ in range(2):
            status, raw = await call(http, url, rid, secret, dialect, request_body(dialect, history, stream))
            assert status == 200, raw
            usages.append(cached_in_usage(dialect, raw, stream))
            if stream:
                assert check_stream_shape(dialect, raw) >= 1  # keep-alives while the engine worked
                answer = H.answer_from_sse(dialect, raw)
            else:
                answer = json.loads(raw)
            answers.append(answer)
            history = history + followup(dialect, answer)
        sealed = await seal(http, url, rid)
        assert sealed["calls_served"] == 2 and sealed["status"] == "ok"
        status, raw = await call(http, url, rid, secret, dialect, request_body(dialect, history, stream))
        assert status == 401  # sealed: the secret is revoked
    if dialect == "anthropic":
        assert answers[0]["stop_reason"] == "tool_use" and answers[1]["stop_reason"] == "end_turn"
        assert answers[0]["content"][0]["input"] == {"file_path": "/w/hello.txt", "content": "hi"}
    elif dialect == "chat":
        assert answers[0]["choices"][0]["finish_reason"] == "tool_calls"
        assert answers[1]["choices"][0]["message"]["content"] == DONE
    else:
        assert answers[0]["output"][0]["type"] == "function_call" and answers[0]["output"][0]["name"] == "exec_command"
        assert answers[1]["output"][0]["content"][0]["text"] == DONE
    events = consume_calls(kafka_settings, {rid}, 2)
    assert [e.seq for e in events] == [0, 1]
    calls = [
        TreeCall(
            e.call_id,
            e.seq,
            e.parent_call_id,
            e.shared_prefix_len,
            e.new_tokens.tolist(),
            e.generated_tokens.tolist(),
            e.logprobs.tolist(),
            e.call_kind.value.lower(),
            e.policy_version,
            e.finish_reason,
        )
        for e in events
    ]
    prompts = rebuild_prompts(calls)
    p1, p2 = prompts[events[0].call_id], prompts[events[1].call_id]
    g1 = events[0].generated_tokens.tolist()
    suffix = proxy.template.turn_suffix(g1)
    assert events[1].parent_call_id == events[0].call_id and events[1].shared_prefix_len == len(p1) + len(g1)
    assert p2[: len(p1) + len(g1) + len(suffix)] == p1 + g1 + suffix
    assert [p1, p2] == [r.prompt_ids for r in engine.requests]  # what the engine saw is what was recorded
    for e in events:
        assert e.call_kind == CallKind.MAIN and e.policy_version == 7 and e.flags == []
        assert len(e.logprobs) == len(e.generated_tokens) > 0 and e.prompt_len == len(prompts[e.call_id])
        assert e.requested_model == "policy" and e.engine_ms > 0 and e.total_ms >= e.engine_ms
        assert e.attempt_id == f"{rid}.a0.abc"  # from the registration: the assembler tells attempts apart by it
    assert [e.finish_reason for e in events] == ["tool_calls", "stop"]
    # the engine's prefix-cache report: call 2 reuses call 1's prompt + answer, to the harness and on the event
    assert engine.cached[0] == 0 and engine.cached[1] >= len(p1) + len(g1)
    assert [e.cached_prompt_tokens for e in events] == engine.cached
    assert usages == [(c, e.prompt_len) for c, e in zip(engine.cached, events, strict=True)]
    assert all(e.gpu_utilization == 61.0 and e.gpu_memory_used_bytes == 5_368_709_120 for e in events)
    assert engine.requests[0].body["temperature"] == 0.9 and engine.requests[0].body["max_tokens"] == 512
    # The rollout's sampling settings go to the engine and onto every call event (the learner recomputes with them);
    # Avro floats are 32-bit, hence the tolerance.
    assert all((r.body["top_p"], r.body["top_k"]) == (0.95, 20) for r in engine.requests)
    assert all(e.temperature == pytest.approx(0.9) and e.top_p == pytest.approx(0.95) and e.top_k == 20 for e in events)


async def test_bad_registrations_are_refused_with_the_reason(kafka_settings: KafkaSettings) -> None:
    tok = H.tiny_tokenizer()
    async with (
        ScriptedEngine(tok, ["ok"]) as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        headers = {"Authorization": "Bearer admin"}
        for body, reason in (
            ({"rollout_id": "x", "attempt_id": 5}, "attempt_id must be a string"),
            ({"rollout_id": "a b"}, "rollout_id allows"),
            ({"rollout_id": "y", "ttl_s": "soon"}, "bad registration"),
            ({"rollout_id": "t", "temperature": -0.5}, "temperature must be"),
            ({"rollout_id": "p", "top_p": 0}, "top_p must be in (0, 1]"),
            ({"rollout_id": "k", "top_k": 2.5}, "top_k must be an integer"),
        ):
            async with http.post(f"{admin_url(url)}/admin/rollouts", json=body, headers=headers) as r:
                assert r.status == 400 and reason in (await r.json())["error"], body
        ok = await register(http, url, rollout_id="z", attempt_id="z.a0.1")
        async with http.get(f"{admin_url(url)}/admin/rollouts/z", headers=headers) as r:
            assert r.status == 200 and ok["rollout_id"] == "z"


# A text part whose text is not a string, per dialect (the Anthropic one was an HTTP 500 in plain text).
NON_STRING_TEXT = {
    "anthropic": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "chat": {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    "responses": {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
}


@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
async def test_bad_inputs_answer_in_dialect_and_publish_nothing(kafka_settings, dialect) -> None:
    tok = H.tiny_tokenizer()
    async with (
        ScriptedEngine(tok, ["ok"] * 10) as engine,
        running_proxy(kafka_settings, engine.url, max_request_bytes=200_000) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        a = await register(http, url, rollout_id=f"a-{dialect}")
        b = await register(http, url, rollout_id=f"b-{dialect}")
        sealed = await register(http, url, rollout_id=f"s-{dialect}")
        expired = await register(http, url, rollout_id=f"e-{dialect}", ttl_s=0.001)
        await seal(http, url, sealed["rollout_id"])
        await asyncio.sleep(0.05)  # let the 1 ms ttl run out
        good = request_body(dialect, [], False)
        rid, sec = a["rollout_id"], a["secret"]
        rows = [
            ("missing key", rid, "", good, None, 401),
            ("wrong key", rid, "nope", good, None, 401),
            ("other rollout's key", rid, b["secret"], good, None, 401),
            ("sealed", sealed["rollout_id"], sealed["secret"], good, None, 401),
            ("expired", expired["rollout_id"], expired["secret"], good, None, 401),
            ("too large", rid, sec, {**good, "pad": "x" * 300_000}, None, 413),
            ("invalid json", rid, sec, None, b'{"model": ', 400),
            ("bad schema", rid, sec, {"model": "policy", "messages": 5, "input": 5}, None, 400),
            ("non-string text block", rid, sec, {**good, **NON_STRING_TEXT[dialect]}, None, 400),
        ]
        for name, r, s, body, raw, want in rows:
            status, out = await call(http, url, r, s, dialect, body, raw)
            assert status == want, (name, out)
            err = json.loads(out)
            if dialect == "anthropic":
                assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, name
            else:
                assert set(err["error"]) == {"message", "type", "param", "code"}, name
        assert engine.requests == []  # nothing reached the engine either
        # one good call, the marker: it must be the only event of these rollouts on the broker
        status, _ = await call(http, url, rid, sec, dialect, good)
        assert status == 200
        metrics = await (await http.get(f"{admin_url(url)}/metrics")).text()  # the admin listener
        assert "clawstream_proxy_calls_total" in metrics and 'status="401"' in metrics and 'status="413"' in metrics
    ids = {a["rollout_id"], b["rollout_id"], sealed["rollout_id"], expired["rollout_id"]}
    events = consume_calls(kafka_settings, ids, 2, timeout=8)
    assert [(e.rollout_id, e.seq) for e in events] == [(rid, 0)]


@pytest.mark.parametrize("dialect", ["anthropic", "chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_engine_down_is_502_in_dialect(kafka_settings, dialect, stream) -> None:
    # engine_retries=0: the engine is gone for good (tests/integration/test_proxy_engine_restart.py waits for one)
    async with (
        running_proxy(kafka_settings, "http://127.0.0.1:9", engine_retries=0) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        a = await register(http, url, rollout_id=f"d-{dialect}-{stream}")
        status, out = await call(http, url, a["rollout_id"], a["secret"], dialect, request_body(dialect, [], stream))
        assert status == 502
        err = json.loads(out)
        if dialect == "anthropic":
            assert err["error"]["type"] == "api_error"
        else:
            assert err["error"]["code"] == "engine_unavailable"
        sealed = await seal(http, url, a["rollout_id"])  # an infrastructure failure: re-issued, never a zero reward
        assert sealed["status"] == "infra_failure" and "engine" in sealed["infra_failure"], sealed
    assert consume_calls(kafka_settings, {a["rollout_id"]}, 1, timeout=5) == []


async def test_kafka_unreachable_is_503_and_flags_the_rollout(kafka_settings) -> None:
    dead = KafkaSettings(bootstrap_servers="127.0.0.1:1", topic_prefix=kafka_settings.topic_prefix)
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["ok"]) as engine,
        running_proxy(dead, engine.url, publish_timeout_s=1.5) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        a = await register(http, url, rollout_id="k-1")
        status, out = await call(http, url, "k-1", a["secret"], "chat", request_body("chat", [], False))
        assert status == 503 and json.loads(out)["error"]["code"] == "service_unavailable"
        sealed = await seal(http, url, "k-1")
        assert sealed["status"] == "infra_failure" and "not confirmed" in sealed["infra_failure"]
        assert sealed["calls_served"] == 0


async def test_proxy_and_cpu_engine_work_together_with_default_settings(kafka_settings) -> None:
    """``clawstream infer --model DIR`` and ``clawstream proxy --model DIR --engine-url URL`` as the README shows
    them, without a model-name flag: the proxy asks for the model the engine serves (``policy``), the engine
    follows weight versions under that name, and its cached-token report reaches the harness and the call event."""
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers or "",
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    worker = await asyncio.to_thread(Worker, ["--model", str(H.tiny_model_dir())], env)
    try:
        assert f"cpu engine serving '{DEFAULT_MODEL_NAME}'" in worker.log()
        async with running_proxy(kafka_settings, worker.url or "") as (proxy, url), aiohttp.ClientSession() as http:
            assert proxy.settings.engine_model == DEFAULT_MODEL_NAME
            reg = await register(http, url, rollout_id="defaults", max_tokens=8, temperature=0.0)
            body = request_body("chat", [], False)
            raws = []
            for _ in range(2):  # the same request twice, as a harness retrying it
                status, raw = await call(http, url, reg["rollout_id"], reg["secret"], "chat", body)
                assert status == 200, raw
                raws.append(raw)
            metrics = await (await http.get(f"{worker.url}/metrics")).text()
        events = consume_calls(kafka_settings, {reg["rollout_id"]}, 2)
    finally:
        await asyncio.to_thread(worker.stop)
    assert [e.seq for e in events] == [0, 1] and all(e.policy_version == 0 for e in events)
    usages = [cached_in_usage("chat", raw, False) for raw in raws]
    assert usages == [(e.cached_prompt_tokens, e.prompt_len) for e in events]  # the CPU engine always reports it
    assert all(e.gpu_utilization is None and e.gpu_memory_used_bytes is None for e in events)  # CPU: no readings
    if "clawstream_engine_prefix_cache_queries_total 0.0" not in metrics:  # the engine has a prefix cache
        cached, prompt = usages[1]
        assert cached >= prompt // 2, usages
