"""Rollout scheduler on the real broker.

Train mode: requests per step (group ids, group size, harness mix), policy-lag gating (step s+1 waits for weight
version ≥ s+1 − lag, published on ``clawstream.weights``), and re-issue of an INFRA_FAILURE reward as attempt + 1.
Eval mode: held-out cpu tasks × two harnesses through a real sandbox worker, proxy and scripted engine; the
per-harness score table comes back complete.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from clawbase.kafka.clients import make_consumer, make_producer
from producers.scheduler.service import Scheduler
from producers.scheduler.settings import SchedulerSettings
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, WeightVersion, now_ms
from schemas.topics import REWARDS, ROLLOUT_REQUESTS, WEIGHTS
from tests.support.sandbox_stack import stack

pytestmark = pytest.mark.integration


class RequestReader:
    def __init__(self, kafka) -> None:
        self.consumer = make_consumer(kafka, f"r-{uuid.uuid4().hex[:8]}")
        self.consumer.subscribe([kafka.topic(ROLLOUT_REQUESTS)])
        self.seen: list[RolloutRequest] = []

    async def until(self, n: int, timeout: float = 30) -> list[RolloutRequest]:
        deadline = time.monotonic() + timeout
        while len(self.seen) < n and time.monotonic() < deadline:
            msg = await asyncio.to_thread(self.consumer.poll, 0.2)
            if msg is not None and not msg.error():
                self.seen.append(RolloutRequest.from_bytes(msg.value()))
        return self.seen


def produce(kafka, topic: str, key: str, value: bytes) -> None:
    p = make_producer(kafka)
    p.produce(kafka.topic(topic), key=key.encode(), value=value)
    assert p.flush(20) == 0


def weights(kafka, version: int) -> None:
    w = WeightVersion(
        policy_version=version,
        timestamp_ms=now_ms(),
        model_name="policy",
        step=version,
        uri=f"file:///w/{version}",
        sha256="0" * 64,
    )
    produce(kafka, WEIGHTS, "policy", w.to_bytes())


@pytest.mark.timeout(120)
async def test_train_steps_lag_and_reissue(kafka_settings) -> None:
    settings = SchedulerSettings(
        steps=3,
        max_policy_lag=0,
        tasks_per_step=2,
        group_size=2,
        max_attempts=2,
        harness_mix={"agentloop": 1, "agentloop-anthropic": 1},
    )
    reader = RequestReader(kafka_settings)
    task = asyncio.create_task(Scheduler(settings, kafka_settings).train())
    try:
        step0 = await reader.until(4)
        assert len(step0) == 4 and {r.step for r in step0} == {0}
        assert {r.metadata["group_size"] for r in step0} == {"2"} and len({r.group_id for r in step0}) == 2
        assert {r.group_id.split("|")[1] for r in step0} == {"agentloop", "agentloop-anthropic"}
        assert all(r.group_id == f"cpu_builtin/{r.task_id}|{r.harness}|0" for r in step0)
        await asyncio.sleep(1.5)
        assert len(await reader.until(5, timeout=1)) == 4, "step 1 issued before weight version 1"
        victim = step0[0]
        failed = RewardEvent(
            rollout_id=victim.rollout_id,
            policy_version=0,
            timestamp_ms=now_ms(),
            attempt_id="x",
            status=RewardStatus.INFRA_FAILURE,
            grader="none",
            reason="sandbox died",
        )
        produce(kafka_settings, REWARDS, victim.rollout_id, failed.to_bytes())
        again = (await reader.until(5))[4]
        assert again.rollout_id == victim.rollout_id and again.attempt == 1 and again.group_id == victim.group_id
        weights(kafka_settings, 1)
        step1 = (await reader.until(9))[5:]
        assert {r.step for r in step1} == {1} and {r.policy_version for r in step1} == {1}
        weights(kafka_settings, 2)
        assert await asyncio.wait_for(task, 30) == 3
        assert {r.step for r in (await reader.until(13))[9:]} == {2}
    finally:
        task.cancel()
        reader.consumer.close()


@pytest.mark.timeout(240)
async def test_eval_table(kafka_settings, group_id, tmp_path, capsys) -> None:
    settings = SchedulerSettings(eval_harnesses=["agentloop", "agentloop-anthropic"], eval_limit=3, eval_timeout_s=120)
    async with stack(kafka_settings, group_id, tmp_path, suites={"cpu_builtin": "builtin:cpu"}):
        scheduler = Scheduler(settings, kafka_settings)
        table = await scheduler.evaluate()
    print(table)
    reqs = list(scheduler.issued.values())
    assert len(reqs) == 6 and all(r.eval and r.step == -1 and r.task_id.startswith("heldout-") for r in reqs)
    assert "| agentloop | 3 | 3 |" in table and "| agentloop-anthropic | 3 | 3 |" in table, table
    assert not scheduler.outstanding.pending
    # the scripted policy writes the first quoted name with the second quoted text: exact for 'write' tasks
    rewards = {scheduler.issued[rid].task_id: r.reward for rid, r in scheduler.outstanding.final.items()}
    assert rewards["heldout-000-write"] == 1.0
