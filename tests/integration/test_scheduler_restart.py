"""A train-mode scheduler SIGKILLed mid-run and restarted on the same run resumes from the log.

The scheduler runs as a real process (``python -m producers.scheduler.service --steps 4``, 2 tasks × 2 rollouts a
step). It holds at fault point ``scheduler.after_publish@2`` (steps 0 and 1 published, step 2 not); meanwhile a step-0
rollout gets two INFRA_FAILURE rewards of its attempt 0 (the second a late one, as from a re-run of the same
request), then the scheduler is SIGKILLed by its pid and started again without a fault. Read back from the requests
topic: steps 0–3 issued once each with 4 requests, the tasks and harnesses a pure re-planning of an uninterrupted
run gives, no (rollout id, attempt) twice, and the failed rollout re-issued exactly once (attempt 1, its second).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from producers.scheduler.plan import StepPlan, plan_step
from producers.tasks.catalog import SuiteCatalog
from schemas.events import RewardEvent, RewardStatus, RolloutRequest, now_ms
from schemas.topics import REWARDS, ROLLOUT_REQUESTS
from tests.support.topic_reader import read_events

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STEPS, TASKS_PER_STEP, GROUP_SIZE, SEED = 4, 2, 2, 0
MIX = {"agentloop": 1.0, "agentloop-anthropic": 1.0}
POINT = "scheduler.after_publish"


def _start(
    kafka: KafkaSettings,
    log: Path,
    fault_dir: Path | None = None,
    *,
    steps: int = STEPS,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLAWSTREAM_SCHEDULER_") and k != faults.ENV}
    env.update(
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=kafka.bootstrap_servers or "",
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=kafka.topic_prefix,
        CLAWSTREAM_SCHEDULER_TASKS_PER_STEP=str(TASKS_PER_STEP),
        CLAWSTREAM_SCHEDULER_GROUP_SIZE=str(GROUP_SIZE),
        CLAWSTREAM_SCHEDULER_HARNESS_MIX=json.dumps(MIX),
        CLAWSTREAM_SCHEDULER_MAX_POLICY_LAG="10",  # no weights needed: every step may go out at version 0
        CLAWSTREAM_SCHEDULER_MAX_ATTEMPTS="3",
        CLAWSTREAM_SCHEDULER_SEED=str(SEED),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra_env or {})
    if fault_dir is not None:
        env.update(faults.fault_env(fault_dir, **{f"{POINT}@2": "hold"}))
    out = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, "-m", "producers.scheduler.service", "--steps", str(steps)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _requests(kafka: KafkaSettings) -> list[RolloutRequest]:
    """Every request on the run's requests topic (read_committed, to the high watermarks of now)."""
    return read_events(kafka, ROLLOUT_REQUESTS, RolloutRequest)


def _infra_failure(kafka: KafkaSettings, req: RolloutRequest, tags: list[str]) -> None:
    producer = make_producer(kafka)
    for tag in tags:
        reward = RewardEvent(
            rollout_id=req.rollout_id,
            policy_version=req.policy_version,
            timestamp_ms=now_ms(),
            attempt_id=f"{req.rollout_id}.a{req.attempt}.{tag}",  # as the sandbox worker names attempts
            status=RewardStatus.INFRA_FAILURE,
            grader="none",
            reason="sandbox died",
        )
        producer.produce(kafka.topic(REWARDS), key=req.rollout_id.encode(), value=reward.to_bytes())
    assert producer.flush(20) == 0


def _uninterrupted_plan() -> dict[int, Counter]:
    """Per step the (task, harness, group) instances an uninterrupted run plans: pure, nothing published."""
    tasks = SuiteCatalog({"cpu_builtin": "builtin:cpu"}).suite("cpu_builtin").split("train")
    plan = StepPlan(TASKS_PER_STEP, GROUP_SIZE, MIX, max_attempts=3)
    rng = random.Random(SEED)
    return {
        s: Counter((r.task_id, r.harness, r.group_id) for r in plan_step(s, tasks, plan, rng)) for s in range(STEPS)
    }


@pytest.mark.timeout(300)
def test_a_scheduler_killed_mid_run_resumes_from_the_log(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    fault_dir = tmp_path / "faults"
    try:
        first = _start(kafka_settings, logs[0], fault_dir)
        procs.append(first)
        try:
            pid = faults.wait_held(fault_dir, POINT, timeout=120, alive=first)
        except (RuntimeError, TimeoutError) as exc:
            raise AssertionError(f"{exc}\n{logs[0].read_text()[-3000:]}") from None
        assert pid == first.pid
        before = _requests(kafka_settings)
        assert sorted(Counter(r.step for r in before).items()) == [(0, 4), (1, 4)], before
        victim = next(r for r in before if r.step == 0)
        # while it is held (nothing is read): attempt 0 failed, and a late reward of attempt 0 follows
        _infra_failure(kafka_settings, victim, ["worker1", "rerun2"])
        os.kill(pid, signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL

        second = _start(kafka_settings, logs[1])
        procs.append(second)
        assert second.wait(120) == 0, logs[1].read_text()[-4000:]
    finally:
        for proc in procs:  # every process this test started, by its pid
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(30)

    got = _requests(kafka_settings)
    pairs = Counter((r.rollout_id, r.attempt) for r in got)
    assert [p for p, n in pairs.items() if n > 1] == [], "a (rollout id, attempt) was issued twice"
    first_attempts = [r for r in got if r.attempt == 0]
    per_step = Counter(r.step for r in first_attempts)
    assert sorted(per_step.items()) == [(s, TASKS_PER_STEP * GROUP_SIZE) for s in range(STEPS)], per_step
    planned = _uninterrupted_plan()
    for s in range(STEPS):
        issued = Counter((r.task_id, r.harness, r.group_id) for r in first_attempts if r.step == s)
        assert issued == planned[s], f"step {s}: {issued} is not what an uninterrupted run plans: {planned[s]}"
    retries = [r for r in got if r.attempt > 0]
    assert [(r.rollout_id, r.attempt) for r in retries] == [(victim.rollout_id, 1)], retries
    (again,) = retries
    assert (again.group_id, again.task_id, again.harness, again.step) == (
        victim.group_id,
        victim.task_id,
        victim.harness,
        0,
    )
    assert not any(r.eval for r in got)
    out = logs[1].read_text()  # 8 outstanding: steps 0 and 1, the failed rollout as its attempt 1
    assert "resuming at step 2: 8 requests outstanding, 1 re-issued" in out, out[-4000:]
