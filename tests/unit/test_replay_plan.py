"""Replay planning without a broker: bounds, ranges, whole batches, pacing, the summary."""

from __future__ import annotations

import pytest

from clawbase.errors import ConfigError
from consumers.analytics.replay_plan import (
    ALL,
    Entry,
    Pacer,
    PartitionCopy,
    PartitionRange,
    TopicCopy,
    partition_ranges,
    plan_batches,
    resolve_topic,
    summary_text,
)
from schemas.topics import BATCHES, TRAJECTORIES


def test_topics_by_full_or_short_name_and_a_clear_error_otherwise() -> None:
    assert resolve_topic("batches").name == BATCHES
    assert resolve_topic("clawstream.trajectories").name == TRAJECTORIES
    assert resolve_topic("rollout.events").name == "clawstream.rollout.events"
    with pytest.raises(ConfigError, match="not a catalog topic; one of: rollout.requests"):
        resolve_topic("batch")


def test_ranges_intersect_watermarks_offsets_and_times() -> None:
    marks = {0: (5, 100), 1: (0, 40), 2: (0, 0)}
    assert partition_ranges(marks, {}, {}) == [
        PartitionRange(0, 5, 100),
        PartitionRange(1, 0, 40),
        PartitionRange(2, 0, 0),
    ]
    got = partition_ranges(marks, {ALL: 10, 1: 2}, {0: 50}, since={0: 20, 1: 0, 2: 0}, until={0: 90, 1: 30, 2: 0})
    assert got == [PartitionRange(0, 20, 50), PartitionRange(1, 2, 30), PartitionRange(2, 10, 10)]
    assert partition_ranges({0: (0, 10)}, {ALL: 8}, {ALL: 3})[0].size == 0  # an inverted range is empty
    # negative: back from the end; bounds naming partitions only (none for all): those partitions only, as in tail
    assert partition_ranges(marks, {ALL: -10}, {}) == [
        PartitionRange(0, 90, 100),
        PartitionRange(1, 30, 40),
        PartitionRange(2, 0, 0),
    ]
    assert partition_ranges(marks, {1: 3}, {0: -1}) == [PartitionRange(0, 5, 99), PartitionRange(1, 3, 40)]
    assert partition_ranges(marks, {1: 3}, {ALL: 20}) == [
        PartitionRange(0, 5, 20),
        PartitionRange(1, 3, 20),
        PartitionRange(2, 0, 0),
    ]
    with pytest.raises(ConfigError, match=r"--to names partition\(s\) \[4\]"):
        partition_ranges(marks, {}, {4: 1})


def _batch(batch_id: str, first: int, n: int) -> list[Entry]:
    return [Entry(first + i, batch_id) for i in range(n)] + [Entry(first + n, batch_id, seal=True, count=n)]


def test_whole_batches_are_copied_and_cut_ones_skipped_with_the_bound_to_move() -> None:
    # offsets 0-3: b-0 (3 + seal); 4-6: b-1; 7-9: b-2; 10: garbage; 11-12: b-3 members, its seal at 13.
    entries = [*_batch("b-0", 0, 3), *_batch("b-1", 4, 2), *_batch("b-2", 7, 2), Entry(10), *_batch("b-3", 11, 2)]
    rng = PartitionRange(0, 2, 13)  # cuts b-0 (starts at 0) and b-3 (sealed at 13)
    plan = plan_batches([e for e in entries if rng.start <= e.offset < rng.end], rng)
    assert plan.batches == ["b-1", "b-2"]
    assert plan.copy == {4, 5, 6, 7, 8, 9, 10}  # the undecodable record is copied as it is
    assert plan.seals == {6, 9}
    assert [(s.batch_id, s.offsets) for s in plan.skipped] == [("b-0", (2, 3)), ("b-3", (11, 12))]
    assert "only 1 of them at or after offset 2: lower --from/--since" in plan.skipped[0].reason
    assert "no seal before offset 13: raise --to/--until" in plan.skipped[1].reason


