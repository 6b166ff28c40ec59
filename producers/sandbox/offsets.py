"""Offset bookkeeping for a consumer that runs several requests at once and commits manually.

Each partition's requests start in offset order and finish in any order. The offset that may be committed is the
lowest offset still in flight (everything below it is done), or one past the highest finished offset when nothing is
in flight. A request's offset is marked done only after its terminal events were acknowledged by Kafka, so a
worker that dies mid-rollout leaves that request (and everything after it on its partition) uncommitted: the
group re-delivers it to another worker, which runs it under a new attempt id. Finished requests above an
unfinished one are then read again too; the proxy remembers them as finished, so the worker commits them without
running them again (docs/faults.md#sandbox-worker-rebalances). A revoked partition is forgotten; when it comes back,
the worker starts its offsets again as it reads them. Pure: no Kafka import.
"""

from __future__ import annotations

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
