"""Metrics of the CPU inference engine: Prometheus at ``GET /metrics`` and the periodic "inference_stats" values.

Topics: none here (``consumers.inference.server`` produces the "inference_stats" ``Metric`` to
``clawstream.metrics`` with :func:`stats_values`). Pure: no Kafka, no HTTP.

``GET /metrics`` (Prometheus text, one registry per server) is read at scrape time from the engine's own counters
(``Engine.stats()``), the server's per-response counters (:class:`ServedCounters`) and NVML; names follow the
proxy's (``clawstream_proxy_*``) with the prefix ``clawstream_engine_``, vLLM's counterpart in brackets:

* ``…_prefix_cache_queries_total`` (``vllm:prefix_cache_queries_total``): prompt tokens looked up in the prefix
  cache; ``…_prefix_cache_hits_total`` (``vllm:prefix_cache_hits_total``): those served from it;
  ``…_prefix_cache_hit_rate``: hits / queries since start (a windowed rate is ``rate(hits) / rate(queries)``);
  ``…_prefix_cache_blocks``, ``…_prefix_cache_bytes`` (what the cache holds now), ``…_prefix_cache_evictions_total``;
* ``…_requests_total``, ``…_prompt_tokens_total`` (``vllm:prompt_tokens_total``) and
  ``…_cached_prompt_tokens_total``: per answered ``/v1/completions`` request, its ``usage.prompt_tokens`` and
  ``usage.prompt_tokens_details.cached_tokens``;
* ``…_generation_tokens_total`` (``vllm:generation_tokens_total``), ``…_requests_finished_total``,
  ``…_steps_total``, ``…_requests_running`` (``vllm:num_requests_running``), ``…_requests_waiting``
  (``vllm:num_requests_waiting``), ``…_policy_version``;
* with NVML, per GPU (label ``gpu``, NVML's index): ``…_gpu_utilization_percent``, ``…_gpu_memory_used_bytes``,
  ``…_gpu_memory_total_bytes``.

A counter the engine does not report yet reads 0.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "clawstream_engine_"

# Engine.stats() key → (metric name without prefix, kind, help).
ENGINE_STATS: tuple[tuple[str, str, str, str], ...] = (
    ("prefix_cache_queries", "prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "counter", "Prompt tokens served from the prefix cache."),
    ("prefix_cache_blocks", "prefix_cache_blocks", "gauge", "KV blocks held by the prefix cache."),
    ("prefix_cache_bytes", "prefix_cache_bytes", "gauge", "Bytes of KV held by the prefix cache."),
    ("prefix_cache_evictions", "prefix_cache_evictions", "counter", "KV blocks evicted from the prefix cache."),
    ("tokens_generated", "generation_tokens", "counter", "Tokens generated."),
    ("requests_finished", "requests_finished", "counter", "Requests finished by the engine."),
    ("steps", "steps", "counter", "Scheduler steps (prefill and/or decode)."),
    ("active_sequences", "requests_running", "gauge", "Sequences in the running batch."),
    ("queued_requests", "requests_waiting", "gauge", "Requests waiting for admission."),
)

_GPU = re.compile(r"gpu(\d+)_(util_pct|mem_used_bytes|mem_total_bytes)$")
_GPU_METRICS = {
    "util_pct": ("gpu_utilization_percent", "GPU utilisation over NVML's last sample period, in percent."),
    "mem_used_bytes": ("gpu_memory_used_bytes", "GPU memory in use (all processes), in bytes."),
    "mem_total_bytes": ("gpu_memory_total_bytes", "GPU memory installed, in bytes."),
}


@dataclass
class ServedCounters:
    """Per-response counters of the completions endpoint (incremented by the HTTP handler, read at scrape)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, prompt_tokens: int, cached_prompt_tokens: int) -> None:
        with self._lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.cached_prompt_tokens += cached_prompt_tokens


def hit_rate(hits: float, queries: float) -> float:
    """Share of looked-up prompt tokens served from the prefix cache (0 when nothing was looked up)."""
    return hits / queries if queries > 0 else 0.0


class EngineCollector:
    """A Prometheus collector reading the engine, the served counters and the GPU readings at every scrape."""

    def __init__(
        self,
        stats: Callable[[], dict[str, float]],
        served: ServedCounters,
        policy_version: Callable[[], int],
        gpu: Callable[[], dict[str, float]],
    ) -> None:
        self.stats, self.served, self.policy_version, self.gpu = stats, served, policy_version, gpu

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for key, name, kind, doc in ENGINE_STATS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(PREFIX + name, doc, value=float(stats.get(key, 0.0)))
        rate = hit_rate(stats.get("prefix_cache_hits", 0.0), stats.get("prefix_cache_queries", 0.0))
        yield GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate", "Prefix cache hits / queries since start.", value=rate
        )
        served = self.served
        yield CounterMetricFamily(PREFIX + "requests", "Completion requests answered.", value=served.requests)
        yield CounterMetricFamily(
            PREFIX + "prompt_tokens", "Prompt tokens of answered requests.", value=served.prompt_tokens
        )
        yield CounterMetricFamily(
            PREFIX + "cached_prompt_tokens",
            "Prompt tokens of answered requests served from the prefix cache.",
            value=served.cached_prompt_tokens,
        )
        yield GaugeMetricFamily(PREFIX + "policy_version", "Weight version served now.", value=self.policy_version())
        families: dict[str, GaugeMetricFamily] = {}
        for key, value in sorted(self.gpu().items()):
            match = _GPU.match(key)
            if match is None:
                continue
            name, doc = _GPU_METRICS[match.group(2)]
            if name not in families:
                families[name] = GaugeMetricFamily(PREFIX + name, doc, labels=["gpu"])
            families[name].add_metric([match.group(1)], value)
        yield from families.values()


class EngineMetrics:
    """The registry behind one server's ``GET /metrics``."""

    def __init__(self, engine: Any, served: ServedCounters, gpu: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine.stats, served, lambda: engine.policy_version, gpu))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def stats_values(stats: dict[str, float], previous: dict[str, float], elapsed_s: float) -> dict[str, float]:
    """Values of one "inference_stats" metric: the engine's stats (cumulative counters and gauges as it reports
    them; ``prefix_cache_hit_rate`` since start) plus rates over the interval since ``previous``: ``tokens_per_s``
    and ``prefix_cache_hit_rate_interval``."""

    def delta(key: str) -> float:
        return stats.get(key, 0.0) - previous.get(key, 0.0)

    return {
        "prefix_cache_hit_rate": hit_rate(stats.get("prefix_cache_hits", 0.0), stats.get("prefix_cache_queries", 0.0)),
        **stats,
        "tokens_per_s": delta("tokens_generated") / max(elapsed_s, 1e-9),
        "prefix_cache_hit_rate_interval": hit_rate(delta("prefix_cache_hits"), delta("prefix_cache_queries")),
    }
