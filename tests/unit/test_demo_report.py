"""The quickstart's read-outs, from hand-made events (no broker): where a batch's time went (timeline), the
before/after table with the gain's standard error, the printed step line, and the PNG plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from clawstream.demo.report import before_after_rows, before_after_table, gain, plot
from clawstream.demo.timeline import build_timeline, timeline_table
from clawstream.demo.watch import step_line
from clawstream.stack.evaluate import EvalConfig, EvalResult
from producers.scheduler.plan import EvalScore
from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutRequest,
    WeightVersion,
)
from schemas.topics import BATCHES, METRICS, REWARDS, ROLLOUT_REQUESTS, TRAJECTORIES, WEIGHTS
from tests.support.factories import T0, sample_trajectory


def _request(rid: str, step: int, at: int, attempt: int = 0) -> bytes:
    return RolloutRequest(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=at,
        suite="s",
        task_id="t",
        harness="agentloop",
        group_id=f"s/t|agentloop|{step}",
        step=step,
        timeout_s=60.0,
        attempt=attempt,
    ).to_bytes()


def test_timeline_per_batch() -> None:
    # Batch b-0 (-> v1) holds the group of step 0 (rollouts r0, r1); batch b-1 (-> v2) the group of step 1 (r2).
    def traj(rid: str, at: int) -> bytes:
        t = sample_trajectory(rid)
        t.timestamp_ms = at
        return t.to_bytes()

    def member(batch: str, rid: str, step: int) -> bytes:
        return BatchRecord(
            batch_id=batch,
            policy_version=0,
            timestamp_ms=T0,
            kind=BatchRecordKind.TRAJECTORY,
            step=0,
            index=0,
            rollout_id=rid,
            group_id=f"s/t|agentloop|{step}",
        ).to_bytes()

    def seal(batch: str, at: int) -> bytes:
        return BatchRecord(
            batch_id=batch, policy_version=0, timestamp_ms=at, kind=BatchRecordKind.SEAL, step=0, index=1
        ).to_bytes()

    def reward(rid: str, at: int, status: RewardStatus = RewardStatus.OK) -> bytes:
        return RewardEvent(
            rollout_id=rid,
            policy_version=0,
            timestamp_ms=at,
            attempt_id="a",
            status=status,
            grader="g",
            reward=None if status is RewardStatus.INFRA_FAILURE else 0.5,
        ).to_bytes()

    def metric(name: str, version: int, at: int, **values: float) -> bytes:
        labels = {"group_id": f"s/t|agentloop|{version - 1}"} if name == "group" else {}
        return Metric(
            policy_version=version, timestamp_ms=at, source="x", name=name, values=values, labels=labels
        ).to_bytes()

    def version(v: int, batch: str, at: int) -> bytes:
        return WeightVersion(
            policy_version=v,
            timestamp_ms=at,
            model_name="policy",
            step=0,
            uri="file:///w",
            sha256="0" * 64,
            batch_id=batch,
        ).to_bytes()

    records = {
        ROLLOUT_REQUESTS: [
            _request("r0", 0, T0),
            _request("r1", 0, T0 + 100),
            _request("r2", 1, T0 + 200),
            _request("r1", 0, T0 + 9_000, attempt=1),
        ],  # a re-issue does not move "requested"
        REWARDS: [
            reward("r1", T0 + 4_000, RewardStatus.INFRA_FAILURE),
            reward("r0", T0 + 5_000),
            reward("r1", T0 + 10_000),
            reward("r2", T0 + 12_000),
        ],
        TRAJECTORIES: [traj("r0", T0 + 5_500), traj("r1", T0 + 10_500), traj("r2", T0 + 12_300)],
        BATCHES: [
            member("b-0", "r0", 0),
            member("b-0", "r1", 0),
            seal("b-0", T0 + 11_000),
            member("b-1", "r2", 1),
            seal("b-1", T0 + 13_000),
        ],
        WEIGHTS: [version(1, "b-0", T0 + 15_000), version(2, "b-1", T0 + 20_000)],
        METRICS: [
            metric("group", 1, T0 + 10_800),
            metric("group", 2, T0 + 12_500),
            metric("train_step", 1, T0 + 15_000, step_seconds=3.0),
            metric("weights_applied", 1, T0 + 15_200),
            metric("train_step", 2, T0 + 20_000, step_seconds=4.0),
            metric("weights_applied", 2, T0 + 20_100),
        ],
    }
    [v1, v2] = build_timeline(records)
    assert (v1.version, v1.steps, v2.version, v2.steps) == (1, {0}, 2, {1})
    assert v1.phase("rollouts") == 10.0  # first request -> last final reward (r1's infra failure does not count)
    assert v1.phase("settle") == 0.5 and v1.phase("group") == 0.3 and v1.phase("batch") == 0.2
    assert v1.phase("learner") == 4.0 and v1.learner_compute_s == 3.0 and v1.phase("apply") == 0.2
    assert v2.phase("rollouts") == 11.8 and v2.phase("learner") == 7.0 and v2.phase("apply") == 0.1
    table = timeline_table([v1, v2])
    assert "| v1 | 0 | 10.0 | 0.5 | 0.3 | 0.2 | 4.0 | 0.2 | 3.0 | 15.2 | - |" in table, table
    assert "| v2 | 1 | 11.8 | 0.3 | 0.2 | 0.5 | 7.0 | 0.1 | 4.0 | 19.9 | 4.9 |" in table, table


def _result(means: list[tuple[str, str, float, float | None]]) -> EvalResult:
    rows = [EvalScore(h, m, 256, 256, mean, se, mean / 2, 0, 0, 0) for h, m, mean, se in means]
    return EvalResult("m", EvalConfig(), rows, 1.0, "")


def test_before_after_gain_and_its_standard_error() -> None:
    before = _result([("agentloop", "greedy", 0.40, 0.03), ("agentloop-anthropic", "greedy", 0.42, 0.03)])
    after = _result([("agentloop", "greedy", 0.55, 0.04), ("agentloop-anthropic", "greedy", 0.45, None)])
    g, se = gain(before.rows[0], after.rows[0])
    assert g == pytest.approx(0.15) and se == pytest.approx(0.05)  # sqrt(0.03² + 0.04²)
    rows = before_after_rows(before, after)
    assert rows[0]["significant"] and not rows[1]["significant"] and rows[1]["gain_se"] is None
    table = before_after_table(before, after)
    assert (
        "| agentloop | greedy | 256 | 0.400 ± 0.030 | 0.550 ± 0.040 | +0.150 ± 0.050 (> 2 s.e.) | 20.0% → 27.5% |"
        in table
    ), table
    assert "| agentloop-anthropic | greedy | 256 | 0.420 ± 0.030 | 0.450 | +0.030 | 21.0% → 22.5% |" in table, table


def test_step_line_prints_the_learners_numbers_unrounded() -> None:
    m = Metric(
        policy_version=4,
        timestamp_ms=T0,
        source="learner",
        name="train_step",
        step=3,
        values={
            "reward/agentloop": 0.5,
            "reward/agentloop-anthropic": 0.25,
            "reward/mean": 0.375,
            "policy_loss": -3.2109e-05,
            "clip_frac": 0.0123,
            "is_weight_mean": 0.998,
            "update_kl": 2.5e-06,
            "entropy": 0.731,
            "tokens_per_s": 4321.0,
            "step_seconds": 2.5,
        },
    )
    line = step_line(m)
    assert line.startswith("step 3: reward agentloop 0.50  agentloop-anthropic 0.25 |")
    assert "pg loss -3.2109e-05" in line and "clipped 1.2%" in line and "IS weight 0.998" in line
    assert "KL 2.50e-06" in line and "entropy 0.731" in line and "4321 tok/s" in line and line.endswith("→ v4")


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'ml' extra)")
    trained = [
        Metric(
            policy_version=s + 1,
            timestamp_ms=T0,
            source="learner",
            name="train_step",
            step=s,
            values={"reward/agentloop": 0.3 + 0.1 * s, "reward/agentloop-anthropic": 0.2 + 0.1 * s},
        )
        for s in range(3)
    ]
    before = _result([("agentloop", "greedy", 0.40, 0.03), ("agentloop", "sampled", 0.30, 0.03)])
    after = _result([("agentloop", "greedy", 0.55, 0.04), ("agentloop", "sampled", 0.41, 0.03)])
    path = plot(tmp_path / "learning.png", trained, before, after)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
