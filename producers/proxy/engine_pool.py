"""The proxy's engines: one :class:`EngineClient` per ``engine_url``, calls placed by the cache-affine router.

Topics: none (HTTP to the engines' ``/v1/completions`` and ``/health``). One engine: every call goes to it, exactly
as a lone client (retries up to ``engine_retries``, then 502). Several (``--engine-url`` repeated): each call asks
``producers.proxy.router`` for an engine (policy ``engine_routing``; load = calls in flight there) and tells it when
the call ended, so a rollout's later calls stay on the engine that holds its prefix unless it is overloaded.

Failover: a call whose engine is still away after ``engine_failover_retries`` (:class:`EngineUnavailable`) marks it
dead — nothing more is routed there, its rollouts are placed afresh — and is sent, the same payload, to the engine
the router picks next; the harness sees a longer wait, no error, and one call event (published only once an engine
answered). The last live engine is never marked dead: it gets the full ``engine_retries``, as a lone engine does.
Every ``engine_probe_s`` a dead engine is asked ``GET /health``; a 200 puts it back, its cache taken as empty.

Weight versions: each engine follows the weights topic and swaps between requests (``consumers.inference.engine``
drains, swaps, drops its cache; vLLM is paused and its prefix cache reset), so every answer comes from exactly one
version; the pool records each engine's last answered version (metric ``clawstream_proxy_engine_policy_version``)
and forgets the router's view of an engine's cache when its version changes. Why and what holds: docs/scaling.md.
Run: inside the proxy (``clawstream proxy --engine-url URL [--engine-url URL ...]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Iterator

from producers.proxy.engine_client import EngineClient, EngineReply, EngineUnavailable
from producers.proxy.metrics import ProxyMetrics
from producers.proxy.router import Router
from producers.proxy.settings import ProxySettings

log = logging.getLogger("clawstream.proxy.pool")


class EnginePool:
    """The engines behind one proxy, their router, and the probe of dead ones (started with the app)."""

    def __init__(
        self,
        settings: ProxySettings,
        stop_token_id: int,
        metrics: ProxyMetrics,
        live_rollouts: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self.settings, self.metrics, self.live_rollouts = settings, metrics, live_rollouts
        self.urls = settings.engine_urls
        self.clients = {
            url: EngineClient(
                url, settings.engine_model, settings.engine_timeout_s, stop_token_id, retries=settings.engine_retries
            )
            for url in self.urls
        }
        self.router = Router(
            self.urls,
            policy=settings.engine_routing,
            block_size=settings.engine_block_size,
            imbalance=settings.engine_imbalance,
            slack=settings.engine_slack,
        )
        self.versions: dict[str, int] = {}  # engine → the weight version it last answered with
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._probe: asyncio.Task[None] | None = None
        for url in self.urls:  # every engine shows in /metrics from the start, not only once it was called
            metrics.engine_dead.labels(url).set(0)
            metrics.engine_in_flight.labels(url).set(0)

    async def start(self) -> None:
        for client in self.clients.values():
            await client.start()
        if len(self.urls) > 1:
            self._probe = asyncio.ensure_future(self._probe_dead())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        for client in self.clients.values():
            await client.close()

    async def complete(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        rollout_id: str = "",
    ) -> EngineReply:
        """The answer of one engine to this call (``EngineClient.complete``'s contract), failing over as above."""

        async def ask(url: str, retries: int | None) -> EngineReply:
            with self._counted(url):
                return await self.clients[url].complete(
                    prompt,
                    max_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    seed=seed,
                    rollout_id=rollout_id,
                    retries=retries,
                )

        if len(self.urls) == 1:  # a lone engine: no routing, today's client exactly
            reply = await ask(self.urls[0], None)
            self._saw_version(self.urls[0], reply.policy_version)
            return reply
        while True:
            url = self.router.route(rollout_id, prompt)
            last = [s.name for s in self.router.alive()] == [url]
            try:
                reply = await ask(url, None if last else self.settings.engine_failover_retries)
            except EngineUnavailable as exc:
                self.router.done(url, ())
                if [s.name for s in self.router.alive()] != [url]:
                    self._mark_dead(url, rollout_id, exc)
                elif last:  # the last live engine, given the full engine_retries: nothing left to try
                    raise
                continue  # the others died meanwhile: this one, the last, gets the full engine_retries
            except BaseException:
                self.router.done(url, ())  # a 4xx/5xx answer or a cancelled call: no longer in flight there
                raise
            self._saw_version(url, reply.policy_version)  # before done(): this answer's tokens are in the new cache
            self.router.done(url, prompt + reply.token_ids)
            return reply

    @contextlib.contextmanager
    def _counted(self, url: str) -> Iterator[None]:
        self.in_flight[url] += 1
        self.metrics.engine_calls.labels(url).inc()
        self.metrics.engine_in_flight.labels(url).set(self.in_flight[url])
        try:
            yield
        finally:
            self.in_flight[url] -= 1
            self.metrics.engine_in_flight.labels(url).set(self.in_flight[url])

    def _saw_version(self, url: str, version: int) -> None:
        before = self.versions.get(url)
        if before != version:
            if before is not None:
                # The engine swapped weights between requests and dropped every cached block with the old ones.
                self.router.drop_cache(url)
                log.info("engine %s now serves policy version %d (was %d)", url, version, before)
            self.versions[url] = version
            self.metrics.engine_policy_version.labels(url).set(version)

    def _mark_dead(self, url: str, rollout_id: str, exc: Exception) -> None:
        if self.router.state[url].alive:
            self.router.mark_dead(url)
            self.metrics.engine_dead.labels(url).set(1)
            log.error("engine %s marked dead (rollout %s's call moves to another engine): %s", url, rollout_id, exc)
        self.metrics.engine_failovers.labels(url).inc()

    async def _probe_dead(self) -> None:
        """Put back the dead engines that answer ``/health``; forget the stickiness of rollouts that are gone."""
        while True:
            await asyncio.sleep(self.settings.engine_probe_s)
            try:
                for url, state in self.router.state.items():
                    if not state.alive and await self.clients[url].healthy():
                        self.router.mark_alive(url)
                        self.metrics.engine_dead.labels(url).set(0)
                        log.warning("engine %s answers again: routed to again, its cache taken as empty", url)
                live = self.live_rollouts()
                for rollout_id in [r for r in self.router.sticky if r not in live]:
                    self.router.forget(rollout_id)
            except Exception:  # a probe that died would leave a dead engine out for good: log, probe again
                log.exception("probing the dead engines failed")
