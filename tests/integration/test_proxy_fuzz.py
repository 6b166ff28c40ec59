"""Fuzzing the proxy over real HTTP (#29, item 4): schema-aware mutations of each dialect's real request shape plus
raw-byte bodies (truncated, invalid UTF-8, random), wrong content types, huge and deeply nested values.

For every example the proxy answers below 500 and, when it refuses, in the dialect's error format; no call event
is published for a refused request (the calls topic holds exactly one event per 200, read back at the end); and
another rollout keeps being served meanwhile (its calls' latency is measured and bounded). A client that hangs up
in the middle of a streamed answer leaves the proxy serving. `make test` runs each dialect on the same
``SEEDED_EXAMPLES`` examples every time (Hypothesis derandomized: a failure there reproduces as is); `make test-long`
runs ``CLAWSTREAM_FUZZ_EXAMPLES`` (default 2000) fresh random ones per dialect, the seed printed by Hypothesis on a
failure.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clawbase.settings import KafkaSettings
from tests.integration.test_proxy import PATHS, auth, request_body
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls, register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration
EXAMPLES = int(os.environ.get("CLAWSTREAM_FUZZ_EXAMPLES", "2000"))
SEEDED_EXAMPLES = 300  # ~20 s a dialect on 2 cores, where 2000 took 100-150 s
DIALECTS = ("anthropic", "chat", "responses")
BODY_LIMIT = 200_000


class ProxyThread:
    """A real proxy and scripted engine on their own event loop in a thread, for a synchronous fuzzer."""

    def __init__(self, kafka: KafkaSettings, **overrides: Any) -> None:
        self.kafka, self.overrides = kafka, overrides
        self.ready = threading.Event()
        self.url = ""
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with (
            ScriptedEngine(H.tiny_tokenizer(), lambda *_: "ok", **self.overrides.pop("engine", {})) as engine,
            running_proxy(self.kafka, engine.url, max_request_bytes=BODY_LIMIT, **self.overrides) as (_p, url),
        ):
            self.url = url
            self.ready.set()
            await self._stop.wait()

    def register(self, rollout_id: str) -> str:
        async def go() -> str:
            import aiohttp

            async with aiohttp.ClientSession() as http:
                return str((await register(http, self.url, rollout_id=rollout_id))["secret"])

        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(go(), self._loop).result(30)

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        assert self.ready.wait(180) and self.error is None, self.error
        return self

    def __exit__(self, *_: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


_CONNECTIONS = threading.local()


def post(url: str, path: str, data: bytes, headers: dict[str, str], timeout: float = 30) -> tuple[int, bytes]:
    """POST on this thread's kept-alive connection (a new one when the proxy closed it)."""
    u = urlparse(url)
    for attempt in range(2):
        conn = getattr(_CONNECTIONS, "conn", None)
        if conn is None or (conn.host, conn.port) != (u.hostname, u.port):
            conn = _CONNECTIONS.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        try:
            conn.request("POST", path, body=data, headers=headers)
            resp = conn.getresponse()
            out = resp.status, resp.read()
            if resp.will_close:
                conn.close()
                _CONNECTIONS.conn = None
            return out
        except (ConnectionError, http.client.HTTPException):
            conn.close()
            _CONNECTIONS.conn = None
            if attempt:
                raise
    raise AssertionError("unreachable")


# --- strategies -------------------------------------------------------------------------------------------------

LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
VALUE = st.recursive(
    LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=25,
)
CONTENT_TYPES = ("application/json", "text/plain", "", "application/x-www-form-urlencoded", "application/json; x=1")


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


def _mutate(body: Any, path: tuple[Any, ...], op: str, new: Any) -> Any:
    if not path:
        return new if op != "delete" else {}
    head, *rest = path
    copy = dict(body) if isinstance(body, dict) else list(body)
    if rest:
        copy[head] = _mutate(body[head], tuple(rest), op, new)
    elif op == "delete":
        del copy[head]
    else:
        copy[head] = new
    return copy


def _deep(depth: int) -> str:
    """JSON nested ``depth`` deep (past Python's recursion limit: written as text)."""
    half = depth // 2
    return "[" * half + '{"k": ' * half + '"x"' + "}" * half + "]" * half


@st.composite
def requests(draw: st.DrawFn, dialect: str) -> tuple[bytes, str, str]:
    """(body bytes, content type, what was done) for ``dialect``."""
    good = request_body(dialect, [], draw(st.booleans()))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "raw", "truncate", "utf8", "huge", "deep"]))
    ctype = "application/json" if draw(st.integers(0, 9)) else draw(st.sampled_from(CONTENT_TYPES))
    if kind == "mutate":
        path = draw(st.sampled_from(list(_paths(good))))
        op = draw(st.sampled_from(["replace", "delete"]))
        return json.dumps(_mutate(good, path, op, draw(VALUE))).encode(), ctype, f"{op} {path}"
    if kind == "raw":
        return draw(st.binary(max_size=400)), ctype, "raw bytes"
    data = json.dumps(good).encode()
    if kind == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))], ctype, "truncated"
    if kind == "utf8":
        at = draw(st.integers(0, len(data)))
        return (
            data[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + data[at:],
            ctype,
            "utf8",
        )
    path = draw(st.sampled_from([p for p in _paths(good) if p]))
    if kind == "huge":
        size = draw(st.sampled_from([50_000, BODY_LIMIT + 1]))
        return json.dumps(_mutate(good, path, "replace", "y" * size)).encode(), ctype, f"huge {path}"
    marker = "@@deep@@"
    text = json.dumps(_mutate(good, path, "replace", marker))
    return text.replace(f'"{marker}"', _deep(draw(st.integers(50, 5000)))).encode(), ctype, f"deep {path}"


def _dialect_error(dialect: str, status: int, body: bytes, what: str) -> None:
    err = json.loads(body)
    if dialect == "anthropic":
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, (status, what, err)
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}, (status, what, err)


