"""Exactly-once while the group moves (#28): a second streams worker joins mid-stream and leaves again, data flowing
through both rebalances; the first worker keeps some partitions each time.

Before the fix, Faust dropped the acknowledged offsets on revocation without committing them, and a partition the
worker got back was neither revoked nor newly assigned: its transaction stayed open, it was sought back to the last
commit and everything since was processed a second time into the same transaction, on top of tables that already
held the first pass (duplicated trajectories). Both rebalances are placed by the stream's state: the feeder holds at
two points; the second worker starts at the first, and the feeder resumes as soon as the group is seen rebalancing;
the second worker is stopped at the second, once both workers hold partitions, as the feeder resumes.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end
from clawbase.settings import KafkaSettings
from consumers.analytics.audit import read_run
from consumers.analytics.reconcile import reconcile
from schemas.events import BatchRecord, DeadLetter, Metric, Trajectory
from schemas.topics import BATCHES, DEADLETTER, METRICS, TRAJECTORIES
from streams.eos import EVICTED_EXIT
from tests.integration.test_streams import (
    HARNESSES,
    SETTINGS,
    check_batches,
    expected,
    late_after_infra_failure,
    late_duplicate,
)
from tests.integration.test_streams_scale_out import _members
from tests.support.fault_report import FaultRow, record, stall_after
from tests.support.stream_harness import Collector, Feeder, Worker
from tests.support.stream_load import interleave, make_groups

pytestmark = pytest.mark.integration


def _audit(kafka: KafkaSettings) -> None:
    """``clawstream audit``'s reconciliation of the run's topics: nothing lost, nothing doubled."""
    report = reconcile(read_run(kafka))
    assert report.clean, report.to_json()
    assert set(report.tally().values()) == {0}, report.tally()
    print(f"audit: {report.attempts} attempts, {report.settled} settled, {report.batched} batched: clean")


def _report(fault: str, published: int, counts: Counter[str], collector: Collector, fault_at: float) -> None:
    stall, recover = stall_after(fault_at, [o.at for o in collector.got[TRAJECTORIES]])
    unique = len(counts)
    record(
        FaultRow(
            fault, published, sum(counts.values()), published - unique, sum(counts.values()) - unique, stall, recover
        )
    )


def _every_group_closed_complete(
    kafka: KafkaSettings, app_id: str, collector: Collector, groups: list[list[Any]], dead: list[tuple[str, str]]
) -> None:
    """No fault reaches the rollouts here, so every group closes with all its members; a group closed by its timeout
    lost a member between the trajectories topic and the grouper: say where its missing members are."""
    closed = [Metric.from_bytes(o.value) for o in collector.got[METRICS]]
    short = {m.labels["group_id"]: m for m in closed if m.labels.get("closed_by") != "complete"}
    if not short:
        return
    consumer = make_consumer(kafka, f"diagnose-{app_id}")
    by_group = kafka.topic_prefix + app_id + "-by-group"
    try:
        ends = assign_from_beginning(consumer, by_group)
        seen = Counter(
            (msg.key() or b"").decode() + "/" + Trajectory.from_bytes(msg.value()).rollout_id
            for msg in read_to_end(consumer, by_group, ends)
        )
    finally:
        consumer.close()
    lines = []
    for members in groups:
        gid = members[0].group_id
        if gid in short:
            where = {r.rollout_id: seen.get(f"{gid}/{r.rollout_id}", 0) for r in members}
            lines.append(f"{gid}: {short[gid].labels} {short[gid].values}; in by-group: {where}")
    raise AssertionError("groups closed short:\n" + "\n".join(lines) + f"\ndead letters: {dead}")


def _until(what: str, done: object, workers: list[Worker], collector: Collector, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        for w in workers:
            assert w.alive(), f"a worker died while waiting for {what}:\n{w.log_tail()}"
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}: "
            + str({t: collector.count(t) for t in collector.got})
            + "\n"
            + "\n".join(w.log_tail() for w in workers)
        )
        collector.poll(0.3)


def test_a_worker_joining_and_leaving_mid_stream_changes_no_output(
    kafka_settings: KafkaSettings, group_id: str, tmp_path: Path
) -> None:
    groups = make_groups(12, HARNESSES, group_size=8, seed=5, faults=False)
    rollouts = [r for members in groups for r in members]
    records = interleave(rollouts, seed=5, window=24)
    joins_at, leaves_at = len(records) // 4, len(records) * 2 // 3
    exp = expected(groups, set())
    # The measurement used the default 0.2 s commit interval. Long settle and group timeouts: the feeder's
    # holds and the rebalances' pauses (a worker restoring its tables) must not settle rollouts early (no faults are
    # injected, every rollout completes). Session timeout 15 s: the eviction path is the zombie test's.
    settings = SETTINGS | {
        "commit_interval_s": 0.2,
        "settle_timeout_s": 60.0,
        "group_timeout_s": 90.0,
        "session_timeout_s": 15.0,
    }
    app_id = f"streams-{group_id}"
    group = kafka_settings.topic_prefix + app_id
    first, second = (Worker(kafka_settings, tmp_path / f"w{k}", app_id=app_id, **settings) for k in range(2))
    for k in range(2):
        (tmp_path / f"w{k}").mkdir()
    first.start()
    collector = Collector(kafka_settings, group_id)
    feeder = Feeder(kafka_settings, records, rate=60.0, hold_at=(joins_at, leaves_at))
    try:
        feeder.start()
        _until("the first trajectories", lambda: collector.count(TRAJECTORIES) >= 10, [first], collector, 90)
        assert feeder.holding.wait(60), "the feeder never reached its first hold point"
        second.start()
        # Resume the data as the group starts rebalancing: the join happens while records flow.
        _until(
            "the second worker to join",
            lambda: len(_members(kafka_settings, group)) != 1,
            [first, second],
            collector,
            90,
        )
        feeder.release()
        both = {}

        def both_hold_partitions() -> bool:
            nonlocal both
            both = _members(kafka_settings, group)
            return len(both) == 2 and all(both.values())

        _until("both workers to hold partitions", both_hold_partitions, [first, second], collector, 120)
        assert sorted(p for ps in both.values() for p in ps) == list(range(8)), both
        joined = collector.count(TRAJECTORIES)
        # The second worker restores its half and works on it (its rollouts' trajectories come out only from it).
        _until(
            "more trajectories with both workers",
            lambda: collector.count(TRAJECTORIES) >= joined + 20,
            [first, second],
            collector,
            120,
        )
        assert feeder.holding.wait(60), "the feeder never reached its second hold point"
        before_leave = collector.count(TRAJECTORIES)
        feeder.release()  # the leave happens while records flow
        left_at = time.monotonic()
        second.stop()
        _until(
            "every trajectory after the leave",
            lambda: collector.count(TRAJECTORIES) >= len(rollouts) and collector.count(METRICS) >= len(groups),
            [first],
            collector,
            180,
        )
        feeder.join()
        collector.poll(5.0)  # a duplicate would arrive by now (commit interval ≪ 5 s)
    finally:
        feeder.release(all_holds=True)
        collector.close()
        for w in (second, first):
            w.stop()
        feeder.join()
    assert before_leave < len(rollouts), "everything was out before the leave: nothing moved"
    got = [Trajectory.from_bytes(o.value) for o in collector.got[TRAJECTORIES]]
    counts = Counter(t.rollout_id for t in got)
    _report("a second worker leaves mid-stream (join before it)", len(rollouts), counts, collector, left_at)
    assert set(counts) == {r.rollout_id for r in rollouts}, "lost trajectories"
    assert max(counts.values()) == 1, f"duplicated: {sorted(k for k, n in counts.items() if n > 1)}"
    want = {r.rollout_id: r for r in rollouts}
    wrong = [
        (t.rollout_id, want[t.rollout_id].fault, t.status.value, t.drop_reason)
        for t in got
        if (t.status, t.reward) != (want[t.rollout_id].expected_status, want[t.rollout_id].expected_reward)
    ]
    assert not wrong, wrong
    metrics = Counter(Metric.from_bytes(o.value).labels["group_id"] for o in collector.got[METRICS])
    assert set(metrics) == {m[0].group_id for m in groups} and max(metrics.values()) == 1, metrics
    check_batches([BatchRecord.from_bytes(o.value) for o in collector.got[BATCHES]], exp)
    dead = [DeadLetter.from_bytes(o.value) for o in collector.got[DEADLETTER]]
    assert all(late_duplicate(d, want) or late_after_infra_failure(d, want) for d in dead), [
        (d.rollout_id, d.reason) for d in dead
    ]
    _every_group_closed_complete(kafka_settings, app_id, collector, groups, [(d.rollout_id, d.reason) for d in dead])
    _audit(kafka_settings)


def test_a_zombie_worker_is_fenced(kafka_settings: KafkaSettings, group_id: str, tmp_path: Path) -> None:
    """SIGSTOP one of two workers while records flow, past its session timeout: the group hands its partitions to
    the other, which re-initialises their transactional ids. SIGCONT it: whatever it still had open or sends late
    is fenced and it exits at once with ``EVICTED_EXIT`` (a dirty close: its supervisor restarts it with tables rebuilt
    from the changelogs), and the outputs hold each trajectory, group and batch once. Before the exit was immediate,
    the zombie rejoined while Faust's crash was under way, got its old partitions back as "kept" (stale tables),
    processed and committed on them, and a group lost a member (closed by timeout, 7/8)."""
    groups = make_groups(12, HARNESSES, group_size=8, seed=6, faults=False)
    rollouts = [r for members in groups for r in members]
    records = interleave(rollouts, seed=6, window=24)
    exp = expected(groups, set())
    settings = SETTINGS | {
        "commit_interval_s": 0.2,
        "settle_timeout_s": 60.0,
        "group_timeout_s": 90.0,
        "session_timeout_s": 10.0,
    }
    app_id = f"streams-{group_id}"
    group = kafka_settings.topic_prefix + app_id
    live, zombie = (Worker(kafka_settings, tmp_path / f"w{k}", app_id=app_id, **settings) for k in range(2))
    for k in range(2):
        (tmp_path / f"w{k}").mkdir()
    collector = Collector(kafka_settings, group_id)
    feeder = Feeder(kafka_settings, records, rate=40.0, hold_at=len(records) // 3)
    members: dict[str, set[int]] = {}

    def held_by(n: int) -> bool:
        nonlocal members
        members = _members(kafka_settings, group)
        return len(members) == n and all(members.values())

    try:
        # One after the other: a worker still restoring when the other joined missed its heartbeats on a loaded
        # machine and was evicted (it then closes dirty, as a zombie does).
        live.start()
        _until("the first worker to hold every partition", lambda: held_by(1), [live], collector, 120)
        zombie.start()
        _until("both workers to hold partitions", lambda: held_by(2), [live, zombie], collector, 120)
        feeder.start()
        _until(
            "trajectories from both workers",
            lambda: collector.count(TRAJECTORIES) >= 20,
            [live, zombie],
            collector,
            120,
        )
        assert feeder.holding.wait(60), "the feeder never reached its hold point"
        feeder.release()
        zombie.pause()  # while records flow, some of them in its open transactions
        paused = time.monotonic()
        paused_at = collector.count(TRAJECTORIES)
        _until("the live worker to take every partition", lambda: held_by(1), [live], collector, 120)
        assert sorted(next(iter(members.values()))) == list(range(8)), members
        taken_over = collector.count(TRAJECTORIES)
        _until(
            "more trajectories from the live worker alone",
            lambda: collector.count(TRAJECTORIES) >= taken_over + 10,
            [live],
            collector,
            120,
        )
        zombie.resume()
        _until("the zombie to close (crash)", lambda: not zombie.alive(), [live], collector, 60)
        _until(
            "every trajectory",
            lambda: collector.count(TRAJECTORIES) >= len(rollouts) and collector.count(METRICS) >= len(groups),
            [live],
            collector,
            180,
        )
        feeder.join()
        collector.poll(5.0)
    finally:
        feeder.release(all_holds=True)
        collector.close()
        for w in (zombie, live):
            w.stop()
        feeder.join()
    log = zombie.log_tail(1_000_000)
    assert paused_at < taken_over < len(rollouts), (paused_at, taken_over)  # it was paused while records flowed
    assert "ProducerFenced" in log or "evicted from the consumer group while alive" in log, log[-3000:]
    assert zombie.proc is not None and zombie.proc.returncode == EVICTED_EXIT, zombie.proc.returncode
    got = [Trajectory.from_bytes(o.value) for o in collector.got[TRAJECTORIES]]
    counts = Counter(t.rollout_id for t in got)
    _report("a zombie: SIGSTOP past the session timeout, SIGCONT", len(rollouts), counts, collector, paused)
    assert set(counts) == {r.rollout_id for r in rollouts}, "lost trajectories"
    assert max(counts.values()) == 1, f"duplicated: {sorted(k for k, n in counts.items() if n > 1)}"
    want = {r.rollout_id: r for r in rollouts}
    wrong = [
        (t.rollout_id, t.status.value, t.drop_reason, t.reward, want[t.rollout_id].expected_reward)
        for t in got
        if (t.status, t.reward) != (want[t.rollout_id].expected_status, want[t.rollout_id].expected_reward)
    ]
    dead = [(d.rollout_id, d.reason) for d in (DeadLetter.from_bytes(o.value) for o in collector.got[DEADLETTER])]
    assert not wrong, (wrong, dead)
    metrics = Counter(Metric.from_bytes(o.value).labels["group_id"] for o in collector.got[METRICS])
    assert set(metrics) == {m[0].group_id for m in groups} and max(metrics.values()) == 1, metrics
    _every_group_closed_complete(kafka_settings, app_id, collector, groups, dead)
    check_batches([BatchRecord.from_bytes(o.value) for o in collector.got[BATCHES]], exp)
    _audit(kafka_settings)
