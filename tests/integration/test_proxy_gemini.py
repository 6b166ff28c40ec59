"""The Gemini dialect through the real proxy over HTTP: ``generateContent`` and ``streamGenerateContent?alt=sse`` with
a function call round trip, the way Gemini CLI (``@google/genai``) sends them (``x-goog-api-key``, the model in the
URL, ``contents`` / ``systemInstruction`` / ``functionDeclarations``). The recorded call events are prefix
consistent (the second prompt extends the first prompt and answer token for token), the engine saw what was recorded,
``usageMetadata`` counts the recorded tokens, and refusals (a bad body, a sealed key) are Google-format errors.
Real broker, scripted engine through the real tokenizer.
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from schemas.events import CallKind, Dialect
from streams.tree import TreeCall, rebuild_prompts
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls, register, running_proxy, seal
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = pytest.mark.integration

MODEL = "gemini-2.5-pro"
DONE = "All done: hello.txt holds hi."
WRITE = {"file_path": "hello.txt", "content": "hi"}
SYSTEM = "You are a non-interactive CLI agent specializing in software engineering tasks. " * 20
TOOLS = [
    {
        "functionDeclarations": [
            {
                "name": "write_file",
                "description": "Writes content to a file.",
                "parametersJsonSchema": {
                    "type": "object",
                    "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["file_path", "content"],
                },
            }
        ]
    }
]
_DATA = re.compile(r"^\s*data: (.*)(?:\n\n|\r\r|\r\n\r\n)")


def gemini_body(history: list[dict[str, Any]]) -> dict[str, Any]:
    first = {"role": "user", "parts": [{"text": "<session_context>setup</session_context>"}, {"text": "write hi"}]}
    return {
        "contents": [first, *history],
        "systemInstruction": {"role": "user", "parts": [{"text": SYSTEM}]},
        "tools": TOOLS,
        "generationConfig": {"temperature": 1, "topP": 0.95, "thinkingConfig": {"includeThoughts": True}},
    }


def followup(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """The model's content as Gemini CLI keeps it, then one functionResponse per functionCall."""
    content = answer["candidates"][0]["content"]
    results = [
        {
            "functionResponse": {
                "id": p["functionCall"].get("id"),
                "name": p["functionCall"]["name"],
                "response": {"output": "ok"},
            }
        }
        for p in content["parts"]
        if "functionCall" in p
    ]
    return [content, {"role": "user", "parts": results}] if results else [content]


def read_stream(raw: bytes) -> dict[str, Any]:
    """The chunks as the SDK's ``processStreamResponse`` takes them off its buffer; nothing else may be left."""
    buffer, chunks = raw.decode(), []
    while (match := _DATA.match(buffer)) is not None:
        chunks.append(json.loads(match[1]))
        buffer = buffer[match.end() :]
    assert buffer.strip() == "" and len(chunks) == 1, raw
    return chunks[0]


async def post(
    http: aiohttp.ClientSession, url: str, rid: str, secret: str, body: Any, stream: bool
) -> tuple[int, bytes]:
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "x-goog-api-key": secret}
    async with http.post(f"{url}/r/{rid}/v1beta/models/{MODEL}:{method}", data=data, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_function_call_round_trip_is_prefix_consistent_on_the_broker(kafka_settings, stream: bool) -> None:
    tok = H.tiny_tokenizer()
    script = [tool_call_text("write_file", WRITE), DONE]
    async with (
        ScriptedEngine(tok, script, delay_s=0.5 if stream else 0, prefix_cache=True) as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        reg = await register(http, url, rollout_id=f"r-gemini-{stream}", max_tokens=256)
        rid, secret = reg["rollout_id"], reg["secret"]
        history: list[dict[str, Any]] = []
        answers = []
        for _ in range(2):
            status, raw = await post(http, url, rid, secret, gemini_body(history), stream)
            assert status == 200, raw
            assert not stream or raw.startswith(b"\n")  # keep-alives while the engine worked
            answer = read_stream(raw) if stream else json.loads(raw)
            answers.append(answer)
            history = history + followup(answer)
        # A malformed body is Google's 400, and it is not a call (no event, the quota untouched).
        status, raw = await post(http, url, rid, secret, {"contents": [{"role": "model", "parts": "x"}]}, stream)
        assert status == 400 and json.loads(raw)["error"]["status"] == "INVALID_ARGUMENT", raw
        assert (await seal(http, url, rid))["calls_served"] == 2
        status, raw = await post(http, url, rid, secret, gemini_body(history), stream)
        assert status == 401 and json.loads(raw)["error"] == {
            "code": 401,
            "message": "this rollout is sealed; its API key is revoked",
            "status": "UNAUTHENTICATED",
        }
    first, second = (a["candidates"][0] for a in answers)
    call = next(p["functionCall"] for p in first["content"]["parts"] if "functionCall" in p)
    assert (call["name"], call["args"], first["finishReason"]) == ("write_file", WRITE, "STOP")
    assert second["content"]["parts"] == [{"text": DONE}]
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
    assert events[1].parent_call_id == events[0].call_id and events[1].shared_prefix_len == len(p1) + len(g1)
    assert p2[: len(p1) + len(g1)] == p1 + g1
    assert [p1, p2] == [r.prompt_ids for r in engine.requests]
    for e, a in zip(events, answers, strict=True):
        assert e.dialect is Dialect.GEMINI and e.requested_model == MODEL and e.call_kind == CallKind.MAIN
        assert not e.tampered and e.flags == []
        usage = a["usageMetadata"]
        assert usage["promptTokenCount"] == e.prompt_len and usage["candidatesTokenCount"] == len(e.generated_tokens)
        assert usage.get("cachedContentTokenCount", 0) == e.cached_prompt_tokens
    assert events[1].cached_prompt_tokens >= len(p1) + len(g1)
    assert [e.finish_reason for e in events] == ["tool_calls", "stop"]
