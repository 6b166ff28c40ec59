"""The proxy's event loop stays free while big requests are parsed and rendered (#29): a 4 MiB request of one rollout
(under the body limit) held every other client — health checks, other rollouts' calls, keep-alives, seals — for
5.6 s. Now a request too long for the model is refused in its dialect before it is tokenized, and one that fits (near
the model's context) is parsed and rendered off the loop; another client's /healthz is answered within 100 ms
throughout both."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from clawbase.settings import KafkaSettings
from tests.support import proxy_helpers as H
from tests.support.proxy_server import register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration
WORDS = "the quick brown fox writes hello.txt and then reads it back "
PAUSE_S = 0.02


async def _while_answering(http: aiohttp.ClientSession, url: str, rid: str, secret: str, data: bytes):  # noqa: ANN202
    """Post ``data`` as rollout ``rid``'s call; meanwhile a health check every 20 ms. Returns the call's status, body,
    duration and what the health checks waited: the gap between consecutive answers minus the pause (a frozen loop
    stalls the pause too, so each request's own duration would hide it)."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {secret}"}

    async def big() -> tuple[int, bytes, float]:
        t0 = time.perf_counter()
        async with http.post(f"{url}/r/{rid}/v1/chat/completions", data=data, headers=headers) as r:
            return r.status, await r.read(), time.perf_counter() - t0

    call = asyncio.ensure_future(big())
    answered = [time.perf_counter()]
    while not call.done():
        async with http.get(f"{url}/healthz") as r:
            assert r.status == 200
        answered.append(time.perf_counter())
        await asyncio.sleep(PAUSE_S)
    status, body, took = call.result()
    return status, body, took, [b - a - PAUSE_S for a, b in zip(answered, answered[1:], strict=False)]


async def test_big_requests_do_not_stall_other_clients(kafka_settings: KafkaSettings) -> None:
    huge = json.dumps(H.qwen_request([{"role": "user", "content": WORDS * (4 * 1024 * 1024 // len(WORDS))}], False))
    fits = json.dumps(H.qwen_request([{"role": "user", "content": WORDS * 1_550}], False))  # ~40k tokens (Claude Code)
    async with (
        ScriptedEngine(H.tiny_tokenizer(), ["ok"] * 4) as engine,
        running_proxy(kafka_settings, engine.url) as (_proxy, url),
        aiohttp.ClientSession() as http,
    ):
        a = await register(http, url, rollout_id="huge")
        status, body, took, waits = await _while_answering(http, url, "huge", a["secret"], huge.encode())
        assert max(waits, default=0) < 0.1, f"health checks waited {max(waits):.3f} s behind a 4 MiB request"
        assert len(huge) >= 4 * 1024 * 1024 and status == 400, body[:300]
        assert "the model's context is 131072" in json.loads(body)["error"]["message"]  # OpenAI error shape
        assert engine.requests == []
        print(f"\n4 MiB: refused in {took:.2f} s, health checks waited at most {max(waits, default=0) * 1000:.0f} ms")

        b = await register(http, url, rollout_id="fits")
        status, body, took, waits = await _while_answering(http, url, "fits", b["secret"], fits.encode())
        assert status == 200, body[:300]
        prompt = len(engine.requests[0].prompt_ids)
        assert 35_000 < prompt < 45_000, prompt
        assert len(waits) >= 5, (took, waits)  # the call really kept the proxy busy for a while
        assert max(waits) < 0.1, f"health checks waited {max(waits):.3f} s while a {prompt}-token prompt was rendered"
        print(f"{prompt} tokens: answered in {took:.2f} s, health checks waited at most {max(waits) * 1000:.0f} ms")
