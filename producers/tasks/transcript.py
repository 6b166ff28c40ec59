"""Agent transcripts in OpenClaw's session format, the one PinchBench's automated checks and judge read.

For OpenClaw rollouts the grader gets OpenClaw's own session file (:func:`find_openclaw_session`); for every other
harness :func:`session_transcript` writes the same records from the conversation the serving proxy saw (the last
main-agent call's messages plus its answer; system messages left out, as OpenClaw leaves them out). The format,
record by record: docs/task_suites.md#transcripts-openclaws-session-format.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

SESSION_VERSION = 3
ZERO_USAGE = {
    "input": 0,
    "output": 0,
    "cacheRead": 0,
    "cacheWrite": 0,
    "totalTokens": 0,
    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
}


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def _text(content: Any) -> str:
    """Message content as text: a string, or the text of OpenAI/Anthropic-style content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p if isinstance(p, str) else str(p.get("text", ""))
            for p in content
            if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
        )
    return str(content)


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the object OpenClaw stores (JSON text is parsed; unparseable text kept as ``raw``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return {"raw": value}
    return value if isinstance(value, dict) else {"value": value}


def session_transcript(
    messages: Iterable[Mapping[str, Any]],
    *,
    cwd: str = "",
    session_id: str | None = None,
    model: str = "policy",
    provider: str = "clawstream",
    api: str = "openai-completions",
    start_ms: int = 0,
) -> list[dict[str, Any]]:
    """OpenClaw session records (as PinchBench reads them) of a conversation; pure and deterministic for a given
    ``session_id`` and ``start_ms`` (entry ids count up, each entry is 1 ms after the previous one)."""
    sid = session_id or str(uuid.UUID(int=0))
    records: list[dict[str, Any]] = [
        {"type": "session", "version": SESSION_VERSION, "id": sid, "timestamp": _iso(start_ms), "cwd": cwd}
    ]
    tool_names: dict[str, str] = {}

    def add(entry: dict[str, Any]) -> None:
        n = len(records)
        ms = start_ms + n
        parent = records[-1]["id"] if n > 1 else None
        if entry.get("type") == "message":
            entry["message"]["timestamp"] = ms
        records.append(
            {"type": entry.pop("type"), "id": f"{n:08x}", "parentId": parent, "timestamp": _iso(ms), **entry}
        )

    add({"type": "model_change", "provider": provider, "modelId": model})
    add({"type": "thinking_level_change", "thinkingLevel": "off"})
    for msg in messages:
        role = msg.get("role")
        if role == "user":
            add(
                {
                    "type": "message",
                    "message": {"role": "user", "content": [{"type": "text", "text": _text(msg.get("content"))}]},
                }
            )
        elif role == "assistant":
            content: list[dict[str, Any]] = []
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            if isinstance(reasoning, str) and reasoning:
                content.append({"type": "thinking", "thinking": reasoning})
            text = _text(msg.get("content"))
            if text:
                content.append({"type": "text", "text": text})
            calls = msg.get("tool_calls") or []
            for call in calls:
                fn = call.get("function") or {}
                name = str(fn.get("name", call.get("name", "")))
                call_id = str(call.get("id", ""))
                tool_names[call_id] = name
                content.append(
                    {
                        "type": "toolCall",
                        "id": call_id,
                        "name": name,
                        "arguments": _arguments(fn.get("arguments", call.get("arguments", {}))),
                    }
                )
            add(
                {
                    "type": "message",
                    "message": {
                        "role": "assistant",
                        "content": content,
                        "api": api,
                        "provider": provider,
                        "model": model,
                        "usage": copy.deepcopy(ZERO_USAGE),
                        "stopReason": "toolUse" if calls else "stop",
                    },
                }
            )
        elif role == "tool":
            call_id = str(msg.get("tool_call_id", ""))
            name = str(msg.get("name") or tool_names.get(call_id, ""))
            add(
                {
                    "type": "message",
                    "message": {
                        "role": "toolResult",
                        "toolCallId": call_id,
                        "toolName": name,
                        "content": [{"type": "text", "text": _text(msg.get("content"))}],
                        "isError": False,
                    },
                }
            )
        # system / developer: not in an OpenClaw session file
    return records


def final_answer_messages(prompt: str, answer: str) -> list[dict[str, str]]:
    """The least a transcript can say when no conversation was recorded: the prompt and the final answer the harness
    printed — no tool calls, so checks that look for them find none."""
    return [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": answer}] if answer else [])


def parse_session_jsonl(text: str) -> list[dict[str, Any]]:
    """A session file as PinchBench loads it: one dict a line, blank lines skipped, a bad line kept as
    ``{"raw": line, "parse_error": why}``."""
    out: list[dict[str, Any]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            out.append({"raw": line, "parse_error": str(exc)})
    return out


OPENCLAW_AGENTS_DIR = ".openclaw/agents"  # under HOME: <agent>/sessions/{sessions.json, <session id>.jsonl}


def find_openclaw_session(home: Path, agents_dir: str = OPENCLAW_AGENTS_DIR) -> Path | None:
    """OpenClaw's session file of a run whose HOME was ``home``, found as PinchBench finds it: the session
    ``sessions.json`` names (the agent's main session first, else the most recently updated), else the most recently
    written ``*.jsonl``; None if there is none."""
    agents = home / agents_dir
    if not agents.is_dir():
        return None
    for agent_dir in sorted(p for p in agents.iterdir() if p.is_dir()):
        sessions = agent_dir / "sessions"
        try:
            store = json.loads((sessions / "sessions.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(store, dict):
            continue
        entries = [e for e in store.values() if isinstance(e, dict) and e.get("sessionId")]
        main = store.get(f"agent:{agent_dir.name}:main")
        ranked = ([main] if isinstance(main, dict) else []) + sorted(
            entries,
            key=lambda e: e.get("updatedAt") if isinstance(e.get("updatedAt"), int | float) else -1,
            reverse=True,
        )
        for entry in ranked:
            path = sessions / f"{entry.get('sessionId')}.jsonl"
            if path.is_file():
                return path
    files = [p for p in agents.glob("*/sessions/*.jsonl") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime) if files else None
