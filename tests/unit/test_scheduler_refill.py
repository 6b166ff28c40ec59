"""The scheduler's refills (producers.scheduler.refill): the rule is the grouper's, the refills are bounded, new
groups of their step and harness, and a rebuild from the log owes none twice."""

from __future__ import annotations

import random

import pytest

from clawbase.settings import KafkaSettings
from producers.scheduler.plan import StepPlan, plan_step
from producers.scheduler.refill import REFILL_KEY, Refills, emits_nothing, settled_reward
from producers.scheduler.service import Scheduler
from producers.scheduler.settings import SchedulerSettings
from producers.tasks.catalog import SuiteCatalog
from schemas.events import (
    GROUP_METRIC,
    GROUPER,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutRequest,
    TrajectoryStatus,
    group_verdict,
    now_ms,
)
from streams.group import GroupState, score
from streams.settings import StreamsSettings

TASKS = SuiteCatalog({"cpu_builtin": "builtin:cpu"}).suite("cpu_builtin").split("train")
PLAN = StepPlan(4, 3, {"agentloop": 1.0, "agentloop-anthropic": 1.0})


def _reward(r: RolloutRequest, value: float | None, status: RewardStatus = RewardStatus.OK) -> RewardEvent:
    return RewardEvent(r.rollout_id, 0, now_ms(), f"{r.rollout_id}.a{r.attempt}.w", status, "g", value)


def _refills(budget: int = 8) -> Refills:
    return Refills(budget, drop_equal=True, run_key="run|0", seed=0)


@pytest.mark.parametrize("zero_variance", ["drop", "keep"])
def test_the_rule_is_the_grouper_s(zero_variance: str) -> None:
    """Random settled groups: the scheduler says 'trains nothing' exactly when the grouper emits nothing."""
    cfg, rng = StreamsSettings(zero_variance=zero_variance, store="memory://"), random.Random(0)
    for _ in range(2000):
        members, rewards = {}, []
        for i in range(rng.randint(1, 5)):
            kind = rng.choice(["ok", "ok", "ok", "infra", "ungraded"])
            value = rng.choice([0.0, 0.5, 1.0]) if kind == "ok" else None
            status = {"ok": "COMPLETE", "infra": "INFRA_FAILURE", "ungraded": "DROPPED"}[kind]
            members[f"r{i}"] = {"reward": value, "status": TrajectoryStatus(status), "trainable": kind == "ok"}
            rewards.append(
                settled_reward(
                    RewardEvent(
                        f"r{i}",
                        0,
                        0,
                        "a",
                        RewardStatus[{"ok": "OK", "infra": "INFRA_FAILURE", "ungraded": "UNGRADED"}[kind]],
                        "g",
                        value,
                    )
                )
            )
        group = GroupState("g", len(members), 0, members=members)
        nothing = score(group, cfg).outcome in ("zero_variance_dropped", "no_reward")
        assert emits_nothing(rewards, len(members), zero_variance == "drop") is nothing, (members, rewards)
        assert emits_nothing(rewards[:-1], len(members), zero_variance == "drop") is None  # a member still to settle


def test_a_group_solved_alike_is_refilled_once_by_a_new_group_of_its_step_and_harness() -> None:
    refills, rng = _refills(), random.Random(0)
    step0 = plan_step(0, TASKS, PLAN, rng)
    refills.add(step0)
    groups: dict[str, list[RolloutRequest]] = {}
    for r in step0:
        groups.setdefault(r.group_id, []).append(r)
    solved, mixed = list(groups.values())[:2]
    for r in solved:
        assert refills.owed() == []  # undecided until every member settled
        refills.settle(r, _reward(r, 1.0))
    for r, value in zip(mixed, (1.0, 0.0, 1.0), strict=True):
        refills.settle(r, _reward(r, value))
    (owed,) = refills.owed()
    assert (owed.step, owed.harness, owed.k) == (0, solved[0].harness, 0)
    new = refills.plan(owed, TASKS, PLAN, 3)
    assert new is not None and len(new) == 3 and len({r.group_id for r in new}) == 1
    assert new[0].group_id not in groups and new[0].group_id.endswith(f"|{solved[0].harness}|0")
    assert all(r.metadata[REFILL_KEY] == "0" and r.policy_version == 3 and r.step == 0 for r in new)
    again = _refills()  # the same refill planned by another scheduler of the same run: the same group and ids
    again.add(step0)
    for r in solved:
        again.settle(r, _reward(r, 1.0))
    assert [r.rollout_id for r in again.plan(again.owed()[0], TASKS, PLAN, 3) or []] == [r.rollout_id for r in new]
    refills.add(new)
    assert refills.owed() == []  # issued: owed no more


