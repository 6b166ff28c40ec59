"""Reading a range of a topic for a person: partitions assigned by hand, start and end offsets per partition.

Shared by ``tail`` and ``export`` (and any tool that reads the log without joining a consumer group):

* :func:`open_reader` — a consumer that never commits (``assign``, not ``subscribe``; a throw-away group id that
  the broker never hears of) after checking the broker answers and the topic exists.
* :func:`watermarks` / :func:`offsets_at` — ``{partition: (low, high)}`` and the first offset at or after a time
  (``offsets_for_times``).
* :func:`install_stop_signals` — SIGINT/SIGTERM end a read cleanly between polls instead of raising.
* :func:`read_range` — the records from ``starts`` up to ``ends`` (exclusive; ``None``: follow for ever), in poll
  order, until every partition is done or ``stop()`` turns true. Whether a partition is done is judged by consumer
  *positions*, so a transactional topic whose last offsets are commit markers ends (see
  ``clawbase.kafka.clients.partitions_at_end``).

Topics: any, read-only (``isolation.level=read_committed``, like every consumer of the project).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from clawbase.kafka.clients import bootstrap_servers, check_broker, make_consumer
from clawbase.settings import KafkaSettings
from consumers.analytics.records import EventLogError, TopicRef, resolve_topic

log = logging.getLogger(__name__)
T = TypeVar("T")
# Errors of a topic whose partitions have no leader yet (just created): librdkafka does not flag them retriable.
_SETTLING = frozenset(
    {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART}
)

# A read that makes no progress this long (no record, no position moving) is reported instead of hanging: with
# read_committed, an open transaction of a crashed producer holds positions until the broker aborts it.
STALL_S = 60.0
READ_BATCH = 500  # records per consume() call; replay sizes its stall allowance by it


def open_reader(settings: KafkaSettings, topic: str, *, timeout: float = 15.0) -> tuple[Consumer, TopicRef]:
    """A never-committing consumer and the resolved topic; clear errors for no broker or no such topic."""
    check_broker(settings, timeout=timeout)
    ref = resolve_topic(topic, settings.topic_prefix)
    consumer = make_consumer(
        settings,
        f"clawstream-reader-{uuid.uuid4().hex[:12]}",
        **{"enable.auto.commit": False, "enable.auto.offset.store": False},
    )
    try:
        existing = consumer.list_topics(timeout=timeout).topics
    except KafkaException as exc:
        consumer.close()
        raise EventLogError(f"cannot list topics on {bootstrap_servers(settings)}: {exc}") from exc
    if ref.name not in existing:
        consumer.close()
        raise EventLogError(_missing(ref, sorted(existing), bootstrap_servers(settings)))
    return consumer, ref


def _missing(ref: TopicRef, existing: list[str], bootstrap: str) -> str:
    similar = [t for t in existing if ref.spec is not None and t.endswith(ref.spec.name)][:8]
    hint = (
        f"; topics with that name under a prefix: {', '.join(similar)}"
        if similar
        else ("; `clawstream topics list` shows the catalog, --topic-prefix P selects a run's prefix")
    )
    return f"no topic {ref.name} on {bootstrap}{hint}"


def _retrying(what: str, call: Callable[[], T], timeout: float) -> T:
    """``call()``, retried while the broker answers with a retriable error (a topic just created has no leader
    for a moment: NOT_LEADER_FOR_PARTITION) until ``timeout``; then an :class:`EventLogError` saying ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if not (isinstance(err, KafkaError) and (err.retriable() or err.code() in _SETTLING)) or (
                time.monotonic() > deadline
            ):
                raise EventLogError(f"cannot {what}: {exc}") from exc
            time.sleep(0.2)


def watermarks(consumer: Consumer, topic: str, timeout: float = 15.0) -> dict[int, tuple[int, int]]:
    """``{partition: (low, high)}`` of every partition of ``topic``, as of now."""
    meta = _retrying(
        f"read the partitions of {topic}", lambda: consumer.list_topics(topic, timeout=timeout).topics[topic], timeout
    )
    if meta.error is not None or not meta.partitions:
        raise EventLogError(f"cannot read {topic}: {meta.error or 'no partitions'}")
    return {
        p: _retrying(
            f"read the offsets of {topic}[{p}]",
            lambda p=p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout),
            timeout,
        )
        for p in sorted(meta.partitions)
    }


def offsets_at(
    consumer: Consumer, topic: str, time_ms: int, marks: dict[int, tuple[int, int]], timeout: float = 15.0
) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is at or after ``time_ms`` (``high`` when none)."""
    found = _retrying(
        f"look up offsets by time in {topic}",
        lambda: consumer.offsets_for_times([TopicPartition(topic, p, time_ms) for p in marks], timeout=timeout),
        timeout,
    )
    out: dict[int, int] = {}
    for tp in found:
        if tp.error is not None:
            raise EventLogError(f"cannot look up offsets by time in {topic}[{tp.partition}]: {tp.error}")
        low, high = marks[tp.partition]
        out[tp.partition] = high if tp.offset < 0 else min(max(tp.offset, low), high)
    return out


def read_range(
    consumer: Consumer,
    topic: str,
    starts: dict[int, int],
    ends: dict[int, int] | None,
    *,
    stop: Callable[[], bool] = lambda: False,
    poll_timeout: float = 0.2,
    stall_s: float = STALL_S,
) -> Iterator[Message]:
    """Yield the records of ``topic`` from ``starts[p]`` up to ``ends[p]`` (exclusive) in poll order.

    ``ends=None`` follows the partitions for ever (until ``stop()``). Records at or beyond a partition's end are
    not yielded. Consumer errors are logged and skipped. Raises :class:`EventLogError` when a bounded read makes no
    progress for ``stall_s`` seconds.
    """
    pending = {p for p in starts if ends is None or starts[p] < ends[p]}
    if not pending:
        return
    assigned = [TopicPartition(topic, p, starts[p]) for p in sorted(pending)]
    consumer.assign(assigned)
    try:
        last_progress = time.monotonic()
        last_positions: dict[int, int] = {}
        while pending and not stop():
            batch = consumer.consume(READ_BATCH, poll_timeout)
            for msg in batch:
                if msg.error() is not None:
                    log.warning("consumer error on %s: %s", topic, msg.error())
                    continue
                p = msg.partition()
                if p in pending and (ends is None or msg.offset() < ends[p]):
                    yield msg
            if ends is None:
                continue
            positions = {
                tp.partition: tp.offset for tp in consumer.position([TopicPartition(topic, p) for p in pending])
            }
            done = {p for p, pos in positions.items() if pos >= ends[p]}
            if done:
                consumer.pause([TopicPartition(topic, p) for p in done])
                pending -= done
            if batch or positions != last_positions:
                last_progress, last_positions = time.monotonic(), positions
            elif time.monotonic() - last_progress > stall_s:
                left = ", ".join(f"{topic}[{p}] at {positions.get(p)} of {ends[p]}" for p in sorted(pending))
                raise EventLogError(
                    f"no progress for {stall_s:.0f}s reading {left} (an open transaction of a "
                    "stopped producer holds read_committed readers until the broker aborts it)"
                )
    finally:
        try:
            # librdkafka keeps a partition's pause across unassign/assign: resume, or the next read of it stalls.
            consumer.resume(assigned)
            consumer.unassign()
        except KafkaException:
            pass


def install_stop_signals() -> tuple[threading.Event, Callable[[], None]]:
    """SIGINT and SIGTERM set an event (the read loops check it between polls) instead of raising; returns the
    event and a function restoring the previous handlers. Main thread only."""
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda _s, _f: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return stopping, restore
