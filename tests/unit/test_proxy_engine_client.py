"""The proxy's engine client while the engine is away: retried with the same payload through refused connections,
dropped connections and 503s; never for a 4xx or another 5xx; bounded by ``engine_retries`` and
``engine_timeout_s``, each named in the 502; one log line on the first retry and every tenth. The engine here is a
raw asyncio socket server in this process that answers, drops or refuses each request as scripted."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from producers.proxy.emit import ApiError
from producers.proxy.engine_client import EngineClient

ANSWER = {
    "choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "stop"}],
    "policy_version": 3,
}


class RawEngine:
    """Answers each request by the next entry of ``script``: an HTTP status (200 with :data:`ANSWER`) or "drop"
    (closes the connection after reading the request, as an engine killed mid-call); records the bodies."""

    def __init__(self, script: list[int | str]) -> None:
        self.script = script
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
        self.bodies.append(json.loads(await reader.readexactly(length)))
        step = self.script.pop(0) if self.script else 200
        if step != "drop":
            body = json.dumps(ANSWER if step == 200 else {"error": {"message": f"status {step}"}}).encode()
            writer.write(
                f"HTTP/1.1 {step} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        writer.close()


@asynccontextmanager
async def raw_engine(script: list[int | str]) -> AsyncIterator[tuple[RawEngine, str]]:
    engine = RawEngine(script)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    try:
        yield engine, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def client(url: str, **kwargs: Any) -> AsyncIterator[EngineClient]:
    kwargs = {"retries": 20, "backoff_s": 0.01, "max_backoff_s": 0.05, **kwargs}
    timeout = kwargs.pop("timeout_s", 30.0)
    c = EngineClient(url, "policy", timeout, 99, **kwargs)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def _complete(c: EngineClient) -> Any:
    return await c.complete([1, 2, 3], 8, temperature=0.7, top_p=0.9, top_k=0, seed=41, rollout_id="r-7")


async def test_dropped_connections_and_503_are_retried_with_the_same_payload() -> None:
    async with raw_engine(["drop", 503, "drop", 200]) as (engine, url), client(url) as c:
        reply = await _complete(c)
    assert (reply.token_ids, reply.policy_version) == ([5, 6], 3)
    assert len(engine.bodies) == 4 and all(b == engine.bodies[0] for b in engine.bodies)
    assert engine.bodies[0]["seed"] == 41 and engine.bodies[0]["prompt"] == [1, 2, 3]


async def test_an_engine_that_comes_up_late_is_waited_for() -> None:
    port = _free_port()  # nothing listens here yet: connection refused until the engine starts
    engine = RawEngine([200])
    async with client(f"http://127.0.0.1:{port}") as c:
        call = asyncio.create_task(_complete(c))
        await asyncio.sleep(0.3)
        assert not call.done()
        server = await asyncio.start_server(engine.handle, "127.0.0.1", port)
        try:
            reply = await asyncio.wait_for(call, 10)
        finally:
            server.close()
    assert reply.token_ids == [5, 6] and len(engine.bodies) == 1


@pytest.mark.parametrize(("answer", "status"), [(400, 400), (422, 400), (500, 502)])
async def test_a_4xx_or_another_5xx_is_not_retried(answer: int, status: int) -> None:
    async with raw_engine([answer, 200]) as (engine, url), client(url) as c:
        with pytest.raises(ApiError) as info:
            await _complete(c)
    assert info.value.status == status and len(engine.bodies) == 1


async def test_the_retry_bound_ends_in_502_naming_the_setting() -> None:
    async with client(f"http://127.0.0.1:{_free_port()}", retries=3) as c:
        with pytest.raises(ApiError) as info:
            await _complete(c)
    assert info.value.status == 502
    assert "4 attempt(s)" in info.value.message and "engine_retries=3" in info.value.message


async def test_the_overall_timeout_bounds_the_retries() -> None:
    t0 = time.monotonic()
    async with client(f"http://127.0.0.1:{_free_port()}", retries=10_000, timeout_s=0.6) as c:
        with pytest.raises(ApiError) as info:
            await _complete(c)
    assert info.value.status == 502 and "engine_timeout_s=0.6" in info.value.message
    assert time.monotonic() - t0 < 2


async def test_retries_are_logged_on_the_first_and_every_tenth(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="clawstream.proxy.engine")
    # another test's logging.config.dictConfig (Faust's worker set-up) may have disabled loggers that existed then
    logging.getLogger("clawstream.proxy.engine").disabled = False
    async with raw_engine(["drop"] * 20) as (_engine, url), client(url, backoff_s=0.001, max_backoff_s=0.001) as c:
        await _complete(c)
    lines = [r.getMessage() for r in caplog.records if r.name == "clawstream.proxy.engine"]
    assert len(lines) == 3 and all("rollout r-7" in line for line in lines)  # retries 1, 10 and 20
    assert [line.split("; retry ")[1].split(" ")[0] for line in lines] == ["1", "10", "20"]
