"""A group the grouper drops for a reason the rewards do not show is refilled, and the last batch still forms.

Real broker, the real streams worker (groups of 2, batches of 2 groups, equal-reward groups dropped) and the scheduler
as a real process (1 step of 2 groups x 2, ``zero_variance="drop"``). The test plays the proxy and the sandbox worker:
for each request it publishes the rollout's lifecycle events, model calls and reward (``tests/support/stream_load``).
Both groups' rewards are 1.0 and 0.0 — by the rewards both train — but the 0.0 member of one group made a call whose
request held an assistant turn the proxy never generated (``tampered``): the tree filter drops that rollout (DROPPED),
the grouper scores the group on the one member left and drops it as solved alike. The scheduler before this fix judged
groups by their rewards alone, issued no refill, and the batch of 2 never formed: an opencode run's last batch waited
for good on one such group of step 2 (bench/results/real_harness.md). Now it follows the grouper's verdict (its
``group`` metric): the refill goes out, its rollouts settle, the batch forms, ``clawstream audit`` says CLEAN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException

from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from producers.scheduler.refill import REFILL_KEY
from schemas.events import BatchRecord, BatchRecordKind, CallEvent, RolloutRequest, Trajectory, TrajectoryStatus
from schemas.topics import BATCHES, CALLS, ROLLOUT_REQUESTS, TRAJECTORIES
from tests.integration.test_scheduler_restart import GROUP_SIZE, TASKS_PER_STEP, _requests, _start
from tests.support.stream_harness import Worker, produce
from tests.support.stream_load import SynthRollout, build
from tests.support.topic_reader import read_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
STREAMS = {
    "store": "memory://",
    "settle_interval_s": 0.5,
    "settle_timeout_s": 30.0,
    "group_timeout_s": 120.0,
    "tick_interval_s": 0.5,
    "commit_interval_s": 0.5,
    "group_size": GROUP_SIZE,
    "batch_groups": TASKS_PER_STEP,
    "zero_variance": "drop",
    "max_policy_lag": 4,
}


def _settle(kafka: KafkaSettings, group: list[RolloutRequest], rewards: list[float], tampered: int | None) -> None:
    """Publish what the proxy and sandbox worker would for each request of ``group`` (not the request itself)."""
    for i, (req, reward) in enumerate(zip(sorted(group, key=lambda r: r.rollout_id), rewards, strict=True)):
        r = build(
            SynthRollout(
                rollout_id=req.rollout_id,
                group_id=req.group_id,
                task_id=req.task_id,
                harness=req.harness,
                step=req.step,
                reward_value=reward,
                policy_version=req.policy_version,
                group_size=GROUP_SIZE,
                seed=i,
            )
        )
        records = [(t, e) for t, e in r.records if t != ROLLOUT_REQUESTS]  # the scheduler's own request stands
        if i == tampered:  # its second call's request held a turn the proxy never generated
            calls = [k for k, (t, _) in enumerate(records) if t == CALLS]
            k = calls[min(1, len(calls) - 1)]
            call = records[k][1]
            assert isinstance(call, CallEvent)
            records[k] = (CALLS, dataclasses.replace(call, tampered=True))
        produce(kafka, records)


def _until(what: str, ok: Callable[[], object], procs: list[Any], logs: Callable[[], str]) -> None:
    deadline = time.monotonic() + 150
    while not ok():
        for p in procs:
            alive = p.alive() if isinstance(p, Worker) else p.poll() is None
            assert alive, f"a process died waiting for {what}:\n{logs()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{logs()}"
        time.sleep(0.5)


def test_a_group_dropped_for_a_member_its_rewards_do_not_show_is_refilled_and_the_batch_forms(
    kafka_settings: KafkaSettings, tmp_path: Path, group_id: str
) -> None:
    kafka, app_id = kafka_settings, f"streams-{group_id}"
    worker = Worker(kafka, tmp_path, app_id=app_id, **STREAMS)
    log = tmp_path / "scheduler.log"
    logs = lambda: log.read_text(errors="replace")[-3000:] + "\n--- streams:\n" + worker.log_tail()  # noqa: E731
    worker.start()
    env = {"CLAWSTREAM_SCHEDULER_ZERO_VARIANCE": "drop", "CLAWSTREAM_SCHEDULER_DRAIN_TIMEOUT_S": "60"}
    proc = _start(kafka, log, steps=1, extra_env=env)
    try:
        reqs: list[RolloutRequest] = []

        def issued() -> bool:
            nonlocal reqs
            with contextlib.suppress(KafkaException):  # the topic is created by the first publish: no leader yet
                reqs = _requests(kafka)
            return len(reqs) >= TASKS_PER_STEP * GROUP_SIZE

        _until("the step's requests", issued, [proc, worker], logs)
        groups: dict[str, list[RolloutRequest]] = {}
        for r in reqs:
            groups.setdefault(r.group_id, []).append(r)
        clean, spoiled = sorted(groups.values(), key=lambda g: g[0].group_id)
        _settle(kafka, clean, [1.0, 0.0], tampered=None)
        _settle(kafka, spoiled, [1.0, 0.0], tampered=1)

        refills: list[RolloutRequest] = []

        def refilled() -> bool:
            nonlocal refills
            refills = [r for r in _requests(kafka) if REFILL_KEY in (r.metadata or {})]
            return len(refills) >= GROUP_SIZE

        _until("a refill of the group the grouper dropped", refilled, [proc, worker], logs)
        assert len({r.group_id for r in refills}) == 1 and len(refills) == GROUP_SIZE, refills
        assert {(r.harness, r.step) for r in refills} == {(spoiled[0].harness, 0)}
        trajectories = read_events(kafka, TRAJECTORIES, Trajectory)
        dropped = [t for t in trajectories if t.status is TrajectoryStatus.DROPPED]
        assert [t.group_id for t in dropped] == [spoiled[0].group_id], dropped  # the rewards alone said it trains

        _settle(kafka, refills, [1.0, 0.0], tampered=None)
        batched = lambda: read_events(kafka, BATCHES, BatchRecord)  # noqa: E731
        _until("the batch of 2 groups", lambda: any(e.kind is BatchRecordKind.SEAL for e in batched()), [worker], logs)
        trained = {e.group_id for e in batched() if e.kind is BatchRecordKind.TRAJECTORY}
        assert trained == {clean[0].group_id, refills[0].group_id}, trained
        assert proc.wait(120) == 0, logs()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        worker.stop()
    env_audit = {**os.environ, "CLAWSTREAM_STREAMS_APP_ID": app_id}
    cmd = [sys.executable, "-m", "clawstream", "audit", "--topic-prefix", kafka.topic_prefix]
    done = subprocess.run(  # noqa: S603 - our own command
        [*cmd, "--bootstrap", bootstrap_servers(kafka)], cwd=ROOT, env=env_audit, capture_output=True, timeout=120
    )
    out = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0 and "CLEAN" in out, out
