"""Agent transcripts for graders, built from the conversation the serving proxy recorded.

The proxy's seal reports the last main-agent call's messages plus the model's answer (OpenAI Chat shaped:
``producers.proxy.conversation.transcript_messages``); graders read that, never what the harness or a process it
started could write (``producers.sandbox.run_grader.run_transcript``, docs/security.md). Two shapes:
:func:`session_transcript` writes OpenClaw's session records (what PinchBench's checks and judge and ClawGym-Bench's
payload read; system messages left out, as OpenClaw leaves them out; format:
docs/task_suites.md#transcripts-openclaws-session-format); :func:`stream_transcript` writes the records a harness's
stream-json output holds, closed by a ``result`` record with the model's last answer (graders of a harness's
stdout). :func:`proxy_conversation` decides what the grader may read: once the proxy served the rollout (a call, or
its registration restored after a proxy restart) never harness-written text; OpenClaw's own session file
(:func:`find_openclaw_session`) and the harness's stdout stand in only when the proxy served it nothing.
Nothing here recurses on what it reads: JSON text is measured before it is parsed and a value before it is
stringified (``producers.proxy.nesting``); one nested past ``SAFE_DEPTH`` is kept as text or left out with a note, so
the records are always writable as JSON.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from producers.proxy.nesting import SAFE_DEPTH, loads_within, value_depth

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


LEFT_OUT = f"<nested deeper than {SAFE_DEPTH} levels: left out>"


def _str(value: Any) -> str:
    """Any value as text (``str``), but a value nested past ``SAFE_DEPTH`` (its repr recurses per level) as a note."""
    if isinstance(value, str):
        return value
    return LEFT_OUT if value_depth(value) > SAFE_DEPTH else str(value)


def _text(content: Any) -> str:
    """Message content as text: a string, or the text of OpenAI/Anthropic-style content parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(
            p if isinstance(p, str) else _str(p.get("text", ""))
            for p in content
            if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
        )
    return _str(content)


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the object OpenClaw stores (JSON text is parsed; unparseable text, or text nested past
    ``SAFE_DEPTH``, kept as ``raw``; an object nested past it left out)."""
    if isinstance(value, str):
        try:
            value = loads_within(value) if value.strip() else {}
        except ValueError:
            return {"raw": value}
    if value_depth(value) > SAFE_DEPTH:
        return {"raw": LEFT_OUT}
    return value if isinstance(value, dict) else {"value": value}


def _tool_calls(msg: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """An assistant message's tool calls as (id, name, arguments object), OpenAI Chat or flat shaped."""
    out = []
    for call in msg.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
        name = _str(fn.get("name", call.get("name", "")))
        out.append((_str(call.get("id", "")), name, _arguments(fn.get("arguments", call.get("arguments", {})))))
    return out


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
            calls = _tool_calls(msg)
            for call_id, name, arguments in calls:
                tool_names[call_id] = name
                content.append({"type": "toolCall", "id": call_id, "name": name, "arguments": arguments})
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
            call_id = _str(msg.get("tool_call_id", ""))
            name = _str(msg.get("name") or tool_names.get(call_id, ""))
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


def stream_transcript(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A conversation as the records a harness's stream-json output holds (Claude Code's and Qwen Code's:
    ``{"type": "user" | "assistant", "message": {"role", "content": [...]}}``, Anthropic-shaped content: ``text``,
    ``thinking``, ``tool_use`` with its ``input``, tool results as ``tool_result`` items of a user record; system
    messages left out), closed by ``{"type": "result", "result": <answer>}``: the text of the conversation's last
    assistant message, i.e. the model's last answer ("" when it gave only tool calls or nothing), where Claude Code
    and Qwen Code put their final text and where ``producers.tasks.grading_rules.final_message`` looks first."""
    records: list[dict[str, Any]] = []
    answer = ""
    for msg in messages:
        role = msg.get("role")
        if role == "user":
            text = _text(msg.get("content"))
            records.append({"type": "user", "message": {"role": "user", "content": [{"type": "text", "text": text}]}})
        elif role == "assistant":
            content: list[dict[str, Any]] = []
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            if isinstance(reasoning, str) and reasoning:
                content.append({"type": "thinking", "thinking": reasoning})
            answer = _text(msg.get("content"))
            if answer:
                content.append({"type": "text", "text": answer})
            for call_id, name, arguments in _tool_calls(msg):
                content.append({"type": "tool_use", "id": call_id, "name": name, "input": arguments})
            records.append({"type": "assistant", "message": {"role": "assistant", "content": content}})
        elif role == "tool":
            result = {"type": "tool_result", "tool_use_id": _str(msg.get("tool_call_id", ""))}
            result["content"] = _text(msg.get("content"))
            records.append({"type": "user", "message": {"role": "user", "content": [result]}})
    records.append({"type": "result", "result": answer})
    return records


class TranscriptLost(ValueError):
    """The proxy served the rollout but cannot vouch for its conversation: an infrastructure failure, not a grade."""


def proxy_conversation(seal: Mapping[str, Any], prompt: str) -> list[dict[str, Any]] | None:
    """The conversation a grader reads, from the proxy's seal report (``Rollout.seal_report``): its ``messages``;
    after calls that were none of them the main agent's, the prompt alone (the model gave the main agent no answer);
    None only when the proxy served nothing and was not restarted (the harness's own records may then stand in).
    Raises :class:`TranscriptLost` when the proxy was restarted during the rollout and recorded no main-agent call
    since: the conversation it reports starts at its restart, so it cannot vouch for one."""
    messages = seal.get("messages")
    recorded = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    if recorded:
        return recorded
    served = int(seal.get("calls_served") or 0)
    if seal.get("restored"):
        raise TranscriptLost(
            f"the proxy restarted during the rollout and recorded no main-agent call since ({served} call(s) served "
            "in all): it cannot vouch for the transcript"
        )
    return final_answer_messages(prompt, "") if served > 0 else None


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
            out.append(loads_within(line))
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
            store = loads_within((sessions / "sessions.json").read_text())
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
