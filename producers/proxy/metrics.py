"""Prometheus metrics of the serving proxy (one registry per proxy instance, so tests can run several).

Exposed at ``GET /metrics``: calls by dialect and kind, errors by dialect and status, request latency, render time,
and tokens by dialect and type (prompt, new = not shared with the parent call, generated, rendered = produced by
the template + tokenizer for this call, the proxy's CPU-cost driver, cached = prompt tokens the engine reported
served from its prefix cache). Per engine of the pool (label ``engine``: its URL): calls routed, calls in flight,
whether it is marked dead, failovers away from it, and the weight version it last answered with. Requests queued
for their rollout's turn in intake (``producers.proxy.intake``), read when scraped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from producers.proxy.intake import Intake

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "clawstream_proxy_calls", "Model calls served and recorded.", ["dialect", "kind"], registry=r
        )
        self.errors = Counter(
            "clawstream_proxy_errors", "Calls answered with an error.", ["dialect", "status"], registry=r
        )
        self.latency = Histogram(
            "clawstream_proxy_request_seconds",
            "Request arrival to response.",
            ["dialect"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.render_time = Histogram(
            "clawstream_proxy_render_seconds",
            "Conversation → prompt ids.",
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1),
        )
        self.tokens = Counter("clawstream_proxy_tokens", "Tokens by type.", ["dialect", "type"], registry=r)
        self.rollouts = Gauge("clawstream_proxy_rollouts", "Registered rollouts.", registry=r)
        self.takeovers = Counter(
            "clawstream_proxy_takeovers", "Rollouts this replica took over from another (replicas).", registry=r
        )
        self.engine_calls = Counter(
            "clawstream_proxy_engine_calls", "Engine calls routed to each engine.", ["engine"], registry=r
        )
        self.engine_in_flight = Gauge(
            "clawstream_proxy_engine_in_flight",
            "Calls in flight on each engine (the router's load).",
            ["engine"],
            registry=r,
        )
        self.engine_dead = Gauge(
            "clawstream_proxy_engine_dead",
            "1 while the engine is marked dead (probed, not routed to).",
            ["engine"],
            registry=r,
        )
        self.engine_failovers = Counter(
            "clawstream_proxy_engine_failovers", "Calls moved away from an engine found away.", ["engine"], registry=r
        )
        self.engine_policy_version = Gauge(
            "clawstream_proxy_engine_policy_version",
            "Weight version each engine last answered with.",
            ["engine"],
            registry=r,
        )

    def watch_intake(self, intake: Intake) -> None:
        """``clawstream_proxy_intake_queued``: requests waiting behind an earlier one of their rollout."""
        queued = Gauge(
            "clawstream_proxy_intake_queued",
            "Requests queued behind an earlier request of their rollout (one per rollout in intake at a time).",
            registry=self.registry,
        )
        queued.set_function(lambda: sum(lane.waiting for lane in list(intake.lanes.values())))

    def record_call(
        self,
        dialect: str,
        kind: str,
        prompt: int,
        new: int,
        generated: int,
        rendered: int,
        render_s: float,
        cached: int = 0,
    ) -> None:
        self.calls.labels(dialect, kind).inc()
        self.render_time.observe(render_s)
        counts = (
            ("prompt", prompt),
            ("new", new),
            ("generated", generated),
            ("rendered", rendered),
            ("cached", cached),
        )
        for name, value in counts:
            self.tokens.labels(dialect, name).inc(value)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
