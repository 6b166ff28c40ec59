"""Evaluation scores (producers.scheduler.plan): per harness and decoding mode, the mean reward over graded rollouts,
its standard error (sample standard deviation / sqrt(n)), the solved fraction, and what was not graded; the table
prints them. Pure: no broker."""

from __future__ import annotations

import math
import statistics

import pytest

from producers.scheduler.plan import (
    EVAL_MODE_KEY,
    Outstanding,
    StepPlan,
    eval_scores,
    eval_table,
    instance_requests,
    mean_stderr,
)
from producers.tasks.cpu import cpu_suite
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms


def _reward(rid: str, status: RewardStatus, value: float | None, *, by_rollout: bool = False) -> RewardEvent:
    return RewardEvent(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=now_ms(),
        attempt_id=f"{rid}.x",
        status=status,
        grader="g",
        reward=value,
        grader_error_by_rollout=by_rollout,
    )


def test_mean_and_standard_error() -> None:
    values = [0.0, 0.25, 1.0, 1.0, 0.5]
    mean, se = mean_stderr(values)
    assert mean == pytest.approx(statistics.fmean(values))
    assert se == pytest.approx(statistics.stdev(values) / math.sqrt(len(values)))
    assert mean_stderr([]) == (None, None) and mean_stderr([0.5]) == (0.5, None)


def test_scores_per_harness_and_mode() -> None:
    tasks = cpu_suite().split("heldout")[:4]
    plan = StepPlan(1, 1, {})
    requests: dict[str, RolloutRequest] = {}
    for mode in ("sampled", "greedy"):
        for harness in ("agentloop", "agentloop-anthropic"):
            for task in tasks:
                [r] = instance_requests(task, harness, -1, plan, eval_mode=True)
                r.metadata[EVAL_MODE_KEY] = mode
                requests[r.rollout_id] = r
    out = Outstanding(max_attempts=1)
    out.add(list(requests.values()))
    greedy_a = [r for r in requests.values() if r.harness == "agentloop" and r.metadata[EVAL_MODE_KEY] == "greedy"]
    for req, value in zip(greedy_a, [1.0, 0.5, 1.0, 0.0], strict=True):
        # the 0: the grader failed on what the rollout left in its workspace (graded, and counted apart)
        out.on_reward(_reward(req.rollout_id, RewardStatus.OK, value, by_rollout=value == 0.0))
    sampled_b = [
        r for r in requests.values() if r.harness == "agentloop-anthropic" and r.metadata[EVAL_MODE_KEY] == "sampled"
    ]
    out.on_reward(_reward(sampled_b[0].rollout_id, RewardStatus.OK, 0.25))
    out.on_reward(_reward(sampled_b[1].rollout_id, RewardStatus.INFRA_FAILURE, None))  # gave up (1 attempt)
    out.on_reward(_reward(sampled_b[2].rollout_id, RewardStatus.UNGRADED, None))

    rows = {(r.harness, r.mode): r for r in eval_scores(requests, out)}
    assert [r.mode for r in eval_scores(requests, out)][:2] == ["greedy", "greedy"]  # greedy first, then sampled
    g = rows[("agentloop", "greedy")]
    assert (g.rollouts, g.graded, g.grader_errors, g.pending) == (4, 4, 1, 0)
    assert g.mean == pytest.approx(0.625) and g.solved == pytest.approx(0.5)
    assert g.stderr == pytest.approx(statistics.stdev([1.0, 0.5, 1.0, 0.0]) / 2)
    b = rows[("agentloop-anthropic", "sampled")]
    assert (b.rollouts, b.graded, b.grader_errors, b.infra, b.ungraded, b.pending) == (4, 1, 0, 1, 1, 1)
    assert b.mean == 0.25 and b.stderr is None and b.solved == 0.0
    assert rows[("agentloop", "sampled")].mean is None and rows[("agentloop", "sampled")].pending == 4

    table = eval_table(list(rows.values()), "temperature 1")
    assert table.index("greedy (temperature 0):") < table.index("sampled (temperature 1):")
    assert "| agentloop | 4 | 4 | 0.625 | 0.239 | 50.0% | 1 | 0 | 0 | 0 |" in table, table
    assert "| agentloop-anthropic | 4 | 1 | 0.250 | n/a | 0.0% | 0 | 1 | 1 | 1 |" in table, table