def test_interleaved_batches_and_a_reused_id_are_followed_as_the_learner_follows_them() -> None:
    # a-1 opens, b-1 opens and seals, a-1 seals; then the id b-1 again (a new batch) with a seal.
    entries = [
        Entry(0, "a"),
        Entry(1, "b"),
        Entry(2, "b", True, 1),
        Entry(3, "a"),
        Entry(4, "a", True, 2),
        Entry(5, "b"),
        Entry(6, "b", True, 1),
    ]
    plan = plan_batches(entries, PartitionRange(0, 0, 7))
    assert plan.batches == ["b", "a", "b"] and plan.copy == set(range(7)) and not plan.skipped
    late = plan_batches(entries[1:], PartitionRange(0, 1, 7))  # a's first member is cut off
    assert late.batches == ["b", "b"] and late.copy == {1, 2, 5, 6}
    assert [(s.batch_id, s.offsets) for s in late.skipped] == [("a", (3, 4))]
    with pytest.raises(ValueError, match="outside the planned range"):
        plan_batches(entries, PartitionRange(0, 1, 7))


class _Clock:
    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 9))
        self.now += seconds


def test_pacing_releases_record_i_at_i_over_rate() -> None:
    clock = _Clock()
    pacer = Pacer(4.0, clock=clock, sleep=clock.sleep)
    released = []
    for _ in range(5):
        pacer.wait()
        released.append(clock.now - 100.0)
    assert released == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert pacer.delay() == pytest.approx(0.25)  # what the next wait would block (a transaction is not kept open)
    clock.now += 0.2  # work between records counts toward the wait
    pacer.wait()
    assert released[-1] + 0.25 == pytest.approx(clock.now - 100.0) and clock.slept[-1] == pytest.approx(0.05)
    clock.now += 5.0  # far behind: a new schedule, no burst of 20 records
    pacer.wait()
    behind = len(clock.slept)
    pacer.wait()
    assert len(clock.slept) == behind + 1 and clock.slept[-1] == pytest.approx(0.25)
    unpaced = Pacer(None, clock=clock, sleep=clock.sleep)
    unpaced.wait()
    assert len(clock.slept) == behind + 1
    with pytest.raises(ConfigError, match="must be > 0"):
        Pacer(0)


def test_summary_names_offsets_on_both_sides_and_skipped_batches() -> None:
    part = PartitionCopy(0, PartitionRange(0, 2, 13))
    for offset, dest in ((4, 0), (5, 1), (6, 2)):
        part.copied(offset)
        part.delivered(dest)
    copy = TopicCopy(
        "a.clawstream.batches", "b.clawstream.batches", True, [part, PartitionCopy(1, PartitionRange(1, 0, 0))], ["b-1"]
    )
    copy.skipped = plan_batches([Entry(11, "b-3")], PartitionRange(0, 2, 13)).skipped
    text = summary_text([copy])
    assert "a.clawstream.batches → b.clawstream.batches (created): copied 3 record(s)" in text
    assert "[0] range 2..12: 3 record(s), source 4..6 → destination 0..2" in text
    assert "[1] nothing in range" in text and "whole batches: 1 (b-1)" in text
    assert "skipped batch b-3 (offsets 11..11)" in text
    assert copy.to_json()["partitions"][0]["dest_offsets"] == [0, 2]


def test_bad_requests_are_refused_before_any_broker_is_contacted() -> None:
    from clawbase.settings import KafkaSettings
    from consumers.analytics.replay import Replayer
    from consumers.analytics.settings import ReplaySettings

    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1", topic_prefix="runA.")  # nothing listens there
    bad = {
        "bad!": ("--to-prefix 'bad!': topic names allow only", {}),
        "runA.": ("is the source prefix", {}),
        "x.": ("--from/--to are offsets of one topic", {"topics": ["batches", "calls"], "from_offsets": ["3"]}),
        "y.": ("'batch' is not a catalog topic", {"topics": ["batch"]}),
        "z.": ("--rate 0.0: records per second must be > 0", {"rate": 0.0}),
        "w.": ("--until: cannot read 'noon' as a time", {"until": "noon"}),
    }
    for prefix, (message, extra) in bad.items():
        with pytest.raises(ConfigError, match=message):
            Replayer(kafka, ReplaySettings(to_prefix=prefix, **extra), progress=lambda line: None)
