"""Types shared by the stages and the tick loop: verdicts on records, the due index and the per-partition deadlines.

The assembler (``streams.assemble``) and the grouper (``streams.group``) keep their entities (rollouts, groups) in a
key → bytes map and, per partition, a :class:`DueIndex` of when each entity may next need attention. A record of an
entity *schedules* it (:meth:`Deadlines.schedule`: the index only ever moves earlier there); a tick *visits* the
entities that are due (:meth:`Deadlines.tick`), which acts on them and reports their next due time, or their
*tombstone*: once nothing but a replay can still concern a settled rollout or a closed group, its state is replaced by
a few dozen bytes that say so and it leaves the index (a tombstone is kept for good: a replay at any later time finds
it, so what a replay may re-open never depends on the clock or on how many entities came since). Ticks are the
app's own tick topics (see ``streams.app``: Faust timers cannot write tables, so a timer sends each owned partition
with something due (:meth:`Deadlines.earliest`) a tick and the agents check deadlines when it arrives, inside the
partition's transaction).

No topics of its own; pure: no Kafka, no Faust (the maps are Faust tables in the app, dicts in tests). Run through
the app: ``python -m streams.app worker``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from enum import StrEnum

from schemas.events import TrajectoryStatus

# Statuses a learner can train on (they carry tree segments); every other status is kept for statistics only.
TRAINABLE_STATUSES = frozenset({TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT})


class Verdict(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # ignored
    LATE = "late"  # the entity already settled / closed → dead letter
    REJECTED = "rejected"  # contradicts what is known → dead letter
    SUPERSEDES = "supersedes"  # a newer attempt started: settle the current one first, then apply again
    OLDER_RUN = "older run"  # an older run's STARTED read after the newer run's records: settle that run apart


@dataclass(frozen=True)
class Outcome:
    """What a stage made of one record; ``reason`` is the dead letter's reason when it is LATE or REJECTED."""

    verdict: Verdict
    reason: str = ""


class DueIndex:
    """id → earliest time (ms) it may need attention, for one partition (JSON bytes in a table)."""

    def __init__(self, entries: dict[str, int] | None = None) -> None:
        self.entries = entries or {}

    @classmethod
    def load(cls, data: bytes | None) -> DueIndex:
        return cls(json.loads(data) if data else None)

    def to_bytes(self) -> bytes:
        return json.dumps(self.entries, separators=(",", ":")).encode()

    def lower(self, key: str, due_ms: int) -> bool:
        """Record ``due_ms`` if it is earlier than what is stored (a later due is found when the tick re-checks)."""
        if key in self.entries and self.entries[key] <= due_ms:
            return False
        self.entries[key] = due_ms
        return True

    def due(self, now_ms: int) -> list[str]:
        return sorted((k for k, t in self.entries.items() if t <= now_ms), key=lambda k: (self.entries[k], k))


# A tick's visit of one due entity: (key, stored bytes) → its next due time; or bytes: its tombstone, which replaces its
# state (and it leaves the index); or None to forget it (state and index).
Visit = Callable[[str, bytes], int | bytes | None]
TOMBSTONE = b"~"  # first byte of a tombstone (entity state is JSON: it starts with "{")


def is_tombstone(data: bytes | None) -> bool:
    return bool(data) and data[:1] == TOMBSTONE  # type: ignore[index]


class Deadlines:
    """The tick loop over a stage's entities: ``state[key]`` their bytes, ``index[str(partition)]`` a DueIndex."""

    def __init__(self, state: MutableMapping[str, bytes], index: MutableMapping[str, bytes]) -> None:
        self.state, self.index = state, index
        # partition key → (the stored bytes, their decoded DueIndex, its earliest due): a record or tick decodes its
        # partition's index again only when the stored bytes are not the ones decoded last. A pure function of the
        # bytes, so any change (a tick, a rebalance, a restored table) is seen; comparing bytes is far cheaper than
        # parsing them, and an idle tick compares one number instead of scanning every entry. Never mutated.
        self._decoded: dict[str, tuple[bytes, DueIndex, int | None]] = {}

    def _load(self, key: str) -> tuple[DueIndex, int | None]:
        data = self.index.get(key)
        cached = self._decoded.get(key)
        if data and cached is not None and (cached[0] is data or cached[0] == data):
            return cached[1], cached[2]
        index = DueIndex.load(data)
        earliest = min(index.entries.values(), default=None)
        if data:
            self._decoded[key] = (data, index, earliest)
        return index, earliest

    def _store(self, key: str, index: DueIndex) -> None:
        data = index.to_bytes()
        self.index[key] = data
        self._decoded[key] = (data, index, min(index.entries.values(), default=None))

    def earliest(self, partition: int) -> int | None:
        """The earliest time any of the partition's entities may need attention (None: nothing scheduled): a tick
        before then visits nothing (:meth:`tick` returns at once), so the app's timer need not send it."""
        return self._load(str(partition))[1]

    def schedule(self, partition: int, key: str, due_ms: int) -> None:
        """Make sure a tick visits ``key`` by ``due_ms``; the index is rewritten only when that moved it earlier
        (one changelog write less per record: a later due is found when the tick re-checks)."""
        index, _ = self._load(str(partition))
        if key in index.entries and index.entries[key] <= due_ms:
            return
        index = DueIndex(dict(index.entries))  # the cached object only ever holds what the stored bytes say
        index.lower(key, due_ms)
        self._store(str(partition), index)

    def tick(self, partition: int, now_ms: int, visit: Visit) -> None:
        """Visit the partition's due entities, oldest due first; reschedule them or forget them as ``visit`` says.

        ``visit`` writes the entity's state itself when it changed it. An index entry whose state is gone (forgotten
        elsewhere) or a tombstone is dropped. The index is not rewritten when nothing was due (no changelog write per
        idle tick).
        """
        key = str(partition)
        index, earliest = self._load(key)
        if earliest is None or earliest > now_ms:
            return
        due = index.due(now_ms)
        index = DueIndex(dict(index.entries))
        for entity in due:
            data = self.state.get(entity)
            if data is None or is_tombstone(data):
                index.entries.pop(entity, None)
                continue
            next_ms = visit(entity, data)
            if next_ms is None:
                del self.state[entity]
                index.entries.pop(entity)
            elif isinstance(next_ms, bytes):
                self.state[entity] = next_ms
                index.entries.pop(entity)
            else:
                index.entries[entity] = next_ms
        self._store(key, index)
