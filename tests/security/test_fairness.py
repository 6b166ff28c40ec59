"""One rollout's big requests never stall another's: at most one request per rollout is in intake at a time.

A hostile harness keeps big bodies in flight (4 MiB each here, ~140k tiny messages: each decoded, then refused by
``max_messages``). The proxy takes its requests through intake (body read, decoded, parsed, rendered) one at a
time per rollout, the others queued (never a 429: SDKs retry it), and does that work off the event loop, so a
neighbour rollout's call goes through while the attacker's wait. Asserted from events, not from timings: the
neighbour's answer arrives while most of the attacker's calls are still unanswered and queued, and no two of the
attacker's requests were ever parsed or rendered at once (counted in the worker threads). The neighbour's latency
under this attack is a benchmark figure (bench/redteam.py). Real broker, real proxy, scripted engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.integration.test_proxy import auth, request_body
from tests.support import proxy_helpers as H
from tests.support.proxy_server import register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

IN_FLIGHT = 6
BODY_BYTES = 4 * 1024 * 1024  # half of max_request_bytes: each takes a while to decode (the attack used 8 MiB)


def many_tiny_messages_body(max_bytes: int = BODY_BYTES) -> bytes:
    """A Chat Completions body of as many one-character user messages as fit in ``max_bytes``."""
    base = json.dumps(request_body("chat", [], False)).encode()
    head, tail = base.split(b'"messages": [', 1)
    msg = b'{"role":"user","content":"x"},'
    return head + b'"messages": [' + msg * ((max_bytes - len(base) - 64) // len(msg)) + tail


async def post(http: aiohttp.ClientSession, url: str, reg: dict[str, Any], data: bytes) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **auth("chat", reg["secret"])}
    async with http.post(f"{url}/r/{reg['rollout_id']}/v1/chat/completions", data=data, headers=headers) as r:
        return r.status, await r.read()


async def until(condition: Any, what: str, timeout_s: float = 120.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


async def test_a_neighbour_is_served_while_one_rollouts_big_requests_queue(kafka_settings) -> None:
    big = many_tiny_messages_body()
    small = json.dumps(request_body("chat", [], False)).encode()
    async with (
        ScriptedEngine(H.tiny_tokenizer(), lambda *_: "ok") as engine,
        running_proxy(kafka_settings, engine.url, max_calls_per_rollout=0) as (proxy, url),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http,
    ):
        attacker = await register(http, url, rollout_id="attacker")
        neighbour = await register(http, url, rollout_id="neighbour")
        assert (await post(http, url, neighbour, small))[0] == 200  # the publisher warmed up before the attack
        answered: list[tuple[int, bytes]] = []

        async def attack() -> None:
            answered.append(await post(http, url, attacker, big))

        attacks = asyncio.gather(*(attack() for _ in range(IN_FLIGHT)))
        # every attacking request has arrived: one in intake, the others queued behind it
        await until(lambda: proxy.intake.queued("attacker") == IN_FLIGHT - 1, "the attacker's requests queued")
        status, raw = await post(http, url, neighbour, small)
        unanswered, queued = IN_FLIGHT - len(answered), proxy.intake.queued("attacker")
        await attacks

        assert status == 200, raw[:300]
        # The neighbour went through intake beside the attacker's one request there, not behind all of them.
        assert unanswered >= 2 and queued >= 1, (unanswered, queued)
        assert proxy.intake.peak_busy == 1  # never two of one rollout's requests parsed or rendered at once
        assert proxy.intake.queued("attacker") == 0 and not proxy.intake.lanes  # nothing left behind
        for status, raw in answered:  # each refused in the dialect, naming the limit; none a 429
            assert status == 400 and "max_messages" in json.loads(raw)["error"]["message"], raw[:300]
        assert len(engine.requests) == 2
