"""Every service of one running training stack killed -9 and restarted, one after another, while rollouts run; then
one audit of the whole run: nothing lost, nothing doubled, no batch trained twice, every step trained.

The stack is the demo's (``clawstream.stack.services``: CPU engine with its weight follower, serving proxy, sandbox
worker, streams, learner, scheduler), each a real process on the session's broker, from the shipped warm start.
Each fault is placed by the run's own state, read from its topics or reached at a fault point armed when that state
is there (``clawbase.faults``, ``NAME@armed=hold``): never by a sleep. The kill is a SIGKILL of the service's whole
process group (its container, harnesses included); the test then starts it again as a supervisor would, with the
same arguments and ports. Order and placement:

- streams: version 1 is out and attempts are running (their calls assembled, not yet settled);
- sandbox worker: version 2 is out, attempts running (their harnesses die with it; the request is re-run);
- proxy: version 3 is out, attempts running (their registrations are lost: infrastructure failures, re-issued);
- engine: version 4 is out, held inside a completion call (``engine.in_call``): the proxy retries the call;
- learner: held between saving a version and publishing it (``learner.after_save``);
- scheduler: held right after publishing a step's requests (``scheduler.after_publish``): it resumes from the log.

A row per fault goes to the fault matrix (``tests/support/fault_report.py``): rewards published, lost and doubled
by the audit, and the longest gap between rewards after the fault.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from clawbase import faults
from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from clawstream.demo.config import HARNESS_MIX
from clawstream.local_kafka import LocalKafka
from clawstream.stack.process import Service, Stack
from clawstream.stack.services import stack_for, start_learner, start_rollout_side, start_scheduler, start_streams
from consumers.analytics.audit import format_report, read_run
from consumers.analytics.reconcile import AuditReport, reconcile
from schemas.topics import CATALOG
from tests.support.fault_report import FaultRow, record, stall_after
from tests.support.run_watch import RunWatch
from warmstart import sft

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

STEPS = 10
TASKS_PER_STEP, GROUP_SIZE = 2, 4
ARMED = ("engine.in_call", "learner.after_save", "scheduler.after_publish")
WAIT_S = 240.0


@dataclass(frozen=True)
class Kill:
    service: str
    after_version: int  # the run has published at least this version
    point: str | None = None  # armed once the version is out; the kill when a process holds there


KILLS = (
    Kill("streams", 1),
    Kill("sandbox-worker", 2),
    Kill("proxy", 3),
    Kill("engine", 4, "engine.in_call"),
    Kill("learner", 5, "learner.after_save"),
    Kill("scheduler", 6, "scheduler.after_publish"),
)


def _service(stack: Stack, name: str) -> Service:
    return next(s for s in stack.services if s.name == name)


def _start(stack: Stack, model: Path, run_dir: Path, steps: int = STEPS) -> None:
    start_rollout_side(stack, model, concurrency=4, torch_threads=1)
    start_streams(
        stack,
        run_dir,
        group_size=GROUP_SIZE,
        batch_groups=TASKS_PER_STEP,
        settle_interval_s=0.0,
        harness_mix=HARNESS_MIX,
        zero_variance="keep",  # every group of every step is followed into a batch
    )
    start_learner(stack, model, run_dir, {"lr": 2e-5, "seed": 0}, torch_threads=1)
    start_scheduler(
        stack,
        steps,
        {
            "tasks_per_step": TASKS_PER_STEP,
            "group_size": GROUP_SIZE,
            "harness_mix": HARNESS_MIX,
            "max_tokens": 128,
            "max_policy_lag": 1,
            "zero_variance": "keep",
            "drain_timeout_s": 600,
        },
    )


def _short_sessions(stack: Stack) -> None:
    # a killed member's partitions move after its session: keep that short (the lease below it)
    stack.env.update(
        {
            "CLAWSTREAM_SANDBOX_SESSION_TIMEOUT_MS": "10000",
            "CLAWSTREAM_SANDBOX_PROXY_LEASE_S": "6",
            "CLAWSTREAM_STREAMS_SESSION_TIMEOUT_S": "10",
        }
    )


def _no_token_on_a_command_line(stack: Stack) -> None:
    """The proxy's admin token reaches proxy and worker by environment: /proc/PID/cmdline is world-readable."""
    token = next(s for s in stack.services if s.name == "proxy").env["CLAWSTREAM_PROXY_ADMIN_TOKEN"]
    holders = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in path.read_bytes():
                holders.append(path.parent.name)
        except OSError:  # the process ended meanwhile
            continue
    assert not holders, f"the admin token is on the command line of pid(s) {holders}"


def _kill_and_restart(stack: Stack, watch: RunWatch, kill: Kill, fault_dir: Path) -> float:
    """Wait for the kill's state, SIGKILL the service's process group, start it again; returns the kill's time."""
    service = _service(stack, kill.service)
    watch.wait_for(
        f"version {kill.after_version} out and attempts running before killing {kill.service}",
        lambda w: w.version >= kill.after_version and (kill.point is not None or bool(w.running)),
        WAIT_S,
        stack.check,
    )
    if kill.point is not None:
        faults.arm(fault_dir, kill.point)
        faults.wait_held(fault_dir, kill.point, timeout=WAIT_S, alive=service.proc)
    running = len(watch.running)
    at = time.monotonic()
    code = stack.kill(service)
    print(f"killed {kill.service} (exit {code}) at version {watch.version}, {running} attempts running", flush=True)
    stack.restart(service, timeout=WAIT_S)
    print(f"restarted {kill.service} in {time.monotonic() - at:.1f} s", flush=True)
    return at


