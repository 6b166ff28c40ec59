"""Dead letters: the one way every service records an input it cannot use, with the reason and the original bytes.

A dead letter names where the record came from (topic, partition, offset), why it was rejected (``reason``,
``error_type``), who rejected it (``source``), and keeps its key and value so an operator can replay or inspect
it. Build one with :func:`dead_letter` (any origin) or :func:`dead_letter_of` (a consumed confluent-kafka message);
the caller produces it with whatever client it already holds (plain, transactional, Faust).
"""

from __future__ import annotations

from typing import Any

from schemas.events import DeadLetter, now_ms


def dead_letter(
    source: str,
    reason: str,
    error_type: str,
    *,
    topic: str,
    partition: int | None = -1,
    offset: int | None = -1,
    key: bytes | None = None,
    value: bytes | None = None,
    rollout_id: str | None = None,
    policy_version: int | None = None,
) -> DeadLetter:
    """A dead letter stamped now; unknown partition/offset are -1."""
    return DeadLetter(
        timestamp_ms=now_ms(),
        source=source,
        reason=reason,
        error_type=error_type,
        original_topic=topic or "",
        original_partition=-1 if partition is None else partition,
        original_offset=-1 if offset is None else offset,
        rollout_id=rollout_id,
        policy_version=policy_version,
        original_key=key,
        original_value=value,
    )


def dead_letter_of(
    msg: Any,
    source: str,
    reason: str,
    error_type: str,
    *,
    rollout_id: str | None = None,
    policy_version: int | None = None,
) -> DeadLetter:
    """A dead letter for a consumed ``confluent_kafka.Message`` (its topic, partition, offset, key and value)."""
    return dead_letter(
        source,
        reason,
        error_type,
        topic=msg.topic() or "",
        partition=msg.partition(),
        offset=msg.offset(),
        key=msg.key(),
        value=msg.value(),
        rollout_id=rollout_id,
        policy_version=policy_version,
    )
