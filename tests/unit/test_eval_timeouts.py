"""Evaluations count the rollouts killed at the task timeout, and the demo does not reuse a result full of them.

A load-caused timeout is graded 0 like the policy's own (a 2-step demo beside eight busy test workers once had 29 of
32 "before" rollouts at the 60 s timeout); cached, such a result would be every later run's "before"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawstream.demo import run as demo_run
from clawstream.stack.evaluate import EvalConfig, EvalResult, timed_out_by_cell
from producers.scheduler.plan import EVAL_MODE_KEY, EvalScore
from schemas.events import RolloutEvent, RolloutRequest, RolloutState


def _request(rid: str, harness: str, mode: str) -> RolloutRequest:
    return RolloutRequest(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=0,
        suite="s",
        task_id=f"heldout-{rid}-sum",
        harness=harness,
        group_id=f"g-{rid}",
        step=0,
        timeout_s=60.0,
        metadata={EVAL_MODE_KEY: mode},
    )


def _event(rid: str, state: RolloutState, attempt: int = 0) -> RolloutEvent:
    return RolloutEvent(rid, 0, 0, f"{rid}#{attempt}", state, f"g-{rid}", "agentloop", attempt=attempt)


def test_timeouts_are_counted_once_per_rollout_per_harness_and_mode() -> None:
    issued = {
        "a": _request("a", "agentloop", "greedy"),
        "b": _request("b", "agentloop", "greedy"),
        "c": _request("c", "agentloop-anthropic", "sampled"),
        "d": _request("d", "agentloop", "greedy"),
    }
    events = [
        _event("a", RolloutState.STARTED),
        _event("a", RolloutState.TIMED_OUT),
        _event("a", RolloutState.TIMED_OUT, attempt=1),  # a re-issued attempt that timed out again: one rollout
        _event("b", RolloutState.HARNESS_EXITED),
        _event("c", RolloutState.TIMED_OUT),
        _event("zz", RolloutState.TIMED_OUT),  # not this evaluation's request
    ]
    assert timed_out_by_cell(issued, events) == {"agentloop/greedy": 1, "agentloop-anthropic/sampled": 1}
    assert timed_out_by_cell(issued, []) == {}


def _result(timed_out: dict[str, int], rollouts: int = 100) -> EvalResult:
    row = EvalScore("agentloop", "greedy", rollouts, rollouts, 0.5, 0.05, 0.5, 0, 0, 0)
    return EvalResult("m", EvalConfig(tasks=rollouts), [row], 1.0, "", {"per_task": {}, "timed_out": timed_out})


@pytest.mark.parametrize(
    ("timed_out", "kept"), [({}, True), ({"agentloop/greedy": 2}, True), ({"agentloop/greedy": 29}, False)]
)
def test_the_demo_caches_only_an_evaluation_with_few_timeouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, timed_out: dict[str, int], kept: bool
) -> None:
    model = Path(__file__).resolve().parents[2] / "models" / "warmstart"
    cfg = EvalConfig(tasks=100)
    monkeypatch.setattr(demo_run, "run_eval", lambda *a, **k: _result(timed_out))
    said: list[str] = []
    first = demo_run.cached_eval(model, cfg, tmp_path, say=said.append)
    path = demo_run.eval_cache_path(model, cfg, tmp_path)
    assert path.exists() is kept
    assert first.timed_out() == sum(timed_out.values())
    assert any("not cached for reuse: 29 of 100 rollouts" in s for s in said) is (not kept)
    if kept:  # what is cached carries its count back
        assert EvalResult.from_json(json.loads(path.read_text())).timed_out() == sum(timed_out.values())