class Neighbour(threading.Thread):
    """Another rollout's good calls, one after another, while the fuzzer runs: each must succeed; latency kept."""

    def __init__(self, url: str, rid: str, secret: str) -> None:
        super().__init__(daemon=True)
        self.url, self.rid, self.secret = url, rid, secret
        self.latencies: list[float] = []
        self.failures: list[tuple[int, bytes]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        data = json.dumps(request_body("chat", [], False)).encode()
        headers = {"Content-Type": "application/json", **auth("chat", self.secret)}
        while not self.stop.is_set():
            t0 = time.perf_counter()
            status, body = post(self.url, f"/r/{self.rid}{PATHS['chat']}", data, headers)
            self.latencies.append(time.perf_counter() - t0)
            if status != 200:
                self.failures.append((status, body[:300]))
            time.sleep(0.05)


@pytest.mark.parametrize(
    ("dialect", "seeded"),
    [pytest.param(d, True, id=d) for d in DIALECTS]
    + [pytest.param(d, False, id=f"{d}-random", marks=pytest.mark.long) for d in DIALECTS],
)
def test_fuzzed_requests_get_dialect_errors_and_publish_nothing(
    kafka_settings: KafkaSettings, dialect: str, seeded: bool
) -> None:
    rid, other = f"fuzz-{dialect}", f"neighbour-{dialect}"
    ok = 0
    statuses: dict[int, int] = {}
    # thousands of calls on two rollouts: no quota (tests/integration/test_proxy_admin_quota.py tests those)
    with ProxyThread(kafka_settings, max_calls_per_rollout=0, max_prompt_tokens_per_rollout=0) as proxy:
        secret, neighbour = proxy.register(rid), Neighbour(proxy.url, other, proxy.register(other))
        path = f"/r/{rid}{PATHS[dialect]}"

        @settings(
            max_examples=SEEDED_EXAMPLES if seeded else EXAMPLES,
            derandomize=seeded,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
        )
        @given(requests(dialect))
        def fuzz(example: tuple[bytes, str, str]) -> None:
            nonlocal ok
            data, ctype, what = example
            headers = {**({"Content-Type": ctype} if ctype else {}), **auth(dialect, secret)}
            status, body = post(proxy.url, path, data, headers)
            statuses[status] = statuses.get(status, 0) + 1
            assert status < 500, (status, what, body[:400])
            if status == 200:
                ok += 1
            else:
                _dialect_error(dialect, status, body, what)

        neighbour.start()
        try:
            fuzz()
        finally:
            neighbour.stop.set()
            neighbour.join(30)
    lat = sorted(neighbour.latencies)
    print(
        f"\n{dialect}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}; neighbour "
        f"{len(lat)} calls, p50 {statistics.median(lat) * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms"
    )
    assert not neighbour.failures, neighbour.failures[:3]
    assert lat and lat[-1] < 5.0, f"another rollout waited {lat[-1]:.2f} s for a call during the fuzzing"
    events = consume_calls(kafka_settings, {rid}, ok + 1, timeout=10 if ok else 3)
    assert len(events) == ok, f"{len(events)} call events for {ok} answered requests"


def test_a_client_hanging_up_mid_stream_leaves_the_proxy_serving(kafka_settings: KafkaSettings) -> None:
    with ProxyThread(kafka_settings, engine={"delay_s": 0.5}) as proxy:
        u = urlparse(proxy.url)
        secret = proxy.register("hangup")
        for dialect in ("anthropic", "chat", "responses"):
            data = json.dumps(request_body(dialect, [], True)).encode()
            head = "\r\n".join(
                [
                    f"POST /r/hangup{PATHS[dialect]} HTTP/1.1",
                    f"Host: {u.hostname}",
                    "Content-Type: application/json",
                    *(f"{k}: {v}" for k, v in auth(dialect, secret).items()),
                    f"Content-Length: {len(data)}",
                    "",
                    "",
                ]
            ).encode()
            with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
                sock.sendall(head + data)
                assert sock.recv(64).startswith(b"HTTP/1.1 200")  # the stream started (a keep-alive or the head)
            # hung up mid-stream; the proxy goes on serving everyone
            status, body = post(
                proxy.url,
                f"/r/hangup{PATHS[dialect]}",
                json.dumps(request_body(dialect, [], False)).encode(),
                {"Content-Type": "application/json", **auth(dialect, secret)},
            )
            assert status == 200, body[:300]
