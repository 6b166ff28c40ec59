"""The streams worker on the real broker: synthetic rollouts in → trajectories, GRPO groups and mixed batches out.

Records of 200+ rollouts across two harnesses are published interleaved, with duplicates, late and missing records,
infrastructure failures, an absent rollout, an undecodable record and a stale group; the outputs are read with
``isolation.level=read_committed`` and compared with what the synthetic data says they must be (advantages are
recomputed here from the rewards, not with streams.group). The fault test SIGKILLs the worker mid-stream and checks
that the restarted worker's output has no lost and no duplicated trajectory, group or batch record.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from clawbase.settings import KafkaSettings
from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    DeadLetter,
    Metric,
    Trajectory,
    TrajectoryStatus,
    WeightVersion,
)
from schemas.topics import BATCHES, CALLS, DEADLETTER, METRICS, TRAJECTORIES, WEIGHTS
from tests.support.fault_report import FaultRow, record, stall_after
from tests.support.stream_harness import Collector, Feeder, Worker, produce, produce_raw
from tests.support.stream_load import SynthRollout, build, interleave, make_groups

pytestmark = pytest.mark.integration
HARNESSES = ("claude-code", "openclaw")
SETTINGS = {
    "store": "memory://",
    "settle_interval_s": 1.0,
    "settle_timeout_s": 6.0,
    "group_timeout_s": 20.0,
    "tick_interval_s": 0.5,
    "commit_interval_s": 1.0,
    "session_timeout_s": 6.0,
    "group_size": 8,
    "batch_groups": 4,
    "harness_mix": {"claude-code": 0.5, "openclaw": 0.5},
    "max_policy_lag": 1,
    "mix_seed": 11,
}
EPS = 1e-6


@dataclass
class Expected:
    advantages: dict[str, float]  # trained rollout → advantage
    groups: dict[str, set[str]]  # batchable group → its trained rollouts
    dropped_zero_variance: set[str]


def expected(groups: list[list[SynthRollout]], absent: set[str]) -> Expected:
    """GRPO by hand: population σ over the rollouts with a reward; all-equal rewards → dropped."""
    adv: dict[str, float] = {}
    batchable: dict[str, set[str]] = {}
    zero: set[str] = set()
    for members in groups:
        present = [r for r in members if r.rollout_id not in absent]
        rewards = [r.expected_reward for r in present if r.expected_reward is not None]
        if not rewards:
            continue
        if max(rewards) == min(rewards):
            zero.add(members[0].group_id)
            continue
        mu = sum(rewards) / len(rewards)
        sigma = math.sqrt(sum((x - mu) ** 2 for x in rewards) / len(rewards))
        trained = {r.rollout_id for r in present if r.trainable and r.expected_reward is not None}
        for r in present:
            if r.rollout_id in trained:
                adv[r.rollout_id] = (r.expected_reward - mu) / (sigma + EPS)  # type: ignore[operator]
        if trained:
            batchable[members[0].group_id] = trained
    return Expected(adv, batchable, zero)


def late_duplicate(d: DeadLetter, want: dict[str, SynthRollout]) -> bool:
    """A producer's duplicate (fault "dup") that arrived after its rollout settled: dead-lettered by design."""
    r = want.get(d.rollout_id or "")
    return d.error_type == "late" and r is not None and r.fault == "dup" and "settled as" in d.reason


def late_after_infra_failure(d: DeadLetter, want: dict[str, SynthRollout]) -> bool:
    """A record of a rollout that failed for infrastructure, processed after the failure settled it: by design.

    An infrastructure failure settles at once, without waiting for the rest (streams.assemble); the worker reads
    calls, lifecycle events and rewards from different topics, so with a backlog (after a restart) the failing
    reward or FAILED event can be processed before the rollout's calls, which then arrive late. Nothing is trained
    on such a rollout either way."""
    r = want.get(d.rollout_id or "")
    return (
        d.error_type == "late"
        and r is not None
        and r.expected_status is TrajectoryStatus.INFRA_FAILURE
        and "settled as INFRA_FAILURE" in d.reason
    )


def wait_for(collector: Collector, worker: Worker, done: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert worker.alive(), f"worker died while waiting for {what}:\n{worker.log_tail()}"
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what}; got "
            + str({t: collector.count(t) for t in collector.got})
            + f"\n{worker.log_tail()}"
        )
        collector.poll(0.5)


