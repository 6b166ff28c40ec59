"""Request intake of the serving proxy: a call's body read, checked, decoded and parsed, one per rollout at a time.

Intake is the work proportional to the body a client sent (read, the request limits, ``json.loads``, the dialect's
parser; then the proxy renders it), so it is where one rollout could make every other wait. Two rules keep it fair:

- **One request per rollout in intake at a time** (:class:`Intake`, FIFO per rollout): a rollout's further requests
  queue on the event loop, their bodies not even read (eight 8 MiB bodies of one rollout once held the one render
  thread for minutes; now they hold it one at a time). Queued, never refused: SDKs retry a 429 (Claude Code up to ten
  times), so a refusal would only multiply the work. Taken after authentication, so only the rollout's key can queue.
- **Off the event loop, beside the renderer**: bodies are decoded and parsed on a pool of their own
  (:data:`PARSE_THREADS`), so one rollout's ``json.loads`` never sits in the render thread's queue before another
  rollout's render. Parsing touches no shared state. A large body is decoded in a process of its own, not here
  (``producers.proxy.body_precheck``: ``json.loads`` holds the interpreter lock, whatever the thread).

:func:`parse_body` is the parse itself: the body checked against the request limits (nesting before it is decoded,
the message count before the dialect's parser, the conversation before it is rendered), each an ``ApiError`` 400 in
the caller's dialect. ``Intake`` counts what it did (:attr:`Intake.peak_busy`, :meth:`Intake.queued`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from producers.proxy.dialects import PARSERS, DialectError, ParsedRequest, RequestLimits, utf8_body
from producers.proxy.emit import ApiError
from schemas.events import Dialect

log = logging.getLogger("clawstream.proxy")
T = TypeVar("T")

PARSE_THREADS = 4  # bodies decoded at once (by different rollouts); json.loads holds the GIL, the parsers do not

# A \uD800-\uDFFF escape in JSON text (paired ones decode to one character) or a surrogate's 3-byte form, which
# json.loads decodes with "surrogatepass": a lone one is a string UTF-8 cannot encode
# (the call event's encoding would fail after the engine had answered: a 500).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


@dataclass
class _Lane:
    """One rollout's turn: the lock its requests take in arrival order (``asyncio.Lock`` is FIFO)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0


class Intake:
    """Per-rollout turns for the work proportional to a request's body, and the counts of what ran."""

    def __init__(self) -> None:
        self.lanes: dict[str, _Lane] = {}  # rollouts with a request in intake or queued for it
        self.peak_busy = 0  # most jobs of one rollout ever running at once in the worker threads (one, by the turns)
        self._busy: dict[str, int] = {}
        self._count = threading.Lock()

    def queued(self, rollout_id: str) -> int:
        """Requests of the rollout waiting for their turn (not counting the one in intake)."""
        lane = self.lanes.get(rollout_id)
        return lane.waiting if lane is not None else 0

    @asynccontextmanager
    async def turn(self, rollout_id: str) -> AsyncIterator[None]:
        """Wait for the rollout's turn (after its earlier requests), hold it for the body's read, parse and render."""
        lane = self.lanes.setdefault(rollout_id, _Lane())
        lane.waiting += 1
        try:
            try:
                await lane.lock.acquire()
            finally:
                lane.waiting -= 1
            try:
                yield
            finally:
                lane.lock.release()
        finally:
            if not lane.waiting and not lane.lock.locked() and self.lanes.get(rollout_id) is lane:
                del self.lanes[rollout_id]

    async def run(self, rollout_id: str, executor: Executor, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``executor`` (off the event loop), counted as one job of the rollout while it runs."""

        def job() -> T:
            with self._count:
                busy = self._busy[rollout_id] = self._busy.get(rollout_id, 0) + 1
                self.peak_busy = max(self.peak_busy, busy)
            try:
                return fn(*args)
            finally:
                with self._count:
                    self._busy[rollout_id] -= 1
                    if not self._busy[rollout_id]:
                        del self._busy[rollout_id]

        return await asyncio.get_running_loop().run_in_executor(executor, job)


def parse_body(raw: bytes, dialect: Dialect, limits: RequestLimits) -> tuple[ParsedRequest, dict[str, Any]]:
    """The body checked against the request limits (its nesting before it is decoded, its message count before the
    dialect's parser, the conversation before it is rendered), decoded and parsed: ``ApiError`` 400."""
    try:
        raw = utf8_body(raw)
        limits.check_text(raw)
        body = json.loads(raw)
        limits.check_body(body)
    except DialectError as exc:
        raise ApiError(400, str(exc)) from exc
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # not past check_text; a client's error all the same, never a 500
        raise ApiError(400, "request body is nested too deeply") from exc
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then check for a lone one (no UTF-8 for it: a 500 later)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"request body holds a lone UTF-16 surrogate escape (not a character): {exc}") from exc
    try:
        parsed = PARSERS[dialect](body)
        limits.check_parsed(parsed)
        return parsed, body
    except DialectError as exc:
        raise ApiError(400, str(exc)) from exc
    except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
        # A shape no parser rule names yet: still the caller's mistake, answered in its dialect, never a 500 (SDKs
        # retry 5xx). The parser's rule for it belongs in dialects.py; log so it gets one.
        log.warning("unparsed %s body shape (%s: %s): answered 400", dialect.value, type(exc).__name__, exc)
        raise ApiError(400, f"malformed request body ({type(exc).__name__}: {exc})"[:500]) from exc


def check_fits(parsed: ParsedRequest, max_prompt_tokens: int | None, max_token_chars: int) -> None:
    """``ApiError`` 400 for a conversation too long for the model by its characters alone: no token covers more than
    ``max_token_chars`` of them (the vocabulary's longest entry), so it cannot fit in ``max_prompt_tokens``."""
    if max_prompt_tokens is None:
        return
    chars = sum(len(m.content) + len(m.reasoning) for m in parsed.conversation.messages)
    at_least = chars // max_token_chars
    if at_least > max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt is at least {at_least} tokens ({chars} characters); the model's context is "
            f"{max_prompt_tokens}",
        )