@pytest.mark.timeout(1500)
def test_every_service_killed_and_restarted_in_one_stack(kafka_settings: KafkaSettings, tmp_path: Path) -> None:
    model, why = sft.shipped_warm_start()
    assert model is not None, why
    fault_dir = tmp_path / "faults"
    stack = stack_for(kafka_settings, tmp_path / "logs")
    stack.env.update(faults.fault_env(fault_dir, **{f"{point}@armed": "hold" for point in ARMED}))
    _short_sessions(stack)
    watch = RunWatch(kafka_settings)
    killed_at: dict[str, float] = {}
    try:
        _start(stack, model, tmp_path / "run")
        _no_token_on_a_command_line(stack)
        for kill in KILLS:
            killed_at[kill.service] = _kill_and_restart(stack, watch, kill, fault_dir)
        watch.wait_for(f"version {STEPS} out", lambda w: w.version >= STEPS, WAIT_S * 2, stack.check)
        scheduler = _service(stack, "scheduler")
        assert scheduler.proc is not None and scheduler.proc.wait(WAIT_S) == 0
    finally:
        watch.close()
        stack.stop()
    report = reconcile(read_run(kafka_settings))
    text = format_report(report, kafka_settings.topic_prefix)
    print(text)
    assert report.clean, text
    assert report.versions == STEPS and report.batches_trained == STEPS, text
    assert sorted(watch.versions) == list(range(1, STEPS + 1)), watch.versions  # each version published once
    for kill in KILLS:
        how = f"held at {kill.point}" if kill.point else "attempts running"
        _record(f"{kill.service} killed -9 in a running stack", killed_at[kill.service], report, watch, how)


def _record(fault: str, at: float, report: AuditReport, watch: RunWatch, note: str) -> None:
    """A row of the fault matrix: attempts started, rewards read, lost and doubled by the audit, reward stall."""
    tally = report.tally()
    gap, recover = stall_after(at, watch.reward_times)
    dup = tally["duplicated"] + tally["trained twice"]
    record(
        FaultRow(
            fault, report.attempts, len(watch.rewarded), tally["lost"], dup, round(gap, 1), round(recover, 1), note
        )
    )


BROKER_STEPS = 6


@pytest.mark.timeout(1200)
@pytest.mark.skipif(
    os.environ.get("CLAWSTREAM_FAULT_MATRIX") != "1",
    reason="in the full fault matrix only (make test-faults sets CLAWSTREAM_FAULT_MATRIX=1): `make test` runs one "
    "fault of each kind, and broker loss there is the 3-broker cluster's (tests/integration/test_kafka_cluster.py)",
)
def test_the_single_broker_stopped_and_restarted_mid_run(tmp_path: Path) -> None:
    """The local default (one broker, replication 1) stopped while rollouts run and started again on its data dir
    and port: every service rides it out or dies and is started again by the stack's supervisor (``Stack.check``,
    as compose's restart policy); the run trains every step and the audit is clean."""
    model, why = sft.shipped_warm_start()
    assert model is not None, why
    broker = LocalKafka(home=tmp_path / "kafka-home")
    kafka = KafkaSettings(bootstrap_servers=broker.up(timeout=120, quiet=True).bootstrap, topic_prefix="outage.")
    stack = watch = None
    try:
        create_topics(kafka, CATALOG)
        stack = stack_for(kafka, tmp_path / "logs")
        _short_sessions(stack)
        watch = RunWatch(kafka)
        _start(stack, model, tmp_path / "run", steps=BROKER_STEPS)
        watch.wait_for(
            "version 2 out and attempts running", lambda w: w.version >= 2 and bool(w.running), WAIT_S, stack.check
        )
        running, at = len(watch.running), time.monotonic()
        assert broker.down()
        down_s = time.monotonic() - at
        broker.up(timeout=120, quiet=True)
        print(
            f"broker stopped ({down_s:.1f} s, {running} attempts running), up after {time.monotonic() - at:.1f} s",
            flush=True,
        )
        watch.wait_for(f"version {BROKER_STEPS} out", lambda w: w.version >= BROKER_STEPS, WAIT_S * 2, stack.check)
        scheduler = _service(stack, "scheduler")
        assert scheduler.proc is not None and scheduler.proc.wait(WAIT_S) == 0
        restarts = {sv.name: sv.restarts for sv in stack.services if sv.restarts}
    finally:
        if watch is not None:
            watch.close()
        if stack is not None:
            stack.stop()
    try:
        report = reconcile(read_run(kafka))
    finally:
        broker.down()
    text = format_report(report, kafka.topic_prefix)
    print(text, f"\nrestarted by the supervisor: {restarts or 'none'}")
    assert report.clean, text
    assert report.versions == BROKER_STEPS and report.batches_trained == BROKER_STEPS, text
    note = f"after v2, {running} attempts running; restarted by the supervisor: {restarts or 'none'}"
    _record("the single broker stopped and restarted in a running stack", at, report, watch, note)