def test_rebuilt_from_the_log_it_owes_what_is_missing_only_and_stays_within_the_budget() -> None:
    rng = random.Random(1)
    step0 = plan_step(0, TASKS, PLAN, rng)
    log, rewards = list(step0), [_reward(r, 1.0) for r in step0]  # every group solved alike: 4 dead
    live = _refills(budget=5)
    live.add(step0)
    for r, w in zip(step0, rewards, strict=True):
        live.settle(r, w)
    first = live.owed()
    assert len(first) == 4
    for refill in first[:2]:  # two refills reach the log, then the scheduler is killed
        reqs = live.plan(refill, TASKS, PLAN, 0)
        assert reqs is not None
        live.add(reqs)
        log += reqs
        rewards += [_reward(r, 0.0) for r in reqs]  # they fail alike too: 2 more dead
    rebuilt = _refills(budget=5)
    rebuilt.add(log)
    for r, w in zip(log, rewards, strict=True):
        rebuilt.settle(r, w)
    owed = rebuilt.owed()
    assert len(owed) == 3  # 6 dead, 2 refilled, a budget of 5: 3 more, none already on the log
    issued = {(r.harness, r.metadata[REFILL_KEY]) for r in log if REFILL_KEY in r.metadata}
    assert not issued & {(o.harness, str(o.k)) for o in owed}
    planned = [rebuilt.plan(o, TASKS, PLAN, 0) or [] for o in owed]
    assert len({r.group_id for g in planned for r in g} | {r.group_id for r in log}) == 4 + 2 + 3
    for g in planned:
        rebuilt.add(g)
        for r in g:
            rebuilt.settle(r, _reward(r, 1.0))
    assert rebuilt.owed() == [] and rebuilt.short() == [(0, 9 - 5)] and rebuilt.short() == []  # warned once


async def test_a_restarted_scheduler_completes_a_refill_cut_short_with_the_same_ids() -> None:
    settings = SchedulerSettings(tasks_per_step=2, group_size=3, harness_mix={"agentloop": 1.0}, steps=1)
    first = Scheduler(settings, KafkaSettings(topic_prefix="t."))
    step0 = plan_step(0, TASKS, first.plan, random.Random(settings.seed))
    rewards = [_reward(r, 1.0) for r in step0]
    first.refills.add(step0)
    for r, w in zip(step0, rewards, strict=True):
        first.refills.settle(r, w)
    refill = first.refills.plan(first.refills.owed()[0], TASKS, first.plan, 0)
    assert refill is not None

    class _Publisher:
        def __init__(self) -> None:
            self.keys: list[str] = []

        async def publish(self, topic: str, key: str, value: bytes, timeout: float) -> None:
            self.keys.append(key)

    second = Scheduler(settings, KafkaSettings(topic_prefix="t."))
    second.publisher = publisher = _Publisher()  # type: ignore[assignment]
    await second._resume(TASKS, [*step0, refill[0]], rewards)  # the kill came after the refill's first member
    assert publisher.keys == [r.rollout_id for r in refill[1:]]
    assert [o.k for o in second.refills.owed()] == [1]  # the other dead group's refill, issued by train()


def _verdict(group_id: str, trained: int) -> Metric:
    """The grouper's ``group`` metric for a closed group, as streams.group builds it."""
    labels = {"group_id": group_id, "harness": "h", "outcome": "trained" if trained else "zero_variance_dropped"}
    return Metric(0, now_ms(), GROUPER, GROUP_METRIC, {"trained": float(trained)}, step=0, labels=labels)


async def test_the_grouper_s_verdict_decides_a_group_its_rewards_say_trains() -> None:
    """Rewards 1, 0, 1, but the grouper dropped the 0 (a tampered call) and the group with it: a refill is owed,
    live and when rebuilt from the log; a group the grouper trained is owed none. Rewards alone owed nothing (the
    scheduler before the verdicts: an opencode run's last batch waited for good)."""
    step0 = plan_step(0, TASKS, PLAN, random.Random(2))
    groups: dict[str, list[RolloutRequest]] = {}
    for r in step0:
        groups.setdefault(r.group_id, []).append(r)
    spoiled, trained = list(groups.values())[:2]
    refills = _refills()
    refills.add(step0)
    for group in (spoiled, trained):
        for r, value in zip(group, (1.0, 0.0, 1.0), strict=True):
            refills.settle(r, _reward(r, value))
    assert refills.owed() == [] and refills.undecided() == 2  # by the rewards both train: the verdicts decide
    metrics = [_verdict(trained[0].group_id, 3), _verdict(spoiled[0].group_id, 0), _verdict("x|y|0", 0)]
    for m in metrics:
        verdict = group_verdict(m)
        assert verdict is not None
        refills.verdict(*verdict)
    (owed,) = refills.owed()
    assert (owed.step, owed.harness) == (0, spoiled[0].harness) and refills.undecided() == 0
    refills.verdict(spoiled[0].group_id, 0)  # read twice (a replay): owed once
    assert [o.k for o in refills.owed()] == [0]

    settings = SchedulerSettings(
        tasks_per_step=4, group_size=3, harness_mix={"agentloop": 1.0, "agentloop-anthropic": 1.0}, steps=1
    )
    rebuilt = Scheduler(settings, KafkaSettings(topic_prefix="t."))
    rewards = [_reward(r, v) for g in (spoiled, trained) for r, v in zip(g, (1.0, 0.0, 1.0), strict=True)]
    await rebuilt._resume(TASKS, step0, rewards, [Metric(0, now_ms(), "learner", "step", {"loss": 1.0}), *metrics])
    assert [(o.step, o.harness, o.k) for o in rebuilt.refills.owed()] == [(0, spoiled[0].harness, 0)]


def test_only_the_grouper_s_group_metric_is_a_verdict() -> None:
    assert group_verdict(_verdict("s/t|h|3", 5)) == ("s/t|h|3", 5)
    assert group_verdict(Metric(0, now_ms(), GROUPER, "late", {"trained": 0.0}, labels={"group_id": "g"})) is None
    assert (
        group_verdict(Metric(0, now_ms(), "learner", GROUP_METRIC, {"trained": 0.0}, labels={"group_id": "g"})) is None
    )
    assert group_verdict(Metric(0, now_ms(), GROUPER, GROUP_METRIC, {"trained": 0.0})) is None
