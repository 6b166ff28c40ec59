"""Helpers for the serving-proxy tests: the tiny model, harness-shaped requests per dialect, an SSE reader.

The request builders copy the shapes the real harnesses send (see docs/harnesses.md#what-the-proxy-must-accept):
Claude Code's
``system`` blocks with ``cache_control`` plus a ``role:"system"`` message inside ``messages``, ``thinking`` /
``context_management`` / ``metadata`` fields; Codex's ``developer`` input items, ``reasoning``/``include``/``store``;
Qwen Code's chat request with ``stream_options.include_usage``. Each builder turns the proxy's previous answer
(decoded from its JSON or SSE response) back into the history, exactly as a harness does.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = "create hello.txt containing hi"
CLAUDE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {
        "type": "text",
        "text": "You are an interactive agent that helps users with software engineering tasks. " * 8,
        "cache_control": {"type": "ephemeral"},
    },
]
CLAUDE_MID_SYSTEM = "# Environment\nWorking directory: /tmp/ws\nPlatform: linux\n" * 4
CODEX_DEVELOPER = "You are Codex, a coding agent. Use exec_command to run shell commands. " * 10
QWEN_SYSTEM = "You are Qwen Code, an interactive CLI agent. Use write_file to write files. " * 10

CLAUDE_TOOLS = [
    {
        "name": "Write",
        "description": "Writes a file to the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["file_path", "content"],
        },
    },
    {
        "name": "Bash",
        "description": "Executes a bash command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
]
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
            "required": ["cmd"],
        },
    },
    {"type": "web_search"},
]
QWEN_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Writes content to a file.",
            "parameters": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["file_path", "content"],
            },
        },
    },
]


@functools.cache
def tiny_model_dir() -> Path:
    """The tiny Qwen3-architecture model + tokenizer, built once per test process (~5 s)."""
    from policy.tiny_model import init_tiny_model

    where = Path(tempfile.mkdtemp(prefix="clawstream-tiny-"))
    # 15 MB a test process: removed at exit (a day of test runs left 3.5 GB of these in /tmp)
    atexit.register(shutil.rmtree, where, True)
    return init_tiny_model(where, seed=0, progress=None)


@functools.cache
def tiny_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


# --- SSE --------------------------------------------------------------------------------------------------------


def read_sse(raw: bytes) -> tuple[list[tuple[str | None, Any]], int]:
    """SSE bytes → ([(event name or None, parsed data or '[DONE]')], number of comment lines)."""
    events: list[tuple[str | None, Any]] = []
    comments = 0
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                comments += 1
            elif line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
        if data:
            text = "\n".join(data)
            events.append((name, text if text == "[DONE]" else json.loads(text)))
    return events, comments


def answer_from_sse(dialect: str, raw: bytes) -> dict[str, Any]:
    """Rebuild the non-streaming JSON body a client library would assemble from the proxy's SSE stream."""
    events, _ = read_sse(raw)
    if dialect == "anthropic":
        message = events[0][1]["message"]
        blocks: list[dict[str, Any]] = []
        for _name, data in events:
            if data == "[DONE]":
                continue
            if data["type"] == "content_block_start":
                blocks.append(dict(data["content_block"]))
                blocks[-1]["_json"] = ""
            elif data["type"] == "content_block_delta":
                d, b = data["delta"], blocks[data["index"]]
                if d["type"] == "text_delta":
                    b["text"] += d["text"]
                elif d["type"] == "input_json_delta":
                    b["_json"] += d["partial_json"]
                elif d["type"] == "thinking_delta":
                    b["thinking"] += d["thinking"]
            elif data["type"] == "message_delta":
                message["stop_reason"] = data["delta"]["stop_reason"]
        for b in blocks:
            raw_json = b.pop("_json")
            if b["type"] == "tool_use":
                b["input"] = json.loads(raw_json)
        message["content"] = blocks
        return message
    if dialect == "chat":
        msg: dict[str, Any] = {"role": "assistant", "content": None}
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        for _name, data in events:
            if data == "[DONE]" or not data.get("choices"):
                continue
            ch = data["choices"][0]
            delta = ch["delta"]
            if delta.get("content"):
                msg["content"] = (msg["content"] or "") + delta["content"]
            for tc in delta.get("tool_calls") or []:
                cur = calls.setdefault(
                    tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                cur["id"] = tc.get("id") or cur["id"]
                cur["function"]["name"] += tc.get("function", {}).get("name", "")
                cur["function"]["arguments"] += tc.get("function", {}).get("arguments", "")
            finish = ch.get("finish_reason") or finish
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        return {"choices": [{"message": msg, "finish_reason": finish}]}
    for _name, data in events:
        if data["type"] in ("response.completed", "response.incomplete"):
            return data["response"]
    raise AssertionError("no response.completed event")


# --- harness-shaped requests -------------------------------------------------------------------------------------


def claude_request(history: list[dict[str, Any]], stream: bool, model: str = "policy") -> dict[str, Any]:
    """Claude Code's /v1/messages body around ``history`` (user/assistant messages after the mid system one)."""
    return {
        "model": model,
        "max_tokens": 32000,
        "stream": stream,
        "system": CLAUDE_SYSTEM,
        "messages": [{"role": "system", "content": CLAUDE_MID_SYSTEM}, *history],
        "tools": CLAUDE_TOOLS,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "context_management": {"edits": []},
        "metadata": {"user_id": json.dumps({"session_id": "s-1"})},
        "temperature": 1,
    }


def claude_first_user() -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>Be concise.</system-reminder>"},
            {"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}},
        ],
    }


def claude_followup(answer: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """The assistant message Claude Code stores from ``answer`` + the user message with the tool results."""
    content = [dict(b) for b in answer["content"]]
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": result} for b in content if b["type"] == "tool_use"
    ]
    return [{"role": "assistant", "content": content}, {"role": "user", "content": results}]


def codex_request(history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    return {
        "model": "policy",
        "instructions": "",
        "stream": stream,
        "store": False,
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "reasoning": {"effort": "medium"},
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k-1",
        "tools": CODEX_TOOLS,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": CODEX_DEVELOPER}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
            *history,
        ],
    }


def codex_followup(response: dict[str, Any], result: str) -> list[dict[str, Any]]:
    """Codex replays the output items it received, then one function_call_output per call."""
    items = [dict(item) for item in response["output"]]
    outs = [
        {"type": "function_call_output", "call_id": i["call_id"], "output": result}
        for i in items
        if i["type"] == "function_call"
    ]
    return items + outs


def qwen_request(history: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    return {
        "model": "policy",
        "stream": stream,
        "stream_options": {"include_usage": True},
        "tools": QWEN_TOOLS,
        "messages": [
            {"role": "system", "content": QWEN_SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": TASK}]},
            *history,
        ],
        "max_tokens": 2048,
        "temperature": 0.7,
    }


def qwen_followup(completion: dict[str, Any], result: str) -> list[dict[str, Any]]:
    msg = completion["choices"][0]["message"]
    out = [{"role": "assistant", "content": msg.get("content"), "tool_calls": msg.get("tool_calls")}]
    for tc in msg.get("tool_calls") or []:
        out.append({"role": "tool", "tool_call_id": tc["id"], "content": result})
    return out
