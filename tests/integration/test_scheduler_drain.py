"""After its last step the scheduler keeps refilling while that step's rewards keep coming, however long the step.

A real broker and the scheduler as a real process (1 step of 2 groups x 2, ``zero_variance="drop"``, a 4 s drain
timeout); this test plays the sandbox worker, publishing each member's reward 1.5 s after the one before (a slow
harness: the step outlasts the drain timeout). The second group's rewards are equal, so it trains nothing and is owed a
refill, known only at the last reward, past the drain timeout counted from the last step. The scheduler before this
fix counted it from the last step (or refill) only: it exited first and the refill never went out (an opencode run's
last batch waited for good, bench/results/real_harness.md).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from producers.scheduler.refill import REFILL_KEY
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms
from schemas.topics import REWARDS
from tests.integration.test_scheduler_restart import _requests, _start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DRAIN_S, GAP_S = 4.0, 1.5


def _ok(kafka: KafkaSettings, req: RolloutRequest, reward: float) -> None:
    producer = make_producer(kafka)
    event = RewardEvent(
        rollout_id=req.rollout_id,
        policy_version=req.policy_version,
        timestamp_ms=now_ms(),
        attempt_id=f"{req.rollout_id}.a{req.attempt}.w",
        status=RewardStatus.OK,
        grader="test",
        reward=reward,
    )
    producer.produce(kafka.topic(REWARDS), key=req.rollout_id.encode(), value=event.to_bytes())
    assert producer.flush(20) == 0


def test_the_last_steps_refill_goes_out_when_its_rewards_outlast_the_drain_timeout(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    log = tmp_path / "scheduler.log"
    env = {"CLAWSTREAM_SCHEDULER_ZERO_VARIANCE": "drop", "CLAWSTREAM_SCHEDULER_DRAIN_TIMEOUT_S": str(DRAIN_S)}
    proc = _start(kafka_settings, log, steps=1, extra_env=env)
    try:
        deadline = time.monotonic() + 60
        reqs: list[RolloutRequest] = []
        while len(reqs) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
            with contextlib.suppress(KafkaException):  # the topic is created by the first publish: no leader yet
                reqs = _requests(kafka_settings)
        groups: dict[str, list[RolloutRequest]] = {}
        for r in reqs:
            groups.setdefault(r.group_id, []).append(r)
        informative, alike = sorted(groups.values(), key=lambda g: g[0].group_id)
        started = time.monotonic()
        for req, reward in [(informative[0], 1.0), (informative[1], 0.0), (alike[0], 1.0), (alike[1], 1.0)]:
            _ok(kafka_settings, req, reward)
            time.sleep(GAP_S)
        assert time.monotonic() - started > DRAIN_S  # the step outlasted the drain timeout
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        refills = [r for r in _requests(kafka_settings) if REFILL_KEY in (r.metadata or {})]
        assert len(refills) == 2, log.read_text()[-3000:]  # one group of 2 for the group that trains nothing
        assert {r.harness for r in refills} == {alike[0].harness} and all(r.step == 0 for r in refills)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