def check_batches(records: list[BatchRecord], exp: Expected) -> dict[str, list[BatchRecord]]:
    """Every batch: TRAJECTORY records with the expected advantages, whole groups, then a SEAL that adds up."""
    batches: dict[str, list[BatchRecord]] = {}
    for rec in records:
        batches.setdefault(rec.batch_id, []).append(rec)
    seen: Counter[str] = Counter()
    for batch_id, recs in batches.items():
        *trajs, seal = recs
        assert seal.kind is BatchRecordKind.SEAL and all(r.kind is BatchRecordKind.TRAJECTORY for r in trajs), batch_id
        assert [r.index for r in trajs] == list(range(len(trajs))) and seal.index == len(trajs)
        assert seal.harness_counts == dict(Counter(r.harness for r in trajs))
        groups = {r.group_id for r in trajs}
        assert len(groups) == SETTINGS["batch_groups"], (batch_id, groups)
        for gid in groups:
            assert {r.rollout_id for r in trajs if r.group_id == gid} == exp.groups[gid], gid  # whole groups only
        for r in trajs:
            assert r.rollout_id is not None and r.trajectory is not None
            assert r.advantage == pytest.approx(exp.advantages[r.rollout_id], abs=1e-9), r.rollout_id
            t = Trajectory.from_bytes(r.trajectory)
            assert t.rollout_id == r.rollout_id and t.status in (TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT)
            assert t.reward == r.reward and t.segments
            seen[r.rollout_id] += 1
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1]
    return batches


