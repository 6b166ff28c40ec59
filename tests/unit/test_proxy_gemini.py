"""The Gemini dialect, pure: Gemini CLI's request shape parsed into the internal conversation, its answer read back
as the same turn (the prefix-consistency contract), Google's error body, the stream framing the @google/genai SDK
parses, and call events of the new ``GEMINI`` dialect beside records written with the previous schema."""

from __future__ import annotations

import dataclasses
import io
import json
import re

import pytest
from fastavro import parse_schema, schemaless_writer

from producers.proxy.answer import Answer, StreamHead
from producers.proxy.conversation import DialectError, Message, ToolCall
from producers.proxy.dialects import PARSERS, RequestLimits
from producers.proxy.emit import EMITTERS
from producers.proxy.gemini import gemini_error, parse_gemini, with_route
from producers.proxy.tool_parse import ParsedToolCall, ParsedTurn
from schemas.codec import MARKER, SCHEMA_DIR, schema_fingerprint
from schemas.events import CallEvent, Dialect
from tests.support.factories import sample_events

# The shape Gemini CLI 0.61.0 sends (captured: systemInstruction, a session-context part, functionDeclarations with
# parametersJsonSchema, thinkingConfig), cut down.
CLI_BODY = {
    "contents": [
        {"role": "user", "parts": [{"text": "<session_context>...</session_context>"}, {"text": "write hi.txt"}]},
        {
            "role": "model",
            "parts": [
                {"text": "Let me think.", "thought": True, "thoughtSignature": "abc"},
                {"text": "Writing it."},
                {
                    "functionCall": {
                        "id": "fc_1",
                        "name": "write_file",
                        "args": {"file_path": "hi.txt", "content": "hi"},
                    }
                },
            ],
        },
        {
            "role": "user",
            "parts": [{"functionResponse": {"id": "fc_1", "name": "write_file", "response": {"output": "written"}}}],
        },
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are a CLI agent."}]},
    "tools": [
        {
            "functionDeclarations": [
                {
                    "name": "write_file",
                    "description": "Writes a file.",
                    "parametersJsonSchema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
                }
            ]
        },
        {"googleSearch": {}},
    ],
    "generationConfig": {"temperature": 1, "topP": 0.95, "thinkingConfig": {"includeThoughts": True}},
}


def test_gemini_cli_request_becomes_the_internal_conversation() -> None:
    parsed = PARSERS[Dialect.GEMINI](CLI_BODY)
    msgs = parsed.conversation.messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0].content == "You are a CLI agent."
    assert msgs[1].content == "<session_context>...</session_context>\nwrite hi.txt"
    assert msgs[2] == Message(
        "assistant",
        "Writing it.",
        "Let me think.",
        (ToolCall("fc_1", "write_file", {"file_path": "hi.txt", "content": "hi"}),),
    )
    assert (msgs[3].content, msgs[3].tool_call_id, msgs[3].name) == ("written", "fc_1", "write_file")
    assert [t["function"]["name"] for t in parsed.conversation.tools] == ["write_file"]
    assert parsed.conversation.tools[0]["function"]["parameters"]["properties"] == {"file_path": {"type": "string"}}
    assert parsed.max_tokens is None and not parsed.stream


def test_the_url_names_the_model_and_whether_to_stream() -> None:
    parsed = parse_gemini({**CLI_BODY, "generationConfig": {"maxOutputTokens": 64}})
    routed = with_route(parsed, {"model": "gemini-2.5-pro"}, "/r/x/v1beta/models/gemini-2.5-pro:streamGenerateContent")
    assert (routed.model, routed.stream, routed.max_tokens) == ("gemini-2.5-pro", True, 64)
    assert not with_route(parsed, {"model": "m"}, "/r/x/v1beta/models/m:generateContent").stream


def _answer(turn: ParsedTurn, finish: str = "stop") -> Answer:
    ids = [f"fc_{i}" for i in range(len(turn.tool_calls))]
    return Answer(turn, finish, 100, 7, "gemini-2.5-pro", "0123abcd", 1, ids, cached_tokens=40)


