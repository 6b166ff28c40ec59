"""Offset bookkeeping for a consumer that runs several requests at once and commits manually.

Each partition's requests start in offset order and finish in any order. The offset that may be committed is the
lowest offset still in flight (everything below it is done), or one past the highest finished offset when nothing is
in flight. A request's offset is marked done only after its terminal events were acknowledged by Kafka, so a
worker that dies mid-rollout leaves that request (and everything after it on its partition) uncommitted: the
group re-delivers it to another worker, which runs it under a new attempt id. Finished requests above an
unfinished one are then read again too; the proxy remembers them as finished, so the worker commits them without
running them again (docs/faults.md#sandbox-worker-rebalances). A revoked partition is forgotten; when it comes back,
the worker starts its offsets again as it reads them. :class:`SeenRequests`: where each request was read, to tell a
duplicate record from a redelivery. Pure: no Kafka import.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass, field

Partition = tuple[str, int]  # (topic, partition)


@dataclass
class _PartitionState:
    in_flight: set[int] = field(default_factory=set)
    highest_done: int = -1
    committed: int = -1  # the last offset handed to commit (next offset to read)


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[Partition, _PartitionState] = {}

    def start(self, tp: Partition, offset: int) -> None:
        state = self._parts.setdefault(tp, _PartitionState())
        state.in_flight.add(offset)

    def done(self, tp: Partition, offset: int) -> None:
        """Mark finished; ignored for a partition this worker no longer owns (revoked meanwhile)."""
        state = self._parts.get(tp)
        if state is None or offset not in state.in_flight:
            return
        state.in_flight.discard(offset)
        state.highest_done = max(state.highest_done, offset)

    def commit_point(self, tp: Partition) -> int | None:
        """The offset to commit for ``tp`` (next to read), or None when nothing new is committable."""
        state = self._parts.get(tp)
        if state is None:
            return None
        point = min(state.in_flight) if state.in_flight else state.highest_done + 1
        return point if point > state.committed and point > 0 else None

    def commit_points(self) -> dict[Partition, int]:
        return {tp: p for tp in self._parts if (p := self.commit_point(tp)) is not None}

    def committed(self, tp: Partition, offset: int) -> None:
        if tp in self._parts:
            self._parts[tp].committed = max(self._parts[tp].committed, offset)

    def forget(self, tps: list[Partition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(s.in_flight) for s in self._parts.values())


class SeenRequests:
    """Where each request (rollout id, attempt) was read, for :meth:`check`: a duplicate or stale record is poison,
    the same record read again (a redelivery) is not. The ``limit`` rollout ids read last are kept, the rest forgotten.

    Forgetting decides nothing wrongly, it only stops recognising duplicates: a record of a forgotten rollout runs
    as a new one, and the proxy reports its attempt held or finished (it keeps finished attempts for its retention,
    2 h by default), so it is committed unrun as a redelivery is. What only this table adds is the dead letter naming
    the duplicate, and cover beyond the proxy's retention; both are worth an entry per rollout, so entries are compact:
    per rollout id one flat tuple of (attempt, topic, partition, offset) fields, the topic string shared (interned).
    A dict per id of ((topic, partition), offset) tuples with a fresh topic string each measured ~590 bytes an entry
    with its id (59 MB at 100,000), this ~250 (25 MB; ``test_sandbox_worker_memory.py``).
    """

    WIDTH = 4  # fields per attempt in an entry

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, tuple[int | str, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, rollout_id: str, attempt: int, tp: Partition, offset: int) -> str | None:
        """Why ``rollout_id`` attempt ``attempt`` at ``tp@offset`` is a duplicate of a record read here, or None (new,
        or the same record read again: a redelivery). Remembers it otherwise."""
        entry = self._seen.get(rollout_id, ())
        where: dict[int, tuple[str, int, int]] = {}
        for i in range(0, len(entry), self.WIDTH):
            a, t, p, o = entry[i : i + self.WIDTH]
            where[int(a)] = (str(t), int(p), int(o))
        if where.get(attempt) == (tp[0], tp[1], offset):
            return None
        if attempt in where:
            t, p, o = where[attempt]
            return f"duplicate: rollout {rollout_id} attempt {attempt} was already read at {t}[{p}]@{o}"
        newer = max(where, default=-1)
        if newer > attempt:
            t, p, o = where[newer]
            return f"stale: rollout {rollout_id} attempt {attempt} after attempt {newer} (read at {t}[{p}]@{o})"
        self._seen[rollout_id] = (*entry, attempt, sys.intern(tp[0]), tp[1], offset)
        self._seen.move_to_end(rollout_id)
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return None
