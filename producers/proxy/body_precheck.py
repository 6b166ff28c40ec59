"""Large request bodies decoded and checked in processes of their own, so none holds the proxy's interpreter lock.

``json.loads`` holds the GIL for as long as it builds objects: an 8 MiB body of ~280k one-character messages held
it for 0.1-0.5 s, and every other rollout's call (its read, parse, render, stream) waited, whatever thread it was
on. Counting the body's values in C first would not fix it (``bytes.count`` and ``translate`` over 8 MiB hold the
lock for tens of milliseconds too, and the count of messages alone bounds nothing: one message may hold 150k content
parts). So a body of ``precheck_bytes`` or more never meets the proxy's decoder: :class:`BodyPrecheck` sends its
bytes to a small pool of processes (forkserver, started with the proxy), where :func:`check_apart` decodes it,
checks every request limit (:func:`producers.proxy.intake.parse_body`: the same refusals in the same words) and the
count of its JSON values (``max_json_values``), and parses it. Only a body that passed comes back, pickled: its
values bounded by ``max_json_values``, the proxy's cost is one unpickling of at most that many objects (no escapes
to decode). A refusal comes back as (status, message), answered in the caller's dialect like any other.

A body under ``precheck_bytes`` is decoded in the proxy: it holds at most ``precheck_bytes / 2`` values, a few
milliseconds to decode. Counts: :attr:`BodyPrecheck.checked`, :attr:`BodyPrecheck.refused`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from producers.proxy.dialects import ParsedRequest, RequestLimits
from producers.proxy.emit import ApiError
from producers.proxy.intake import check_fits, parse_body
from schemas.events import Dialect

log = logging.getLogger("clawstream.proxy")
_CONTAINERS = (dict, list)
NICENESS = 10  # the precheck processes yield the CPU to the proxy (and to other rollouts' calls) when it is scarce


def count_values(value: Any, cap: int) -> int:
    """JSON values in a decoded body (containers and scalars; object keys not counted), with an explicit stack;
    stops past ``cap`` and returns ``cap + 1``."""
    if not isinstance(value, _CONTAINERS):
        return 1
    count, stack = 1, [value]
    while stack:
        node = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        count += len(children)
        if count > cap:
            return cap + 1
        stack.extend(child for child in children if isinstance(child, _CONTAINERS))
    return count


def check_apart(
    raw: bytes, dialect: Dialect, limits: RequestLimits, max_values: int, fits: tuple[int | None, int] = (None, 1)
) -> tuple[int, str] | tuple[ParsedRequest, dict[str, Any]]:
    """In a precheck process: the body decoded, checked and parsed (``parse_body``), its values counted, its length
    checked against the model's context (``check_fits`` with ``fits``: nothing sent back that the proxy would only
    refuse); (status, message) for a refusal, else what ``parse_body`` returns."""
    try:
        parsed, body = parse_body(raw, dialect, limits)
        check_fits(parsed, *fits)
    except ApiError as exc:
        return exc.status, exc.message
    values = count_values(body, max_values)
    if values > max_values:
        return 400, (
            f"the request body holds more than {max_values} JSON values; at most {max_values} (the proxy's "
            "max_json_values, CLAWSTREAM_PROXY_MAX_JSON_VALUES)"
        )
    return parsed, body


def _ready() -> bool:
    return True


def _child_start(proxy_pid: int) -> None:
    """In each precheck process: a lower priority, and an exit once the proxy is gone (killed, it never says so)."""
    os.nice(NICENESS)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(proxy_pid, 0)
            except ProcessLookupError:
                os._exit(0)

    threading.Thread(target=watch, name="precheck-watch", daemon=True).start()


class BodyPrecheck:
    """The precheck processes, and the choice of which bodies go to them."""

    def __init__(self, min_bytes: int, max_values: int, processes: int) -> None:
        self.min_bytes, self.max_values, self.processes = min_bytes, max_values, processes
        self.checked = 0  # bodies decoded and checked apart
        self.refused = 0  # of them, refused there
        self._lock = threading.Lock()
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # the children fork with the dialects already imported
        return ProcessPoolExecutor(
            self.processes, mp_context=context, initializer=_child_start, initargs=(os.getpid(),)
        )

    def warm(self) -> None:
        """Start every process now (blocking), not on the first large body; a failure is logged (the first large
        body tries again)."""
        try:
            for future in [self._pool.submit(_ready) for _ in range(self.processes)]:
                future.result()
        except Exception as exc:  # a pool shut down meanwhile, a process that could not start
            log.warning("precheck processes not started: %s: %s", type(exc).__name__, exc)

    def applies(self, raw: bytes) -> bool:
        return len(raw) >= self.min_bytes

    def parse(
        self, raw: bytes, dialect: Dialect, limits: RequestLimits, fits: tuple[int | None, int] = (None, 1)
    ) -> tuple[ParsedRequest, dict[str, Any]]:
        """``parse_body`` (and ``check_fits``) of a large body, done apart (blocking: call it off the event loop);
        ``ApiError`` for a refusal, or a 400 when its process died on it (it is started again)."""
        with self._lock:
            pool = self._pool
        try:
            result = pool.submit(check_apart, raw, dialect, limits, self.max_values, fits).result()
        except BrokenProcessPool as exc:
            with self._lock:
                if self._pool is pool:
                    self._pool = self._start()
            pool.shutdown(wait=False, cancel_futures=True)
            raise ApiError(400, "the request body could not be decoded: its checking process died on it") from exc
        with self._lock:
            self.checked += 1
            self.refused += isinstance(result[0], int)
        if isinstance(result[0], int):
            status, message = result
            raise ApiError(status, message)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
