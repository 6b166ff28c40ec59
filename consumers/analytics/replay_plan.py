"""Replay planning (pure, no Kafka): which topics, which offsets, which whole batches, how fast.

``consumers.analytics.replay`` reads and writes the broker; everything it decides lives here so it is tested without
one: the topic names a user may pass, the per partition range that the ``--from/--to`` offsets and the
``--since/--until`` times give (both parsed by ``consumers.analytics.records``, as for ``tail`` and ``export``), the
rule that a sealed batch is copied whole or not at all (:func:`plan_batches`), the ``--rate`` pacing and the
end-of-run summary.

Ranges are half-open, ``[start, end)``, like Kafka's own end offsets: ``--from 10 --to 20`` copies offsets 10 … 19;
``--from -100`` starts 100 offsets before the end.

Whole batches. On ``clawstream.batches`` a batch is its TRAJECTORY records then one SEAL. A batch is copied only when
its SEAL and every one of its TRAJECTORY records lie inside the range; a batch cut by a bound is skipped entirely,
and the summary names it with the bound to move. Copying the in-range half instead would hurt the learner either
way: members without their seal leave a batch open for ever, and the learner never commits offsets past an open
batch (every restart would read the replayed topic again from there); a seal without all its members is dead-lettered
("seal says n trajectories, k arrived"). And the range stays a hard limit: nothing outside it is ever copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from clawbase.errors import ConfigError
from consumers.analytics.records import ALL_PARTITIONS
from schemas.topics import BY_NAME, CATALOG, TopicSpec

ALL = ALL_PARTITIONS  # the key of a bound given without "P:" (every partition)


def resolve_topic(name: str) -> TopicSpec:
    """A catalog topic by its full name (``clawstream.batches``) or its short one (``batches``)."""
    spec = BY_NAME.get(name) or BY_NAME.get(f"clawstream.{name}")
    if spec is None:
        names = ", ".join(s.name.removeprefix("clawstream.") for s in CATALOG)
        raise ConfigError(f"--topic {name!r} is not a catalog topic; one of: {names} (with or without 'clawstream.')")
    return spec


@dataclass(frozen=True)
class PartitionRange:
    """Offsets ``[start, end)`` of one partition to copy."""

    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)


def partition_ranges(
    marks: dict[int, tuple[int, int]],
    starts: dict[int, int],
    ends: dict[int, int],
    since: dict[int, int] | None = None,
    until: dict[int, int] | None = None,
) -> list[PartitionRange]:
    """The range of each partition to copy: the watermarks ``(low, high)`` narrowed by the offset bounds
    (``starts``/``ends`` from ``records.parse_offsets``: ``{partition or ALL: offset}``, a negative offset counting
    back from ``high``) and by the offsets the time bounds resolved to (``since``/``until``, from the broker's
    offsets-for-times; a time past the last record resolves to ``high``). Offset and time bounds both apply (the
    intersection). As in ``tail``: bounds that only name partitions (``P:N``, none for every partition) copy only
    those partitions. A bound naming a partition the topic does not have is an error."""
    for flag, bounds in (("--from", starts), ("--to", ends)):
        unknown = sorted(p for p in bounds if p != ALL and p not in marks)
        if unknown:
            raise ConfigError(f"{flag} names partition(s) {unknown} but the topic has partitions {sorted(marks)}")
    named = (set(starts) | set(ends)) - {ALL}
    chosen = sorted(marks) if ALL in starts or ALL in ends or not named else sorted(named)

    def offset(bounds: dict[int, int], p: int, default: int) -> int:
        value = bounds.get(p, bounds.get(ALL, default))
        return marks[p][1] + value if value < 0 else value

    out = []
    for p in chosen:
        low, high = marks[p]
        start = max(low, offset(starts, p, low), (since or {}).get(p, low))
        end = min(high, offset(ends, p, high), (until or {}).get(p, high))
        out.append(PartitionRange(p, start, max(start, end)))
    return out


# ---- whole batches ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """What the plan needs of one record of the batches topic: its offset and, when it decodes, whose it is."""

    offset: int
    batch_id: str | None = None  # None: the value is no BatchRecord (copied as it is, the learner dead-letters it)
    seal: bool = False
    count: int = 0  # a SEAL's trajectory count (its ``index``)


@dataclass(frozen=True)
class SkippedBatch:
    batch_id: str
    offsets: tuple[int, ...]  # its records inside the range (none of them copied)
    reason: str


@dataclass
class BatchPlan:
    copy: set[int] = field(default_factory=set)  # offsets to copy
    batches: list[str] = field(default_factory=list)  # whole batches copied, in seal order
    seals: set[int] = field(default_factory=set)  # offsets of their seals (transaction boundaries)
    skipped: list[SkippedBatch] = field(default_factory=list)


def plan_batches(entries: Sequence[Entry], rng: PartitionRange) -> BatchPlan:
    """Whole batches only (module docstring): the offsets of the records of ``rng`` to copy, and what is skipped.

    Batches are followed as the learner follows them: a batch id's TRAJECTORY records are collected until its SEAL,
    after which the id starts afresh. Records that are no BatchRecord are copied as they are."""
    plan = BatchPlan()
    open_batches: dict[str, list[int]] = {}
    for entry in entries:
        if not rng.start <= entry.offset < rng.end:
            raise ValueError(f"offset {entry.offset} is outside the planned range [{rng.start}, {rng.end})")
        if entry.batch_id is None:
            plan.copy.add(entry.offset)
            continue
        members = open_batches.setdefault(entry.batch_id, [])
        if not entry.seal:
            members.append(entry.offset)
            continue
        del open_batches[entry.batch_id]
        if len(members) < entry.count:
            plan.skipped.append(
                SkippedBatch(
                    entry.batch_id,
                    (*members, entry.offset),
                    f"sealed at offset {entry.offset} with {entry.count} trajectories, only {len(members)} of them "
                    f"at or after offset {rng.start}: lower --from/--since to include it",
                )
            )
            continue
        plan.copy.update(members)
        plan.copy.add(entry.offset)
        plan.seals.add(entry.offset)
        plan.batches.append(entry.batch_id)
    for batch_id, members in open_batches.items():
        plan.skipped.append(
            SkippedBatch(
                batch_id,
                tuple(members),
                f"{len(members)} trajectory record(s) from offset {members[0]} but no seal before offset {rng.end}: "
                "raise --to/--until to include it",
            )
        )
    plan.skipped.sort(key=lambda s: s.offsets[0])
    return plan


# ---- pacing -------------------------------------------------------------------------------------------------------
class Pacer:
    """``--rate N``: record ``i`` (from 0) is released no earlier than ``i / N`` seconds after the first. A slow
    stretch is not made up with a burst beyond the schedule's average: the schedule restarts when it falls behind by
    more than one second."""

    def __init__(
        self,
        rate: float | None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        if rate is not None and not rate > 0:
            raise ConfigError(f"--rate {rate}: records per second must be > 0 (leave it out for no pacing)")
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.origin: float | None = None
        self.released = 0

    def delay(self) -> float:
        """Seconds :meth:`wait` would block now (0 without pacing or before the first record)."""
        if self.rate is None or self.origin is None:
            return 0.0
        return max(0.0, self.origin + self.released / self.rate - self.clock())

    def wait(self) -> None:
        """Block until the next record may be produced."""
        if self.rate is None:
            return
        now = self.clock()
        if self.origin is None:
            self.origin = now
        due = self.origin + self.released / self.rate
        if due > now:
            self.sleep(due - now)
        elif now - due > 1.0:  # fell behind (a slow read): start a new schedule from here
            self.origin, self.released = now, 0
        self.released += 1


# ---- summary ------------------------------------------------------------------------------------------------------
@dataclass
class PartitionCopy:
    """What was copied from one source partition."""

    partition: int
    range: PartitionRange
    records: int = 0
    source_first: int | None = None
    source_last: int | None = None
    dest_first: int | None = None
    dest_last: int | None = None

    def copied(self, source_offset: int) -> None:
        self.records += 1
        self.source_first = source_offset if self.source_first is None else self.source_first
        self.source_last = source_offset

    def delivered(self, dest_offset: int) -> None:
        self.dest_first = dest_offset if self.dest_first is None else min(self.dest_first, dest_offset)
        self.dest_last = dest_offset if self.dest_last is None else max(self.dest_last, dest_offset)


@dataclass
class TopicCopy:
    source: str
    dest: str
    created: bool
    partitions: list[PartitionCopy] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)
    skipped: list[SkippedBatch] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(p.records for p in self.partitions)

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "dest": self.dest,
            "created": self.created,
            "records": self.records,
            "partitions": [
                {
                    "partition": p.partition,
                    "range": [p.range.start, p.range.end],
                    "records": p.records,
                    "source_offsets": [p.source_first, p.source_last],
                    "dest_offsets": [p.dest_first, p.dest_last],
                }
                for p in self.partitions
            ],
            "batches": self.batches,
            "skipped_batches": [
                {"batch_id": s.batch_id, "offsets": list(s.offsets), "reason": s.reason} for s in self.skipped
            ],
        }


def summary_text(copies: Sequence[TopicCopy], dry_run: bool = False) -> str:
    """Records per topic with first/last offsets on both sides, whole batches and skipped ones."""
    lines = []
    verb = "would copy" if dry_run else "copied"
    for c in copies:
        lines.append(f"{c.source} → {c.dest}{' (created)' if c.created else ''}: {verb} {c.records} record(s)")
        for p in c.partitions:
            if p.range.size == 0:
                lines.append(f"  [{p.partition}] nothing in range")
                continue
            src = f"source {p.source_first}..{p.source_last}" if p.records else "no record"
            dst = f" → destination {p.dest_first}..{p.dest_last}" if p.dest_first is not None else ""
            lines.append(
                f"  [{p.partition}] range {p.range.start}..{p.range.end - 1}: {p.records} record(s), {src}{dst}"
            )
        if c.batches or c.skipped:
            lines.append(f"  whole batches: {len(c.batches)}" + (f" ({', '.join(c.batches)})" if c.batches else ""))
        for s in c.skipped:
            lines.append(f"  skipped batch {s.batch_id} (offsets {s.offsets[0]}..{s.offsets[-1]}): {s.reason}")
    return "\n".join(lines)
