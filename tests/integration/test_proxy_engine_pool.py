"""The proxy in front of a pool of engines (#31 item 2): affinity, overload spill, failover, rolling weight swap.

A real proxy (real broker, real HTTP) with ``--engine-url`` given twice; each engine is a ScriptedEngine (a real
aiohttp server of the engine protocol, the model its only double) whose answer names the engine and the weight
version it answered at, so the harness and the call events read back from Kafka both say who served each call.
A test pins an engine's state with ScriptedEngine's ``hold`` (its answers wait), ``stop()``/``kill()`` and
``policy_version``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from clawbase.settings import KafkaSettings
from producers.proxy.app import Proxy
from tests.support import proxy_helpers as H
from tests.support.proxy_server import consume_calls, register, running_proxy
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration

SERVED = re.compile(r"engine (\d) at v(\d+)")


def _answer(engine: ScriptedEngine, index: int, _text: str, _ids: list[int], _body: dict[str, Any]) -> str:
    return f"engine {index} at v{engine.policy_version}: step {len(engine.requests)}."


@asynccontextmanager
async def pool(
    kafka: KafkaSettings, n: int = 2, **overrides: Any
) -> AsyncIterator[tuple[list[ScriptedEngine], Proxy, str, aiohttp.ClientSession]]:
    """``n`` scripted engines (version 0, prefix cache reported) behind one proxy; every engine stopped at the end."""
    engines: list[ScriptedEngine] = []
    try:
        for i in range(n):
            engine = ScriptedEngine(H.tiny_tokenizer(), policy_version=0, prefix_cache=True)
            engine.script = lambda text, ids, body, e=engine, i=i: _answer(e, i, text, ids, body)
            engines.append(await engine.start())
        async with (
            running_proxy(kafka, [e.url for e in engines], **overrides) as (proxy, url),
            aiohttp.ClientSession() as http,
        ):
            yield engines, proxy, url, http
    finally:
        for engine in engines:
            await engine.stop()


class Harness:
    """One rollout driven like a chat harness: each call resends the history, the answer and a user turn."""

    def __init__(self, http: aiohttp.ClientSession, url: str, reg: dict[str, Any], project: str) -> None:
        self.http, self.url, self.reg = http, url, reg
        # The project name comes first: rollouts of different projects share no 32-token block of the prompt.
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"Project {project}. {H.QWEN_SYSTEM}"},
            {"role": "user", "content": H.TASK},
        ]
        self.served: list[tuple[int, int]] = []  # (engine, version) of each answered call, from the answer

    @classmethod
    async def start(cls, http: aiohttp.ClientSession, url: str, rid: str, project: str) -> Harness:
        return cls(http, url, await register(http, url, rollout_id=rid, max_tokens=64), project)

    async def call(self) -> tuple[int, int]:
        body = {"model": "policy", "messages": self.messages, "max_tokens": 64}
        headers = {"Authorization": f"Bearer {self.reg['secret']}"}
        async with self.http.post(
            f"{self.url}/r/{self.reg['rollout_id']}/v1/chat/completions", json=body, headers=headers
        ) as r:
            assert r.status == 200, await r.text()  # the harness never sees an engine's trouble
            content = (await r.json())["choices"][0]["message"]["content"]
        match = SERVED.search(content)
        assert match, content
        self.messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Go on."}]
        self.served.append((int(match[1]), int(match[2])))
        return self.served[-1]

    @property
    def engines(self) -> list[int]:
        return [engine for engine, _ in self.served]


async def until(what: str, check: Any, timeout: float = 10.0) -> None:
    """Wait for ``check()`` (the state a test pins, e.g. an engine holding k calls), failing with ``what``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def metrics(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, float]:
    """The proxy's per-engine series, ``name{engine="URL"}`` → value, from its /metrics endpoint."""
    async with http.get(f"{proxy.admin_url}/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("clawstream_proxy_engine_") and "{" in line:
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def series(name: str, engine: ScriptedEngine) -> str:
    return f'clawstream_proxy_engine_{name}{{engine="{engine.url}"}}'


async def test_a_rollout_stays_on_its_engine_and_a_shared_prefix_goes_to_the_engine_holding_it(
    kafka_settings: KafkaSettings,
) -> None:
    async with pool(kafka_settings) as ([e0, e1], proxy, url, http):
        # Engine 0 busy with another project's call: alpha's first call goes to the least loaded, engine 1.
        e0.hold = asyncio.Event()
        zeta = await Harness.start(http, url, "zeta", "zeta")
        busy = asyncio.create_task(zeta.call())
        await until("engine 0 holding zeta's call", lambda: len(e0.requests) == 1)
        alpha = await Harness.start(http, url, "alpha", "alpha")
        await alpha.call()
        e0.hold.set()
        await busy
        for _ in range(3):  # both engines idle now: only affinity keeps alpha on engine 1
            await alpha.call()
        # A second rollout of alpha's project, both engines idle: its first call goes where alpha's prefix is cached.
        sibling = await Harness.start(http, url, "alpha-2", "alpha")
        await sibling.call()
        snapshot = await metrics(http, proxy)
    assert alpha.engines == [1, 1, 1, 1], alpha.served
    assert sibling.engines == [1], sibling.served
    assert e1.cached[-1] >= 32, e1.cached  # at least one block of the sibling's prompt was a hit
    events = await asyncio.to_thread(consume_calls, kafka_settings, {"alpha"}, 4)
    assert [e.seq for e in events] == [0, 1, 2, 3]
    assert snapshot[series("calls_total", e1)] == 5 and snapshot[series("calls_total", e0)] == 1, snapshot


async def test_an_overloaded_engine_spills_new_rollouts_and_next_calls_to_another(
    kafka_settings: KafkaSettings,
) -> None:
    # Two engines, slack 1: an engine is overloaded once 4 calls are in flight there and none on the other.
    async with pool(kafka_settings, engine_slack=1) as ([e0, _e1], proxy, url, http):
        home = await Harness.start(http, url, "home", "shared")
        assert await home.call() == (0, 0)  # idle pool: engine order
        e0.hold = asyncio.Event()
        queued = [await Harness.start(http, url, f"q{i}", "shared") for i in range(4)]
        held = [asyncio.create_task(h.call()) for h in queued]
        # The shared prefix is cached on engine 0 only: all four queue there, up to the bound.
        await until("engine 0 holding 4 calls", lambda: len(e0.requests) == 5)
        during = await metrics(http, proxy)
        spilled = [await Harness.start(http, url, f"s{i}", "shared") for i in range(2)]
        # Served while engine 0 still holds its four: the bound sent them to engine 1, and home's next call too.
        for h in [*spilled, home]:
            await asyncio.wait_for(h.call(), 10)
        assert not any(t.done() for t in held)
        e0.hold.set()
        await asyncio.gather(*held)
    assert during[series("in_flight", e0)] == 4, during
    assert [h.engines for h in queued] == [[0]] * 4
    assert [h.engines for h in spilled] == [[1]] * 2
    assert home.engines == [0, 1], home.served


@pytest.mark.parametrize("when", ["between-calls", "mid-call"])
async def test_a_dead_engine_fails_over_without_an_error_and_is_probed_back(
    kafka_settings: KafkaSettings, when: str
) -> None:
    async with pool(kafka_settings, engine_failover_retries=2, engine_probe_s=0.3) as ([e0, e1], proxy, url, http):
        rollout = await Harness.start(http, url, "r", "alpha")
        await rollout.call()  # on engine 0 (idle pool: engine order)
        if when == "mid-call":  # its second call reaches engine 0, which dies holding it
            e0.hold = asyncio.Event()
            call = asyncio.create_task(rollout.call())
            await until("engine 0 holding the second call", lambda: len(e0.requests) == 2)
            await e0.kill()
            await asyncio.wait_for(call, 20)
        else:  # engine 0 dies after its first answer
            await e0.stop()
            await asyncio.wait_for(rollout.call(), 20)
        await rollout.call()
        dead = await metrics(http, proxy)
        # Engine 0 comes back on its port: the probe routes to it again (a new project's call, idle pool: engine 0).
        port = int(e0.url.rsplit(":", 1)[1])
        back = ScriptedEngine(H.tiny_tokenizer(), policy_version=0, port=port)
        back.script = lambda text, ids, body: _answer(back, 0, text, ids, body)
        await back.start()
        try:
            await until("the probe finding engine 0 back", lambda: proxy.engine.router.state[e0.url].alive, 10)
            fresh = await Harness.start(http, url, "fresh", "beta")
            await fresh.call()
            revived = await metrics(http, proxy)
        finally:
            await back.stop()
    assert rollout.engines == [0, 1, 1], rollout.served
    events = await asyncio.to_thread(consume_calls, kafka_settings, {"r"}, 4, 8.0)
    assert [e.seq for e in events] == [0, 1, 2]  # each call recorded once: none lost, none twice
    assert [SERVED.search(H.tiny_tokenizer().decode(e.generated_tokens))[1] for e in events] == ["0", "1", "1"]
    assert dead[series("dead", e0)] == 1 and dead[series("dead", e1)] == 0, dead
    assert dead[series("failovers_total", e0)] == 1, dead
    assert fresh.engines == [0] and revived[series("dead", e0)] == 0, (fresh.served, revived)
    assert e1.requests and len(e0.requests) == (2 if when == "mid-call" else 1)


async def test_engines_swap_weights_one_by_one_while_serving_and_no_call_mixes_versions(
    kafka_settings: KafkaSettings,
) -> None:
    async with pool(kafka_settings) as ([e0, e1], proxy, url, http):
        rollouts = [await Harness.start(http, url, f"w{i}", f"project-{i}") for i in range(4)]
        # First calls held on both engines: placed by load, two rollouts per engine.
        e0.hold, e1.hold = asyncio.Event(), asyncio.Event()
        first = [asyncio.create_task(h.call()) for h in rollouts]
        await until("4 first calls in flight", lambda: len(e0.requests) + len(e1.requests) == 4)
        e0.hold.set()
        e1.hold.set()
        await asyncio.gather(*first)
        on = {i: [h for h in rollouts if h.engines == [i]] for i in (0, 1)}
        assert len(on[0]) == len(on[1]) == 2, [h.served for h in rollouts]
        versions_seen = []
        for swapping, other in ((0, 1), (1, 0)):
            engine = (e0, e1)[swapping]
            # The engine drains and swaps (its new calls wait, as the CPU engine's do); the other serves on.
            engine.hold = asyncio.Event()
            waiting = [asyncio.create_task(h.call()) for h in on[swapping]]
            for h in on[other]:
                await asyncio.wait_for(h.call(), 10)
            engine.policy_version = 1
            engine.hold.set()
            await asyncio.gather(*waiting)
            # One engine at v1, the other at its version: every rollout is served, each call by one engine.
            await asyncio.gather(*(h.call() for h in rollouts))
            snapshot = await metrics(http, proxy)
            versions_seen.append((snapshot[series("policy_version", e0)], snapshot[series("policy_version", e1)]))
    assert versions_seen == [(1, 0), (1, 1)]
    events = await asyncio.to_thread(consume_calls, kafka_settings, {h.reg["rollout_id"] for h in rollouts}, 20)
    assert len(events) == 4 * 5
    for event in events:  # the recorded version is the one the answering engine generated at
        version = SERVED.search(H.tiny_tokenizer().decode(event.generated_tokens))[2]
        assert event.policy_version == int(version), (event.rollout_id, event.seq, event.policy_version, version)
    mixed = [h.served[2] for h in rollouts]  # the round with engine 0 at v1 and engine 1 at v0
    assert sorted(mixed) == [(0, 1), (0, 1), (1, 0), (1, 0)], mixed
    for h in rollouts:  # affinity held through both swaps
        assert len(set(h.engines)) == 1, h.served