def test_streams_end_to_end(kafka_settings: KafkaSettings, group_id: str, tmp_path: Path) -> None:
    t_start = time.monotonic()
    groups = make_groups(26, HARNESSES, group_size=8, seed=5)
    for members in groups[24:]:  # these two groups do not announce their size: the setting (8) applies
        for r in members:
            r.group_size = None
            build(r)
    stale = groups[3]  # served by an old policy: 2 versions behind the newest weights, bound 1 → dropped
    for members in groups:
        for r in members:
            r.policy_version = 1 if members is stale else 3
            build(r)
    absent = {groups[2][5].rollout_id}  # never produces anything: its group can only close at the timeout
    rollouts = [r for members in groups for r in members]
    exp = expected(groups, absent)
    assert stale[0].group_id in exp.groups and len(exp.groups) >= 16  # the data exercises what it should
    faults = Counter(r.fault for r in rollouts)
    kinds_needed = ("dup", "infra", "infra_reward", "missing_call", "missing_reward", "late")
    assert all(faults[f] >= 2 for f in kinds_needed), faults

    produce(
        kafka_settings,
        [
            (
                WEIGHTS,
                WeightVersion(
                    policy_version=3,
                    timestamp_ms=0,
                    model_name="policy",
                    step=3,
                    uri="file:///w/v3.safetensors",
                    sha256="0" * 64,
                ),
            )
        ],
    )
    sent = produce(kafka_settings, interleave([r for r in rollouts if r.rollout_id not in absent], seed=5))
    produce_raw(kafka_settings, CALLS, b"r-garbage", b"\x00not avro")
    worker = Worker(kafka_settings, tmp_path, app_id=f"streams-{group_id}", **SETTINGS)
    worker.start()
    collector = Collector(kafka_settings, group_id)
    late = [r for r in rollouts if r.late_records and r.rollout_id not in absent]
    want = {r.rollout_id: r for r in rollouts if r.rollout_id not in absent}
    try:

        def trajectories() -> dict[str, Trajectory]:
            return {t.rollout_id: t for t in (Trajectory.from_bytes(o.value) for o in collector.got[TRAJECTORIES])}

        wait_for(collector, worker, lambda: {r.rollout_id for r in late} <= set(trajectories()), 120, "late rollouts")
        produce(kafka_settings, [rec for r in late for rec in r.late_records])
        n_dead = 2 * len(late) + 2  # late call + late reward per late rollout, the garbage record, the stale group
        wait_for(
            collector,
            worker,
            lambda: (
                collector.count(TRAJECTORIES) >= len(want)
                and collector.count(METRICS) >= len(groups)
                and collector.count(DEADLETTER) >= n_dead
            ),
            150,
            "all trajectories, group metrics and dead letters",
        )
        collector.poll(4.0)  # anything extra (a duplicate, a second batch of the same groups) would show up now
    finally:
        collector.close()
        worker.stop()
    elapsed = time.monotonic() - t_start

    # Trajectories: exactly one per rollout that produced records, with the status and reward the faults imply.
    got = [Trajectory.from_bytes(o.value) for o in collector.got[TRAJECTORIES]]
    counts = Counter(t.rollout_id for t in got)
    assert set(counts) == set(want) and max(counts.values()) == 1, [k for k, n in counts.items() if n > 1]
    for t in got:
        r = want[t.rollout_id]
        assert (t.status, t.reward) == (r.expected_status, r.expected_reward), (r.fault, t.drop_reason)
        assert (t.group_id, t.harness, t.step, t.task_id) == (r.group_id, r.harness, r.step, r.task_id)
        assert bool(t.segments) == r.trainable
        if r.fault == "missing_call":
            assert t.drop_reason is not None and "calls received" in t.drop_reason
    assert Counter(t.status for t in got)[TrajectoryStatus.INFRA_FAILURE] == faults["infra"] + faults["infra_reward"]

    # Dead letters: the late records, the undecodable one and the stale group — and, when a producer's duplicate
    # happened to arrive after its rollout settled, that duplicate (a "dup" rollout): nothing else.
    dead = [DeadLetter.from_bytes(o.value) for o in collector.got[DEADLETTER]]
    late_ids = {r.rollout_id for r in late}
    late_dl = [d for d in dead if d.error_type == "late" and d.rollout_id in late_ids]
    assert Counter(d.rollout_id for d in late_dl) == {rid: 2 for rid in late_ids}
    assert all("settled as COMPLETE" in d.reason for d in late_dl)
    others = [d for d in dead if d not in late_dl and not late_duplicate(d, want)]
    kinds = Counter(d.error_type for d in others)
    assert kinds["StaleGroup"] == 1 and len(others) == 2, [(d.error_type, d.reason) for d in others]
    [garbage] = [d for d in others if d.error_type != "StaleGroup"]
    assert garbage.original_value == b"\x00not avro" and garbage.original_topic == kafka_settings.topic(CALLS)
    [stale_dl] = [d for d in others if d.error_type == "StaleGroup"]
    assert stale[0].group_id in stale_dl.reason and "newest 3, lag bound 1" in stale_dl.reason

    # Groups: one metric per group; the absent rollout's group closed at the timeout, the others when complete.
    metrics = [Metric.from_bytes(o.value) for o in collector.got[METRICS]]
    by_group = {m.labels["group_id"]: m for m in metrics}
    assert len(metrics) == len(by_group) == len(groups)
    assert by_group[groups[2][0].group_id].labels["closed_by"] == "timeout"
    assert Counter(m.labels["closed_by"] for m in metrics) == {"complete": len(groups) - 1, "timeout": 1}
    zero = {g for g, m in by_group.items() if m.labels["outcome"] == "zero_variance_dropped"}
    assert zero == exp.dropped_zero_variance
    assert groups[0][0].group_id in exp.dropped_zero_variance

    # Batches: advantages as computed here, infra failures absent, whole groups, both harnesses in every batch.
    records = [BatchRecord.from_bytes(o.value) for o in collector.got[BATCHES]]
    batches = check_batches(records, exp)
    infra = {r.rollout_id for r in rollouts if r.expected_status is TrajectoryStatus.INFRA_FAILURE}
    assert not infra & {r.rollout_id for r in records}
    batched = {r.group_id for r in records if r.kind is BatchRecordKind.TRAJECTORY}
    eligible = set(exp.groups) - {stale[0].group_id}
    assert batched <= eligible and len(eligible - batched) < 2 * SETTINGS["batch_groups"]  # the rest waits for a mix
    assert len(batches) >= 3
    for recs in batches.values():
        assert set(recs[-1].harness_counts) == set(HARNESSES), recs[-1].harness_counts
    print(
        f"\n{sent} records, {len(got)} trajectories, {len(batches)} batches, {len(dead)} dead letters "
        f"in {elapsed:.0f} s"
    )


