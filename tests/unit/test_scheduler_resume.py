"""A train-mode scheduler rebuilt from its run's log (producers.scheduler.plan: ``rebuild``, ``missing_requests``,
``reward_attempt``): steps issued, latest attempt per rollout, what is outstanding, owed re-issues, eval requests
ignored; a reward of an attempt other than the latest issued settles and re-issues nothing."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

from producers.scheduler.plan import (
    Outstanding,
    StepPlan,
    instance_requests,
    missing_requests,
    plan_step,
    rebuild,
    reward_attempt,
)
from producers.tasks.cpu import cpu_suite
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms

PLAN = StepPlan(tasks_per_step=2, group_size=2, mix={"agentloop": 1, "agentloop-anthropic": 1}, max_attempts=3)
TASKS = cpu_suite().split("train")


def _steps(n: int, seed: int = 0) -> list[list[RolloutRequest]]:
    rng = random.Random(seed)
    return [plan_step(s, TASKS, PLAN, rng, policy_version=s) for s in range(n)]


def _reward(req: RolloutRequest, status: RewardStatus, *, attempt: int | None = None, tag: str = "w1") -> RewardEvent:
    n = req.attempt if attempt is None else attempt
    return RewardEvent(
        rollout_id=req.rollout_id,
        policy_version=req.policy_version,
        timestamp_ms=now_ms(),
        attempt_id=f"{req.rollout_id}.a{n}.{tag}",  # as the sandbox worker names attempts
        status=status,
        grader="g",
        reward=1.0 if status == RewardStatus.OK else None,
    )


def _again(req: RolloutRequest) -> RolloutRequest:
    return dataclasses.replace(req, attempt=req.attempt + 1)


def test_the_attempt_a_reward_is_for_comes_from_its_attempt_id() -> None:
    req = _steps(1)[0][0]
    assert reward_attempt(_reward(req, RewardStatus.OK, attempt=2)) == 2
    for odd in (
        "x",
        f"{req.rollout_id}.x",
        f"{req.rollout_id}.a",
        f"{req.rollout_id}.a1",
        f"other.a1.{req.rollout_id}",
    ):
        assert reward_attempt(dataclasses.replace(_reward(req, RewardStatus.OK), attempt_id=odd)) is None, odd


def test_a_reward_of_a_stale_attempt_settles_and_reissues_nothing() -> None:
    a, b = _steps(1)[0][:2]
    out = Outstanding(max_attempts=3)
    out.add([a, b])
    again = out.on_reward(_reward(a, RewardStatus.INFRA_FAILURE))
    assert again is not None and again.attempt == 1
    # attempt 0 again (a late reward, e.g. of a re-run of the same request on another worker): not re-issued twice
    assert out.on_reward(_reward(a, RewardStatus.INFRA_FAILURE, attempt=0, tag="w2")) is None
    assert out.on_reward(_reward(a, RewardStatus.OK, attempt=0, tag="w3")) is None
    assert out.pending[a.rollout_id].attempt == 1 and a.rollout_id not in out.final
    assert out.on_reward(_reward(a, RewardStatus.OK, attempt=5)) is None  # an attempt never issued: nothing either
    assert a.rollout_id in out.pending
    assert out.on_reward(_reward(a, RewardStatus.OK, attempt=1)) is None and a.rollout_id in out.final
    assert a.rollout_id not in out.pending
    # an attempt id without a number counts for the latest attempt (hand-made events, older records)
    assert out.on_reward(dataclasses.replace(_reward(b, RewardStatus.OK), attempt_id="x")) is None
    assert b.rollout_id in out.final and not out.pending


def test_rebuild_from_the_log() -> None:
    s0, s1, s2 = _steps(3)
    evals = instance_requests(TASKS[0], "agentloop", -1, PLAN, eval_mode=True)
    reissued, owed, settled, spent = s0[0], s0[1], s1[0], s1[1]
    spent_last = dataclasses.replace(spent, attempt=2)  # its third and last attempt
    requests = [*s0, *evals, *s1, _again(reissued), dataclasses.replace(spent, attempt=1), spent_last, *s2]
    rewards = [
        _reward(reissued, RewardStatus.INFRA_FAILURE),  # attempt 0 failed and was re-issued before the kill
        _reward(reissued, RewardStatus.INFRA_FAILURE, tag="late"),  # a late one of attempt 0: stale
        _reward(owed, RewardStatus.INFRA_FAILURE),  # failed while the scheduler was down: owed
        _reward(settled, RewardStatus.OK),
        _reward(spent_last, RewardStatus.INFRA_FAILURE),  # attempts used up: given up, not re-issued
        _reward(evals[0], RewardStatus.OK),  # an eval rollout: not the train state's
        _reward(s2[0], RewardStatus.OK, attempt=1),  # an attempt never issued: ignored
    ]
    found = rebuild(requests, rewards, max_attempts=3)

    assert found.next_step == 3 and sorted(found.steps) == [0, 1, 2]
    assert all(len(found.steps[s]) == 4 for s in (0, 1, 2))  # one entry per rollout, its latest attempt
    assert not any(r.eval for r in found.issued.values()) and evals[0].rollout_id not in found.issued
    assert found.issued[reissued.rollout_id].attempt == 1 and found.issued[spent.rollout_id].attempt == 2
    assert [(r.rollout_id, r.attempt) for r in found.reissue] == [(owed.rollout_id, 1)]
    pending = found.outstanding.pending
    assert set(pending) == {r.rollout_id for r in (*s0, *s1, *s2)} - {settled.rollout_id, spent.rollout_id}
    assert pending[reissued.rollout_id].attempt == 1 and pending[owed.rollout_id].attempt == 1
    assert set(found.outstanding.final) == {settled.rollout_id}
    assert set(found.outstanding.gave_up) == {spent.rollout_id}

    # the same log read again (a second restart before anything new): the same state, nothing owed twice
    again = rebuild([*requests, *found.reissue], rewards, max_attempts=3)
    assert again.reissue == [] and set(again.outstanding.pending) == set(pending)


def test_rebuild_goes_on_after_the_last_step_and_never_before_start_step() -> None:
    s0, s1 = _steps(2)
    assert rebuild([], [], 3).next_step == 0 and rebuild([], [], 3, start_step=4).next_step == 4
    assert rebuild([*s0, *s1], [], 3, start_step=1).next_step == 2
    assert rebuild([*s0, *s1], [], 3, start_step=7).next_step == 7
    evals = instance_requests(TASKS[0], "agentloop", -1, PLAN, eval_mode=True)
    assert rebuild(evals, [], 3).next_step == 0 and not rebuild(evals, [], 3).issued


def test_replanning_the_issued_steps_moves_the_rng_as_issuing_them_did() -> None:
    uninterrupted = _steps(4)
    rng = random.Random(0)
    for s in range(2):  # the resumed scheduler re-plans steps 0 and 1 without publishing them
        plan_step(s, TASKS, PLAN, rng)
    resumed = [plan_step(s, TASKS, PLAN, rng, policy_version=s) for s in (2, 3)]
    for a, b in zip(uninterrupted[2:], resumed, strict=True):
        assert [(r.task_id, r.harness, r.group_id) for r in a] == [(r.task_id, r.harness, r.group_id) for r in b]


def test_missing_requests_complete_a_step_cut_short() -> None:
    (logged,) = _steps(1)
    replanned = plan_step(0, TASKS, PLAN, random.Random(0))  # policy version 0 here; the step went out at 0 too
    logged = [dataclasses.replace(r, policy_version=3, min_policy_version=3) for r in logged]
    missing = missing_requests(replanned, logged[:3])
    assert missing is not None and len(missing) == 1
    (m,) = missing
    assert (m.group_id, m.task_id, m.harness, m.step) == (logged[3].group_id, logged[3].task_id, logged[3].harness, 0)
    assert m.policy_version == 3 and m.min_policy_version == 3 and m.rollout_id not in {r.rollout_id for r in logged}
    assert Counter(r.group_id for r in [*logged[:3], m]) == Counter(r.group_id for r in logged)
    assert missing_requests(replanned, logged) == []  # complete
    assert missing_requests(replanned, []) == []  # never issued (e.g. before start_step): nothing to complete
    other_seed = plan_step(0, TASKS, PLAN, random.Random(1))
    assert Counter(r.group_id for r in other_seed) != Counter(r.group_id for r in logged)
    assert missing_requests(other_seed, logged[:1]) is None  # not this plan's step: never guessed at
