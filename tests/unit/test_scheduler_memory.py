"""The train-mode scheduler's memory does not grow with the rollouts it settles (producers.scheduler.service).

A 30-minute soak measured the scheduler's RSS growing ~1.6 KB per rollout: it kept every request it issued and every
reward it settled. Here a :class:`Scheduler` with stand-ins for its Kafka edges (no broker, no process) issues and
settles 10,000 train rollouts — some infra failures, re-issued, some given up — and what it retains per rollout must
stay within what is in flight. Resume keeps only the pending rollouts of the log it rebuilt from; eval mode keeps
every request and reward (its table needs them; an eval is bounded by its task list).
"""

from __future__ import annotations

import dataclasses
import random

from clawbase.settings import KafkaSettings
from producers.scheduler.plan import plan_step
from producers.scheduler.service import Scheduler
from producers.scheduler.settings import SchedulerSettings
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms

IN_FLIGHT = 64  # tasks_per_step × group_size: the soak's 64 concurrent rollouts
ROLLOUTS = 10_000


class _Publisher:
    """Accepts every record at once (the scheduler's KafkaPublisher)."""

    def __init__(self) -> None:
        self.published = 0

    async def publish(self, topic: str, key: str, value: bytes, timeout: float) -> None:
        self.published += 1


class _Msg:
    def __init__(self, value: bytes) -> None:
        self._value = value

    def error(self) -> None:
        return None

    def value(self) -> bytes:
        return self._value

    def topic(self) -> str:
        return "clawstream.rewards"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 0


class _Consumer:
    """Hands out the records queued in it, then None (a poll(0) with nothing waiting)."""

    def __init__(self) -> None:
        self.queue: list[bytes] = []

    def poll(self, timeout: float) -> _Msg | None:
        return _Msg(self.queue.pop(0)) if self.queue else None

    def close(self) -> None:
        pass


def _reward(req: RolloutRequest, status: RewardStatus) -> RewardEvent:
    return RewardEvent(
        rollout_id=req.rollout_id,
        policy_version=req.policy_version,
        timestamp_ms=now_ms(),
        attempt_id=f"{req.rollout_id}.a{req.attempt}.w1",  # as the sandbox worker names attempts
        status=status,
        grader="g",
        reward=1.0 if status == RewardStatus.OK else None,
    )


def _scheduler(**overrides: object) -> Scheduler:
    settings = SchedulerSettings(
        **{"tasks_per_step": 8, "group_size": IN_FLIGHT // 8, "max_attempts": 2, "steps": 10**9, **overrides}
    )
    s = Scheduler(settings, KafkaSettings())  # never connects: its Kafka edges are stand-ins
    s.publisher, s.weights, s.rewards = _Publisher(), _Consumer(), _Consumer()  # type: ignore[assignment]
    return s


def _retained(s: Scheduler) -> int:
    """Entries the scheduler keeps per rollout."""
    out = s.outstanding
    return len(s.issued) + len(out.pending) + len(out.final) + len(out.gave_up)


def _settle_all(s: Scheduler, requests: list[RolloutRequest], rng: random.Random) -> None:
    """Queue one reward per request: ~10 % infra failures (re-issued once: max_attempts 2), the rest graded."""
    for r in requests:
        status = RewardStatus.INFRA_FAILURE if rng.random() < 0.1 else RewardStatus.OK
        s.rewards.queue.append(_reward(r, status).to_bytes())  # type: ignore[union-attr]


async def test_train_state_stays_within_the_rollouts_in_flight() -> None:
    s, rng = _scheduler(), random.Random(1)
    tasks = s.catalog.suite(s.settings.suite).split(s.settings.split)
    issued, step, peak = 0, 0, 0
    await s._resume(tasks, [], [])  # an empty log: train mode's state from the start
    while issued < ROLLOUTS:
        requests = plan_step(step, tasks, s.plan, s.rng, s.version)
        await s.publish(requests)
        issued, step = issued + len(requests), step + 1
        peak = max(peak, _retained(s))
        _settle_all(s, requests, rng)
        before = s.publisher.published  # type: ignore[union-attr]
        await s._drain()  # settles them; infra failures are re-published as attempt 1
        again = list(s.outstanding.pending.values())
        assert all(r.attempt == 1 for r in again) and len(again) == s.publisher.published - before  # type: ignore[union-attr]
        peak = max(peak, _retained(s))
        _settle_all(s, again, rng)  # a second infra failure is given up (no attempt left)
        await s._drain()
        assert not s.outstanding.pending, "every rollout settled"
        assert _retained(s) == 0, f"step {step}: {_retained(s)} entries kept after {issued} rollouts settled"
    assert peak <= IN_FLIGHT, peak
    out = s.outstanding
    assert out.n_final + out.n_gave_up == issued and out.n_gave_up > 0  # settled ones are counted, not kept


async def test_resume_keeps_only_the_pending_rollouts_of_the_log() -> None:
    s, rng = _scheduler(start_step=0), random.Random(2)
    tasks = s.catalog.suite(s.settings.suite).split(s.settings.split)
    plan_rng = random.Random(s.settings.seed)  # the log a run with this seed wrote: the re-plan on resume matches it
    requests = [r for step in range(100) for r in plan_step(step, tasks, s.plan, plan_rng, 0)]
    open_ids = {r.rollout_id for r in requests[-IN_FLIGHT:]}  # the last step's rollouts have no reward yet
    rewards = [_reward(r, RewardStatus.OK) for r in requests if r.rollout_id not in open_ids]
    rng.shuffle(rewards)
    assert await s._resume(tasks, requests, rewards) == 100
    assert set(s.outstanding.pending) == open_ids and not s.issued
    assert _retained(s) == IN_FLIGHT, "settled rollouts of the log are not kept"


async def test_eval_keeps_every_request_and_reward_for_its_table() -> None:
    s = _scheduler(eval_limit=3, eval_harnesses=["agentloop", "agentloop-anthropic"])
    requests = s.eval_requests()
    await s.publish(requests)
    failed = requests[0]
    for r in requests:
        status = RewardStatus.INFRA_FAILURE if r is requests[0] else RewardStatus.OK
        s.rewards.queue.append(_reward(r, status).to_bytes())  # type: ignore[union-attr]
    await s._drain()
    s.rewards.queue.append(_reward(dataclasses.replace(failed, attempt=1), RewardStatus.INFRA_FAILURE).to_bytes())  # type: ignore[union-attr]
    await s._drain()
    assert set(s.issued) == {r.rollout_id for r in requests}
    assert len(s.outstanding.final) == len(requests) - 1 and set(s.outstanding.gave_up) == {failed.rollout_id}
