"""Transcripts in OpenClaw's session format (what PinchBench's checks read), built from a run's messages.

Pure: a readable conversation in, the session records out, compared whole. The proxy's own parsers turn a
harness-shaped request into the messages the seal reports (``transcript_messages``), so the transcript of a
Claude Code run is checked end to end from the request body it sends.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from producers.proxy.conversation import Message, ToolCall, transcript_messages
from producers.proxy.dialects import parse_anthropic
from producers.tasks.transcript import (
    final_answer_messages,
    find_openclaw_session,
    parse_session_jsonl,
    session_transcript,
)

USAGE = {
    "input": 0,
    "output": 0,
    "cacheRead": 0,
    "cacheWrite": 0,
    "totalTokens": 0,
    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
}


def test_messages_become_session_records() -> None:
    messages = [
        {"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Read notes.md"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should read it.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "notes.md"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Beta: June 1"},
        {"role": "assistant", "content": "The beta is on June 1."},
    ]
    records = session_transcript(messages, cwd="/ws", session_id="s-1", start_ms=1_767_225_600_000)
    assert records == [
        {"type": "session", "version": 3, "id": "s-1", "timestamp": "2026-01-01T00:00:00.000Z", "cwd": "/ws"},
        {
            "type": "model_change",
            "id": "00000001",
            "parentId": None,
            "timestamp": "2026-01-01T00:00:00.001Z",
            "provider": "clawstream",
            "modelId": "policy",
        },
        {
            "type": "thinking_level_change",
            "id": "00000002",
            "parentId": "00000001",
            "timestamp": "2026-01-01T00:00:00.002Z",
            "thinkingLevel": "off",
        },
        {
            "type": "message",
            "id": "00000003",
            "parentId": "00000002",
            "timestamp": "2026-01-01T00:00:00.003Z",
            "message": {
                "role": "user",
                "content": [{"type": "text", "text": "Read notes.md"}],
                "timestamp": 1_767_225_600_003,
            },
        },
        {
            "type": "message",
            "id": "00000004",
            "parentId": "00000003",
            "timestamp": "2026-01-01T00:00:00.004Z",
            "message": {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read it."},
                    {"type": "toolCall", "id": "call_1", "name": "read", "arguments": {"path": "notes.md"}},
                ],
                "api": "openai-completions",
                "provider": "clawstream",
                "model": "policy",
                "usage": USAGE,
                "stopReason": "toolUse",
                "timestamp": 1_767_225_600_004,
            },
        },
        {
            "type": "message",
            "id": "00000005",
            "parentId": "00000004",
            "timestamp": "2026-01-01T00:00:00.005Z",
            "message": {
                "role": "toolResult",
                "toolCallId": "call_1",
                "toolName": "read",
                "content": [{"type": "text", "text": "Beta: June 1"}],
                "isError": False,
                "timestamp": 1_767_225_600_005,
            },
        },
        {
            "type": "message",
            "id": "00000006",
            "parentId": "00000005",
            "timestamp": "2026-01-01T00:00:00.006Z",
            "message": {
                "role": "assistant",
                "content": [{"type": "text", "text": "The beta is on June 1."}],
                "api": "openai-completions",
                "provider": "clawstream",
                "model": "policy",
                "usage": USAGE,
                "stopReason": "stop",
                "timestamp": 1_767_225_600_006,
            },
        },
    ]
    # deterministic, and every line is JSON as a session file holds it
    assert session_transcript(messages, cwd="/ws", session_id="s-1", start_ms=1_767_225_600_000) == records
    jsonl = "\n".join(json.dumps(r) for r in records) + "\n"
    assert parse_session_jsonl(jsonl) == records


def test_odd_content_and_arguments() -> None:
    records = session_transcript(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, "b"]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c", "function": {"name": "run", "arguments": "not json"}},
                    {"id": "d", "function": {"name": "noop", "arguments": ""}},
                ],
            },
            {"role": "tool", "tool_call_id": "c", "name": "run_given", "content": None},
        ]
    )
    user, assistant, tool = (r["message"] for r in records[3:])
    assert user["content"] == [{"type": "text", "text": "a\nb"}]
    assert [c["arguments"] for c in assistant["content"]] == [{"raw": "not json"}, {}]
    assert tool["toolName"] == "run_given" and tool["content"] == [{"type": "text", "text": ""}]
    assert final_answer_messages("p", "") == [{"role": "user", "content": "p"}]
    assert final_answer_messages("p", "done") == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "done"},
    ]


def test_parse_session_jsonl_keeps_bad_lines() -> None:
    out = parse_session_jsonl('{"type": "session"}\n\n  \nnot json\n{"type": "message"}\n')
    assert out[0] == {"type": "session"} and out[2] == {"type": "message"}
    assert out[1]["raw"] == "not json" and "parse_error" in out[1]


def test_find_openclaw_session(tmp_path: Path) -> None:
    assert find_openclaw_session(tmp_path) is None
    sessions = tmp_path / ".openclaw" / "agents" / "main" / "sessions"
    sessions.mkdir(parents=True)
    old, new = sessions / "old.jsonl", sessions / "new.jsonl"
    old.write_text("{}\n")
    new.write_text("{}\n")
    os.utime(old, (1, 1))
    assert find_openclaw_session(tmp_path) == new  # no index: the newest file
    (sessions / "sessions.json").write_text(
        json.dumps(
            {
                "agent:main:other": {"sessionId": "new", "updatedAt": 5},
                "agent:main:main": {"sessionId": "old", "updatedAt": 1},
            }
        )
    )
    assert find_openclaw_session(tmp_path) == old  # the agent's main session, as PinchBench resolves it


def test_claude_code_request_to_transcript() -> None:
    """What the proxy saw of a Claude Code run (its Anthropic request + the answer) → session records."""
    body = {
        "model": "policy",
        "max_tokens": 512,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "Write hi to a.txt"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "easy", "signature": "x"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Write",
                        "input": {"file_path": "/ws/a.txt", "content": "hi"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "File created"}],
                    }
                ],
            },
        ],
    }
    conv = parse_anthropic(body).conversation
    answer = Message("assistant", "Done: a.txt says hi.", tool_calls=())
    messages = transcript_messages(conv, answer)
    assert messages[0]["role"] == "system" and messages[-2] == {
        "role": "tool",
        "content": "File created",
        "tool_call_id": "toolu_1",
    }
    body_records = [r["message"] for r in session_transcript(messages) if r["type"] == "message"]
    assert [m["role"] for m in body_records] == ["user", "assistant", "toolResult", "assistant"]
    assert body_records[0]["content"][0]["text"].endswith("Write hi to a.txt")
    assert body_records[1]["content"] == [
        {"type": "thinking", "thinking": "easy"},
        {
            "type": "toolCall",
            "id": "toolu_1",
            "name": "Write",
            "arguments": {"file_path": "/ws/a.txt", "content": "hi"},
        },
    ]
    assert body_records[2]["toolName"] == "Write"  # Anthropic results carry no name: taken from the call
    assert body_records[3]["content"] == [{"type": "text", "text": "Done: a.txt says hi."}]
    tool_answer = Message("assistant", "", tool_calls=(ToolCall("call_9", "Bash", '{"command": "ls"}'),))
    last = session_transcript(transcript_messages(conv, tool_answer))[-1]["message"]
    assert last["stopReason"] == "toolUse" and last["content"][0]["arguments"] == {"command": "ls"}