def test_an_answer_echoed_back_is_the_same_turn() -> None:
    """What the proxy returns, sent back as the model's content, has the key of the turn the proxy generated."""
    turn = ParsedTurn("Done.", "thinking", [ParsedToolCall("write_file", {"file_path": "a", "content": "b"})])
    body = EMITTERS[Dialect.GEMINI].body(_answer(turn))
    cand = body["candidates"][0]
    assert cand["finishReason"] == "STOP" and cand["content"]["role"] == "model"
    assert body["usageMetadata"] == {
        "promptTokenCount": 100,
        "candidatesTokenCount": 7,
        "totalTokenCount": 107,
        "cachedContentTokenCount": 40,
    }
    echoed = parse_gemini({"contents": [{"role": "user", "parts": [{"text": "go"}]}, cand["content"]]})
    ids = ("fc_0",)
    generated = Message(
        "assistant",
        "Done.",
        "thinking",
        tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, turn.tool_calls, strict=True)),
    )
    assert echoed.conversation.messages[-1].key() == generated.key()
    length = EMITTERS[Dialect.GEMINI].body(_answer(ParsedTurn("cut"), "length"))
    assert length["candidates"][0]["finishReason"] == "MAX_TOKENS"


def test_the_stream_is_what_the_genai_sdk_parses() -> None:
    """The SDK takes ``/^\\s*data: (.*)(?:\\n\\n|\\r\\r|\\r\\n\\r\\n)/`` off its buffer again and again and fails on any
    other leftover; a chunk that is a JSON ``{"error": ...}`` is an ApiError with its code."""
    stream = EMITTERS[Dialect.GEMINI].stream(StreamHead("0123abcd", "m", 1))
    turn = ParsedTurn("hi", "", [ParsedToolCall("ls", {"dir": "."})])
    buffer = (stream.preamble() + stream.keepalive * 3 + stream.body(_answer(turn))).decode()
    line = re.compile(r"^\s*data: (.*)(?:\n\n|\r\r|\r\n\r\n)")
    chunks = []
    while (match := line.match(buffer)) is not None:
        chunks.append(json.loads(match[1]))
        buffer = buffer[match.end() :]
    assert buffer.strip() == "" and len(chunks) == 1
    assert chunks[0]["candidates"][0]["content"]["parts"][1]["functionCall"]["name"] == "ls"
    assert json.loads(stream.error(502, "engine away")) == gemini_error(502, "engine away")


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, "INVALID_ARGUMENT"), (401, "UNAUTHENTICATED"), (413, "INVALID_ARGUMENT"), (503, "UNAVAILABLE")],
)
def test_errors_are_googles_format(status: int, code: str) -> None:
    assert EMITTERS[Dialect.GEMINI].error_body(status, "why") == {
        "error": {"code": status, "message": "why", "status": code}
    }


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"contents": []},
        {"contents": [{"role": "system", "parts": [{"text": "x"}]}]},
        {"contents": [{"parts": "text"}]},
        {"contents": [{"parts": [{"text": 3}]}]},
        {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]},
        {"contents": [{"parts": [{"functionResponse": {"name": "f", "response": "ok"}}]}]},
        {"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{"name": 1}]}]},
        {"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 0}},
        {"contents": [{"parts": [{"text": "x"}]}], "systemInstruction": {"parts": [{"text": None}]}},
    ],
)
def test_a_malformed_body_is_a_dialect_error(body: object) -> None:
    with pytest.raises(DialectError):
        parse_gemini(body)


def test_the_message_limit_counts_contents() -> None:
    with pytest.raises(DialectError, match="'contents' holds 3 items"):
        RequestLimits(max_messages=2).check_body({"contents": [{}, {}, {}]})


def test_a_gemini_call_event_round_trips_and_older_records_still_decode() -> None:
    event = next(e for e in sample_events() if isinstance(e, CallEvent))
    gemini = dataclasses.replace(event, dialect=Dialect.GEMINI)
    assert CallEvent.from_bytes(gemini.to_bytes()).dialect is Dialect.GEMINI
    v6 = json.loads((SCHEMA_DIR / "history" / "call_event.v6.avsc").read_text())
    assert "GEMINI" not in next(f for f in v6["fields"] if f["name"] == "dialect")["type"]["symbols"]
    buf = io.BytesIO()
    buf.write(MARKER + schema_fingerprint(v6))
    schemaless_writer(buf, parse_schema(v6), event.to_record())
    assert CallEvent.from_bytes(buf.getvalue()).to_bytes() == event.to_bytes()
