"""The inference worker's metrics without a server: the engine GPU's readings for a response (telemetry mapping),
the Prometheus exposition of ``GET /metrics`` and the values of the periodic "inference_stats" metric."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumers.inference.metrics import EngineMetrics, ServedCounters, hit_rate, stats_values
from consumers.inference.telemetry import engine_telemetry, nvml_index

READINGS = {
    "gpu0_util_pct": 12.0,
    "gpu0_mem_used_bytes": 1.0e9,
    "gpu0_mem_total_bytes": 8.0e10,
    "gpu1_util_pct": 97.0,
    "gpu1_mem_used_bytes": 7.5e10,
    "gpu1_mem_total_bytes": 8.0e10,
}


@pytest.mark.parametrize(
    ("device", "visible", "uuids", "index"),
    [
        ("cpu", None, (), None),
        ("cuda", None, (), 0),
        ("cuda:1", None, (), 1),
        ("cuda:0", "3,1", (), 3),  # torch numbers the visible GPUs, NVML all of them
        ("cuda:1", "3,1", (), 1),
        ("cuda:2", "3,1", (), None),
        ("cuda", "GPU-bbbb", ("GPU-aaaa-1", "GPU-bbbb-2"), 1),  # a UUID (or its unique prefix)
        ("cuda", "MIG-cccc", ("GPU-aaaa-1", "GPU-bbbb-2"), None),  # a MIG slice: no whole-GPU reading
    ],
)
def test_nvml_index_of_the_engine_device(
    device: str, visible: str | None, uuids: tuple[str, ...], index: int | None
) -> None:
    assert nvml_index(device, visible, uuids) == index


def test_engine_telemetry_is_the_engine_gpus_reading_or_none() -> None:
    assert engine_telemetry(READINGS, 1) == {"gpu_utilization": 97.0, "gpu_memory_used_bytes": 75_000_000_000}
    assert isinstance(engine_telemetry(READINGS, 1)["gpu_memory_used_bytes"], int)  # type: ignore[index]
    assert engine_telemetry(READINGS, None) is None  # engine on the CPU
    assert engine_telemetry({}, 0) is None  # no NVML (gpu_readings() == {})
    assert engine_telemetry(READINGS, 5) is None


class _Engine:
    policy_version = 4

    def __init__(self, stats: dict[str, float]) -> None:
        self._stats = stats

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


def _scrape(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_metrics_expose_prefix_cache_cached_tokens_and_gpu() -> None:
    engine = _Engine(
        {
            "prefix_cache_queries": 1000.0,
            "prefix_cache_hits": 900.0,
            "prefix_cache_blocks": 56.0,
            "prefix_cache_bytes": 3.5e6,
            "prefix_cache_evictions": 2.0,
            "tokens_generated": 321.0,
            "requests_finished": 3.0,
            "steps": 50.0,
            "active_sequences": 1.0,
            "queued_requests": 0.0,
        }
    )
    served = ServedCounters()
    served.record(prompt_tokens=500, cached_prompt_tokens=0)
    served.record(prompt_tokens=500, cached_prompt_tokens=480)
    values = _scrape(EngineMetrics(engine, served, lambda: READINGS))
    p = "clawstream_engine_"
    assert values[(p + "prefix_cache_queries_total", ())] == 1000.0
    assert values[(p + "prefix_cache_hits_total", ())] == 900.0
    assert values[(p + "prefix_cache_hit_rate", ())] == pytest.approx(0.9)
    assert values[(p + "prefix_cache_blocks", ())] == 56.0 and values[(p + "prefix_cache_bytes", ())] == 3.5e6
    assert values[(p + "prefix_cache_evictions_total", ())] == 2.0
    assert values[(p + "requests_total", ())] == 2.0 and values[(p + "prompt_tokens_total", ())] == 1000.0
    assert values[(p + "cached_prompt_tokens_total", ())] == 480.0
    assert values[(p + "generation_tokens_total", ())] == 321.0 and values[(p + "policy_version", ())] == 4.0
    assert values[(p + "requests_running", ())] == 1.0 and values[(p + "requests_waiting", ())] == 0.0
    assert values[(p + "gpu_utilization_percent", (("gpu", "1"),))] == 97.0
    assert values[(p + "gpu_memory_used_bytes", (("gpu", "0"),))] == 1.0e9


def test_metrics_before_the_engine_reports_a_prefix_cache_read_zero_and_no_gpu() -> None:
    engine = _Engine(
        {
            "tokens_generated": 5.0,
            "requests_finished": 1.0,
            "steps": 6.0,
            "active_sequences": 0.0,
            "queued_requests": 0.0,
        }
    )
    values = _scrape(EngineMetrics(engine, ServedCounters(), dict))
    assert values[("clawstream_engine_prefix_cache_hits_total", ())] == 0.0
    assert values[("clawstream_engine_prefix_cache_hit_rate", ())] == 0.0
    assert not any(name.startswith("clawstream_engine_gpu_") for name, _ in values)


def test_inference_stats_values_rate_over_the_interval() -> None:
    before: dict[str, Any] = {"tokens_generated": 100.0, "prefix_cache_queries": 1000.0, "prefix_cache_hits": 0.0}
    after = {"tokens_generated": 400.0, "prefix_cache_queries": 3000.0, "prefix_cache_hits": 1900.0, "steps": 9.0}
    values = stats_values(after, before, elapsed_s=10.0)
    assert values["tokens_per_s"] == 30.0
    assert values["prefix_cache_hit_rate_interval"] == pytest.approx(0.95)  # this interval's
    assert values["prefix_cache_hit_rate"] == pytest.approx(1900 / 3000)  # since start
    assert values["prefix_cache_hits"] == 1900.0 and values["steps"] == 9.0  # cumulative values as reported
    idle = stats_values(after, after, elapsed_s=10.0)
    assert idle["tokens_per_s"] == 0.0 and idle["prefix_cache_hit_rate_interval"] == 0.0
    assert stats_values({**after, "prefix_cache_hit_rate": 0.5}, before, 1.0)["prefix_cache_hit_rate"] == 0.5
    assert hit_rate(0, 0) == 0.0
