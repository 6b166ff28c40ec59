"""A served turn (:class:`Answer`), the stream interface each dialect's answer is sent through (:class:`SseStream`),
and the failure every dialect answers in its own format (:class:`ApiError`): what ``emit`` and ``gemini`` build on.

Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from producers.proxy.tool_parse import ParsedTurn

KEEPALIVE_COMMENT = b": keep-alive\n\n"


class ApiError(Exception):
    """A failed call, answered in the caller's dialect (its emitter's error body, or its stream's error event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class Answer:
    """A served turn plus everything the dialects echo about it."""

    turn: ParsedTurn
    finish: str  # engine finish reason: "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    model: str
    response_id: str
    created: int  # unix seconds
    tool_call_ids: list[str] = field(default_factory=list)  # one per turn.tool_calls
    custom_tools: frozenset[str] = frozenset()  # Responses free-form tools
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache (≤ prompt_tokens)


def sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"{head}data: {body}\n\n".encode()


@dataclass(frozen=True)
class StreamHead:
    """What a stream's preamble says before the engine has answered."""

    response_id: str
    model: str
    created: int  # unix seconds
    prompt_tokens: int = 0
    include_usage: bool = False  # OpenAI Chat stream_options.include_usage


class SseStream:
    """One streamed answer: ``preamble()``, ``keepalive`` while the engine works, then ``body()`` or ``error()``."""

    keepalive = KEEPALIVE_COMMENT

    def __init__(self, head: StreamHead) -> None:
        self.head = head

    def preamble(self) -> bytes:
        raise NotImplementedError

    def body(self, ans: Answer) -> bytes:
        raise NotImplementedError

    def error(self, status: int, message: str) -> bytes:
        raise NotImplementedError