@pytest.mark.parametrize("store", ["memory://", "rocksdb://"])
def test_worker_killed_mid_stream_recovers_exactly_once(
    kafka_settings: KafkaSettings, group_id: str, tmp_path: Path, store: str
) -> None:
    """SIGKILL the worker once trajectories are committed and more are in flight, restart it: nothing lost or doubled.

    The kill is placed by the stream's state, not by time: the feeder publishes the first part of the records and
    holds the rest; the worker is killed as soon as ``KILL_AFTER`` trajectories are committed (read_committed) and
    while rollouts of the first part are still unsettled. A commit every 0.1 s makes commits overlap processing as
    often as possible: a record processed while its partition's transaction commits must not get its outputs into
    that transaction without its offset and table writes (before the fix, the replay re-settled such rollouts and
    emitted a second trajectory).
    """
    groups = make_groups(12, HARNESSES, group_size=8, seed=9)
    rollouts = [r for members in groups for r in members]
    records = interleave(rollouts, seed=9, window=24)  # 24 sandboxes at a time
    hold_at = len(records) * 11 // 20
    first_part = {e.rollout_id for _, e in records[:hold_at]}  # type: ignore[attr-defined]
    complete_in_first = first_part - {e.rollout_id for _, e in records[hold_at:]}  # type: ignore[attr-defined]
    kill_after = 15
    assert len(complete_in_first) >= 2 * kill_after  # the kill finds rollouts still to settle in the first part
    exp = expected(groups, set())
    # No rollout is absent here, so groups close when complete; a long group timeout keeps the restart's pause
    # (session timeout + recovery) from closing groups early.
    # Session timeout 15 s, not the 6 s minimum: on a loaded 2-core machine the worker's event loop stalled for
    # seconds, its heartbeats lapsed and the broker evicted the *live* worker (1 run in ~20); an evicted worker is
    # fenced and crashes (test_streams_rebalance.py's zombie), which is not what this test is about.
    settings = SETTINGS | {"store": store, "group_timeout_s": 90.0, "commit_interval_s": 0.1, "session_timeout_s": 15.0}
    worker = Worker(kafka_settings, tmp_path, app_id=f"streams-{group_id}", **settings)
    worker.start()
    collector = Collector(kafka_settings, group_id)
    feeder = Feeder(kafka_settings, records, rate=60.0, hold_at=hold_at)
    try:
        feeder.start()
        wait_for(collector, worker, lambda: collector.count(TRAJECTORIES) >= kill_after, 90, "the first trajectories")
        killed_at = time.monotonic()
        worker.kill()
        before = collector.count(TRAJECTORIES)
        assert feeder.holding.wait(60), "the feeder never reached its hold point"
        worker.start()
        feeder.release()
        feeder.join()
        wait_for(
            collector,
            worker,
            lambda: collector.count(TRAJECTORIES) >= len(rollouts) and collector.count(METRICS) >= len(groups),
            150,
            "every trajectory after the restart",
        )
        collector.poll(5.0)
    finally:
        feeder.release()
        collector.close()
        worker.stop()
        feeder.join()
    assert kill_after <= before < len(complete_in_first)  # killed with first-part rollouts still unsettled
    got = [Trajectory.from_bytes(o.value) for o in collector.got[TRAJECTORIES]]
    counts = Counter(t.rollout_id for t in got)
    stall, recover = stall_after(killed_at, [o.at for o in collector.got[TRAJECTORIES]])
    unique, total = len(counts), sum(counts.values())
    fault = f"streams worker SIGKILLed mid-stream, restarted ({store})"
    record(FaultRow(fault, len(rollouts), total, len(rollouts) - unique, total - unique, stall, recover))
    assert set(counts) == {r.rollout_id for r in rollouts}, "lost trajectories"
    assert max(counts.values()) == 1, f"duplicated: {[k for k, n in counts.items() if n > 1]}"
    want = {r.rollout_id: r for r in rollouts}
    wrong = [
        (t.rollout_id, want[t.rollout_id].fault, t.status.value, t.drop_reason)
        for t in got
        if (t.status, t.reward) != (want[t.rollout_id].expected_status, want[t.rollout_id].expected_reward)
    ]
    assert not wrong, wrong
    metrics = Counter(Metric.from_bytes(o.value).labels["group_id"] for o in collector.got[METRICS])
    assert set(metrics) == {m[0].group_id for m in groups} and max(metrics.values()) == 1
    check_batches([BatchRecord.from_bytes(o.value) for o in collector.got[BATCHES]], exp)
    dead = [DeadLetter.from_bytes(o.value) for o in collector.got[DEADLETTER]]
    # Only the injected duplicates (and records of infrastructure failures, which settle at once) may be
    # dead-lettered. A record replayed after the restart never finds its rollout settled: a partition's table
    # writes, outputs and input offsets commit together, between two records.
    assert all(late_duplicate(d, want) or late_after_infra_failure(d, want) for d in dead), [
        (d.rollout_id, d.reason) for d in dead
    ]
    if store == "rocksdb://":
        assert "wiping local tables" in worker.log_tail(100_000)  # the killed run left no clean-shutdown marker
