"""Sealed training batches from the batches topic's records, and why a batch is refused: pure, no Kafka.

The learner (``learner.train``) hands every decoded ``BatchRecord`` with its offset to :class:`BatchCollector`, which
returns a :class:`SealedBatch` when the batch's SEAL record arrives, with the offset that is safe to commit once the
batch is done (never past a batch still open). A :class:`Refusal` is the dead letter's reason for a batch that is
not trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import BatchRecord, BatchRecordKind


@dataclass
class PendingBatch:
    first_offset: int
    records: list[BatchRecord] = field(default_factory=list)


@dataclass
class SealedBatch:
    batch_id: str
    step: int
    records: list[BatchRecord]
    seal: BatchRecord
    commit_offset: int  # next offset to read once this batch is done (never past an unfinished batch)
    seal_offset: int = -1  # where the SEAL record is (the batch's position in logs, dead letters, step attempts)


@dataclass(frozen=True)
class Refusal:
    """Why a batch is dead-lettered instead of trained: the dead letter's reason and error type."""

    reason: str
    kind: str = "UntrainableBatch"


class BatchCollector:
    """Groups batch records by batch id until the SEAL record arrives (pure: offsets in, sealed batches out)."""

    def __init__(self) -> None:
        self.pending: dict[str, PendingBatch] = {}

    def add(self, offset: int, record: BatchRecord) -> SealedBatch | None:
        pending = self.pending.setdefault(record.batch_id, PendingBatch(first_offset=offset))
        if record.kind is BatchRecordKind.TRAJECTORY:
            pending.records.append(record)
            return None
        del self.pending[record.batch_id]
        # Commit up to the earliest record of a batch still open (batches could interleave on the partition).
        commit = min([p.first_offset for p in self.pending.values()] + [offset + 1])
        return SealedBatch(record.batch_id, record.step, pending.records, record, commit, offset)
