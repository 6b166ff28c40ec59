"""The dashboard's running aggregates, fed by hand: every panel's numbers from events whose answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from consumers.analytics.dashboard.state import DashboardState
from schemas.events import (
    CallEvent,
    CallKind,
    Dialect,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
    TreeSegment,
    WeightVersion,
)
from tests.support.factories import T0, sample_events


def started(rid: str, attempt: int = 0, ts: int = T0) -> RolloutEvent:
    return RolloutEvent(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=ts,
        attempt_id=f"{rid}-a{attempt}",
        state=RolloutState.STARTED,
        group_id="t|h|0",
        harness="h",
        attempt=attempt,
    )


def ended(rid: str, state: RolloutState, exit_code: int | None = None, attempt: int = 0) -> RolloutEvent:
    return RolloutEvent(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=T0 + 10,
        attempt_id=f"{rid}-a{attempt}",
        state=state,
        group_id="t|h|0",
        harness="h",
        exit_code=exit_code,
        attempt=attempt,
    )


def trajectory(
    rid: str,
    harness: str,
    step: int,
    reward: float | None,
    *,
    ts: int = T0,
    status: TrajectoryStatus = TrajectoryStatus.COMPLETE,
    evaluation: bool = False,
    leaves: int = 1,
    trained: int = 3,
    path: int = 10,
    unique: int = 8,
) -> Trajectory:
    segs = [
        TreeSegment(-1, np.arange(unique - trained), False, np.zeros(0), 0),
        TreeSegment(0, np.arange(trained), True, np.zeros(trained), 0),
    ]
    return Trajectory(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=ts,
        attempt_id=f"{rid}-a0",
        group_id=f"t|{harness}|{step}",
        task_id="t",
        harness=harness,
        step=step,
        status=status,
        segments=segs,
        calls=2,
        leaves=leaves,
        unique_tokens=unique,
        path_tokens=path,
        prefix_reuse_ratio=path / unique,
        reward=reward,
        metadata={"eval": "true" if evaluation else "false"},
    )


def call(
    rid: str, ts: int, version: int, *, gen: int = 4, prompt: int = 10, kind: CallKind = CallKind.MAIN, seq: int = 0
) -> CallEvent:
    return CallEvent(
        rollout_id=rid,
        policy_version=version,
        timestamp_ms=ts,
        call_id=f"{rid}-{seq}",
        seq=seq,
        dialect=Dialect.OPENAI_CHAT,
        requested_model="policy",
        call_kind=kind,
        new_tokens=np.arange(prompt, dtype=np.int32),
        prompt_len=prompt,
        generated_tokens=np.arange(gen, dtype=np.int32),
        logprobs=np.zeros(gen, dtype=np.float32),
        finish_reason="stop",
        attempt_id=f"{rid}-a0",
    )


def weights(version: int, ts: int) -> WeightVersion:
    return WeightVersion(
        policy_version=version,
        timestamp_ms=ts,
        model_name="policy",
        step=version - 1,
        uri=f"file:///w/v{version}",
        sha256="0" * 64,
    )


def test_rollout_status_of_each_rollouts_latest_attempt() -> None:
    s = DashboardState()
    for rid in "abcdefg":
        s.add(started(rid), "clawstream.rollout.events")
    s.add(ended("b", RolloutState.HARNESS_EXITED, 0))
    s.add(ended("c", RolloutState.HARNESS_EXITED, 2))
    s.add(ended("d", RolloutState.TIMED_OUT))
    s.add(ended("e", RolloutState.FAILED))
    s.add(ended("f", RolloutState.HARNESS_EXITED, 0))
    s.add(
        RewardEvent(
            rollout_id="f",
            policy_version=0,
            timestamp_ms=T0 + 20,
            attempt_id="f-a0",
            status=RewardStatus.INFRA_FAILURE,
            grader="none",
        )
    )  # grader crashed
    s.add(ended("g", RolloutState.FAILED))
    s.add(started("g", attempt=1, ts=T0 + 30))  # re-issued after the infrastructure failure: runs again
    assert s.status_counts() == {"running": 2, "ok": 1, "failed": 1, "timed_out": 1, "infra": 2}
    s.add(ended("g", RolloutState.HARNESS_EXITED, 0, attempt=1))
    s.add(ended("g", RolloutState.FAILED, attempt=0))  # the superseded attempt's end, read late: no effect
    s.add(ended("a", RolloutState.FAILED))
    assert s.status_counts() == {"running": 0, "ok": 2, "failed": 1, "timed_out": 1, "infra": 3}


def test_reward_per_harness_per_step_skips_infra_and_keeps_eval_apart() -> None:
    s = DashboardState()
    s.add(trajectory("r1", "claude-code", 0, 1.0))
    s.add(trajectory("r2", "claude-code", 0, 0.0))
    s.add(trajectory("r3", "claude-code", 1, 0.5))
    s.add(trajectory("r4", "openclaw", 0, 0.25))
    s.add(trajectory("r5", "openclaw", 0, None, status=TrajectoryStatus.INFRA_FAILURE))
    s.add(trajectory("r6", "openclaw", 0, 1.0, evaluation=True))
    s.add(trajectory("r2", "claude-code", 0, 1.0, ts=T0 + 5))  # re-settled: replaces the first
    s.add(trajectory("r2", "claude-code", 0, 0.75, ts=T0 - 5))  # an older one read late: ignored
    reward = s.snapshot()["reward"]
    assert reward == {
        "claude-code": {"steps": [0, 1], "mean": [1.0, 0.5], "n": [2, 1]},
        "openclaw": {"steps": [0], "mean": [0.25], "n": [1]},
        "openclaw (eval)": {"steps": [0], "mean": [1.0], "n": [1]},
    }
    assert s.status_counts()["infra"] == 1


def test_tree_stats_per_harness() -> None:
    s = DashboardState()
    s.add(trajectory("r1", "openclaw", 0, 1.0, leaves=5, trained=40, path=300, unique=100))
    s.add(trajectory("r2", "openclaw", 0, 0.0, leaves=3, trained=20, path=100, unique=100))
    s.add(trajectory("r3", "codex", 0, 1.0, leaves=1, trained=10, path=50, unique=50))
    s.add(trajectory("r4", "codex", 0, None, status=TrajectoryStatus.DROPPED))  # no tree: not counted
    tree = s.snapshot()["tree"]
    assert tree["harnesses"] == ["codex", "openclaw"]
    assert tree["rollouts"] == [1, 2]
    assert tree["leaves_per_rollout"] == [1.0, 4.0]
    assert tree["prefix_reuse"] == [pytest.approx(1.0), pytest.approx((3.0 + 1.0) / 2)]
    assert (tree["trained_tokens"], tree["path_tokens"], tree["unique_tokens"]) == ([10, 60], [50, 400], [50, 200])


def test_throughput_buckets_are_rates_with_gaps_filled() -> None:
    s = DashboardState(bucket_s=10)
    base = 1_790_000_000_000  # a multiple of 10 s
    s.add(call("a", base + 1_000, 0, gen=4, prompt=10, seq=0))
    s.add(call("a", base + 9_000, 0, gen=6, prompt=20, seq=1))
    s.add(call("b", base + 30_500, 0, gen=10, prompt=30, seq=0))
    tp = s.snapshot()["throughput"]
    assert len(tp["t"]) == 4 and tp["t"][0].endswith("Z")
    assert tp["calls_per_s"] == [0.2, 0.0, 0.0, 0.1]
    assert tp["generated_tokens_per_s"] == [1.0, 0.0, 0.0, 1.0]
    assert tp["prompt_tokens_per_s"] == [3.0, 0.0, 0.0, 3.0]


def test_policy_lag_is_measured_against_the_versions_published_before_each_call() -> None:
    s = DashboardState(bucket_s=10)
    base = 1_790_000_000_000
    s.add(weights(1, base))
    s.add(weights(2, base + 15_000))
    s.add(weights(3, base + 16_000))
    s.add(weights(3, base + 16_000))  # read twice (the feed primes the weights topic): counted once
    s.add(call("a", base + 1_000, 1, seq=0))  # v1 was newest: lag 0
    s.add(call("a", base + 17_000, 1, seq=1))  # v3 published: lag 2
    s.add(call("b", base + 18_000, 3, seq=0))  # lag 0
    s.add(call("b", base + 19_000, 1, seq=1, kind=CallKind.SIDE))  # side calls: no lag
    lag = s.snapshot()["lag"]
    assert lag["mean"] == [0.0, 1.0] and lag["max"] == [0, 2] and len(lag["t"]) == 2
    published = s.snapshot()["weights"]["published"]
    assert published["version"] == [1, 2, 3] and published["step"] == [0, 1, 2]


def test_weight_versions_applied_per_engine_and_engine_stats() -> None:
    s = DashboardState()
    for engine, version, latency in (
        ("inference-worker/a", 1, 0.25),
        ("inference-worker/b", 1, 0.5),
        ("inference-worker/a", 2, 0.125),
    ):
        s.add(
            Metric(
                policy_version=version,
                timestamp_ms=T0 + version,
                source=engine,
                name="weights_applied",
                values={"publish_to_applied_s": latency, "swap_latency_s": 0.01},
            ),
            "clawstream.metrics",
        )
    s.add(
        Metric(
            policy_version=2,
            timestamp_ms=T0 + 9,
            source="inference-worker/a",
            name="inference_stats",
            values={"prefix_cache_hit_rate": 0.75, "tokens_per_s": 120.0, "gpu_utilization": float("nan")},
        )
    )
    snap = s.snapshot()
    applied = snap["weights"]["applied"]
    assert applied["inference-worker/a"]["version"] == [1, 2]
    assert applied["inference-worker/a"]["latency_s"] == [0.25, 0.125]
    assert applied["inference-worker/b"]["version"] == [1]
    assert snap["engines"]["inference-worker/a"]["prefix_cache_hit_rate"] == 0.75
    assert "gpu_utilization" not in snap["engines"]["inference-worker/a"]  # NaN is dropped, not sent
    json.dumps(snap, allow_nan=False)


def test_every_event_type_is_taken_and_the_snapshot_is_strict_json() -> None:
    s = DashboardState()
    for event in sample_events():
        s.add(event, type(event).SCHEMA)
    s.add_error("clawstream.calls", "corrupt CallEvent body")
    snap = json.loads(json.dumps(s.snapshot(), allow_nan=False))
    assert sum(snap["records"].values()) == len(sample_events())
    assert snap["errors"]["count"] == 1 and "corrupt" in snap["errors"]["last"]
    assert snap["health"][0]["harness"] == "agentloop" and snap["health"][0]["main_calls"] == 1
    assert snap["reward"] == {"agentloop": {"steps": [5], "mean": [1.0], "n": [1]}}
    assert snap["learner"] == {"steps": [5], "loss": [0.25]}
