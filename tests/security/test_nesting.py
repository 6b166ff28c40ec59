"""The policy nests JSON as deep as it likes: the proxy refuses it in the caller's dialect, the transcript survives it.

A hostile harness sends tool-call arguments (a JSON string in Chat and Responses, an inline object in Anthropic's
``tool_use`` ``input``) or any other field nested far past what a real harness sends: every such call is a 4xx in
the caller's dialect (never a 500), counts toward the rollout's call quota, and leaves the proxy answering a
neighbour rollout meanwhile. The policy's own answer nested as deep (model output, parsed by the proxy) is served
as malformed text, never a 500. The transcript builder, given a recorded conversation nested 100k deep, returns
records ``json.dumps`` can write. Real broker, real proxy, scripted engine (tests/support).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from producers.tasks.transcript import session_transcript, stream_transcript
from tests.integration.test_proxy import auth, request_body
from tests.support import proxy_helpers as H
from tests.support.proxy_server import register, running_proxy, seal
from tests.support.scripted_engine import ScriptedEngine

PATHS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
DIALECTS = ("anthropic", "chat", "responses")
DEEP = 100_000
JUST_UNDER_RECURSION = 950  # past the proxy before; a RecursionError when the transcript was built


def nested(depth: int) -> str:
    """JSON text of ``depth`` nested arrays (built as text: no deep Python object)."""
    return "[" * depth + "1" + "]" * depth


_MARK = "@@DEEP@@"


def deep_arguments_body(dialect: str, depth: int) -> bytes:
    """A harness-shaped body whose history holds one assistant tool call with arguments nested ``depth`` deep: a JSON
    string (Chat, Responses) or an inline object (Anthropic ``tool_use.input``)."""
    if dialect == "chat":
        history = [
            {"role": "assistant", "content": "", "tool_calls": [_chat_call('{"a": ' + nested(depth) + "}")]},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
        ]
        return json.dumps(request_body(dialect, history, False)).encode()
    if dialect == "responses":
        call = {"type": "function_call", "call_id": "call_1", "name": "exec_command"}
        history = [{**call, "arguments": '{"a": ' + nested(depth) + "}"}, _responses_output()]
        return json.dumps(request_body(dialect, history, False)).encode()
    block = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"a": _MARK}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}
    history = [{"role": "assistant", "content": [block]}, {"role": "user", "content": [result]}]
    return json.dumps(request_body(dialect, history, False)).replace(f'"{_MARK}"', nested(depth)).encode()


def _chat_call(arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}


def _responses_output() -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": "call_1", "output": "ok"}


def deep_field_body(dialect: str, depth: int) -> bytes:
    """A good body with a field the proxy ignores (``metadata``) nested ``depth`` deep."""
    body = {**request_body(dialect, [], False), "metadata": {"x": _MARK}}
    return json.dumps(body).replace(f'"{_MARK}"', nested(depth)).encode()


def assert_dialect_error(dialect: str, status: int, raw: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, raw[:300])
    err = json.loads(raw)
    if dialect == "anthropic":
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
    return err


async def post(http: aiohttp.ClientSession, url: str, rid: str, secret: str, dialect: str, data: bytes):
    headers = {"Content-Type": "application/json", **auth(dialect, secret)}
    async with http.post(f"{url}/r/{rid}{PATHS[dialect]}", data=data, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.integration
async def test_deep_nesting_is_a_4xx_in_each_dialect_and_counts_toward_the_quota(kafka_settings) -> None:
    tok = H.tiny_tokenizer()
    async with (
        ScriptedEngine(tok, lambda *_: "ok") as engine,
        running_proxy(kafka_settings, engine.url, max_calls_per_rollout=6) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        for dialect in DIALECTS:
            reg = await register(http, url, rollout_id=f"deep-{dialect}")
            rid, secret = reg["rollout_id"], reg["secret"]
            bodies = {
                "arguments 100k deep": deep_arguments_body(dialect, DEEP),
                "arguments 950 deep": deep_arguments_body(dialect, JUST_UNDER_RECURSION),
                "arguments 100 deep": deep_arguments_body(dialect, 100),
                "metadata 100k deep": deep_field_body(dialect, DEEP),
                "metadata 950 deep": deep_field_body(dialect, JUST_UNDER_RECURSION),
            }
            for name, data in bodies.items():
                status, raw = await post(http, url, rid, secret, dialect, data)
                err = assert_dialect_error(dialect, status, raw)
                assert "max_json_depth" in json.dumps(err), (dialect, name, err)
            # the five refusals and this honest call make six: the quota's last call is still served ...
            status, raw = await post(http, url, rid, secret, dialect, deep_arguments_body(dialect, 3))
            assert status == 200, (dialect, raw[:300])
            # ... and the seventh is refused by the quota, which counted the refused calls
            status, raw = await post(http, url, rid, secret, dialect, deep_arguments_body(dialect, 3))
            assert "max_calls_per_rollout" in json.dumps(assert_dialect_error(dialect, status, raw))
            sealed = await seal(http, url, rid)
            assert sealed["status"] == "quota_exceeded" and sealed["calls_served"] == 1, sealed
            assert sealed["usage"]["calls"] == 6 and sealed["errors"] == {"400": 6}, sealed
            json.dumps(sealed)  # the transcript the grader reads is writable
        assert len(engine.requests) == len(DIALECTS)  # no refused call reached the engine


@pytest.mark.integration
async def test_message_count_limit_is_a_4xx_before_rendering(kafka_settings) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), lambda *_: "ok") as engine,
        running_proxy(kafka_settings, engine.url, max_messages=50) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        for dialect in DIALECTS:
            reg = await register(http, url, rollout_id=f"many-{dialect}")
            many = [{"role": "user", "content": "hi"}] * 60
            if dialect == "responses":
                many = [{"type": "message", "role": "user", "content": "hi"}] * 60
            status, raw = await post(
                http,
                url,
                reg["rollout_id"],
                reg["secret"],
                dialect,
                json.dumps(request_body(dialect, many, False)).encode(),
            )
            assert "max_messages" in json.dumps(assert_dialect_error(dialect, status, raw)), raw
        assert engine.requests == []


@pytest.mark.integration
async def test_a_neighbour_is_served_while_deep_bodies_are_refused(kafka_settings) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), lambda *_: "ok") as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        bad = await register(http, url, rollout_id="attacker")
        good = await register(http, url, rollout_id="neighbour")
        deep = deep_arguments_body("chat", 2_000_000)  # ~4 MiB of brackets in the arguments string
        attack = [post(http, url, bad["rollout_id"], bad["secret"], "chat", deep) for _ in range(8)]
        attack_task = asyncio.gather(*attack)
        await asyncio.sleep(0.05)
        for _ in range(3):
            async with http.get(f"{url}/healthz") as r:
                assert r.status == 200
            body = json.dumps(request_body("chat", [], False)).encode()
            status, raw = await post(http, url, good["rollout_id"], good["secret"], "chat", body)
            assert status == 200, raw[:300]
        for status, raw in await attack_task:
            assert_dialect_error("chat", status, raw)
        # No wall-clock bound (a loaded machine misses any): the neighbour's latency under attack is a benchmark
        # figure. Asserted: every neighbour call answered 200 while every attack was refused in its dialect.
        assert len(engine.requests) == 3


@pytest.mark.integration
async def test_the_policys_own_deep_answer_is_served_as_text(kafka_settings) -> None:
    # The model writes a tool call whose arguments nest 1,500 deep (the tiny tokenizer: ~3k tokens): the proxy parses
    # the model's output too, so this is attacker input as much as a request body is.
    deep_call = '<tool_call>\n{"name": "x", "arguments": {"a": ' + nested(1500) + "}}\n</tool_call>"
    async with (
        ScriptedEngine(H.tiny_tokenizer(), lambda *_: deep_call) as _engine,
        running_proxy(kafka_settings, _engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        reg = await register(http, url, rollout_id="deep-answer", max_tokens=16000)
        body = json.dumps({**request_body("chat", [], False), "max_tokens": 8000}).encode()
        status, raw = await post(http, url, reg["rollout_id"], reg["secret"], "chat", body)
        assert status == 200, raw[:300]
        msg = json.loads(raw)["choices"][0]["message"]
        assert not msg.get("tool_calls") and "<tool_call>" in msg["content"]
        sealed = await seal(http, url, reg["rollout_id"])
        json.dumps(sealed)


def _deep_object(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_transcript_of_a_deep_recorded_conversation_returns() -> None:
    deep_obj = _deep_object(DEEP)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": deep_obj}]},
        {
            "role": "assistant",
            "content": deep_obj,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "a", "arguments": nested(DEEP)}},
                {"id": "c2", "type": "function", "function": {"name": "b", "arguments": {"x": deep_obj}}},
                {"id": "c3", "type": "function", "function": {"name": "c", "arguments": {"ok": [1, {"y": 2}]}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": deep_obj},
    ]
    for build in (session_transcript, stream_transcript):
        records = build(messages)
        text = json.dumps(records)  # what the grader's transcript file holds
        assert '{"ok": [1, {"y": 2}]}' in text  # a shallow call is kept as it was
        assert '{"raw": "' + nested(DEEP)[:50] in text  # deep JSON text kept as text, never parsed
        assert text.count("levels: left out") == 2  # deep objects: the user's text part, call c2's arguments
