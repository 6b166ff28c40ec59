"""The Kafka edge of the dashboard and of ``clawstream health``: records → typed events → the aggregates.

* :class:`LiveFeed` — one background thread with a confluent-kafka consumer that *assigns* every partition of the
  topics it shows (no group membership, nothing committed: any number of dashboards read side by side, and the
  running services never see them), from the beginning or from ``since_ms`` (``offsets_for_times``), and follows
  them for ever. A topic that does not exist yet is picked up when it appears (checked every few seconds). The
  weights topic is read to its end first, so the policy lag of the history is measured against versions already
  known. Records are decoded with the project's codec; one that does not decode is counted, never fatal.
* :func:`read_events` — the records of one topic between two offset maps (``clawstream health``), decoded.

Topics in: ``clawstream.rollout.requests``, ``.rollout.events``, ``.calls``, ``.rewards``, ``.trajectories``,
``.weights``, ``.metrics``, ``.deadletter`` (counted only); read-only, ``read_committed``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end, where
from clawbase.settings import KafkaSettings
from consumers.analytics.dashboard.state import DashboardState
from consumers.analytics.reader import read_range
from schemas.codec import default_codec
from schemas.events import ALL_EVENTS, DeadLetter, Event
from schemas.topics import (
    BY_NAME,
    CALLS,
    DEADLETTER,
    METRICS,
    REWARDS,
    ROLLOUT_EVENTS,
    ROLLOUT_REQUESTS,
    TRAJECTORIES,
    WEIGHTS,
)

log = logging.getLogger(__name__)

LIVE_TOPICS: tuple[str, ...] = (
    WEIGHTS,
    ROLLOUT_REQUESTS,
    ROLLOUT_EVENTS,
    CALLS,
    REWARDS,
    TRAJECTORIES,
    METRICS,
    DEADLETTER,
)
_EVENT_TYPES: dict[str, type[Event]] = {f"io.clawstream.{cls.SCHEMA}": cls for cls in ALL_EVENTS}
_BATCH = 500


def decode_event(value: bytes | None) -> Event:
    """One record value → its typed event; :class:`ClawstreamError` (a ``CodecError``) when it does not decode."""
    if value is None:
        raise ClawstreamError("record has no value (a tombstone)")
    name, record = default_codec().decode(value)
    cls = _EVENT_TYPES.get(name)
    if cls is None:
        raise ClawstreamError(f"no typed event for schema {name}")
    try:
        return cls.from_record(record)
    except (KeyError, ValueError, TypeError) as exc:
        raise ClawstreamError(f"{name} record does not fit its event type: {exc}") from exc


def _reader(settings: KafkaSettings, role: str) -> Consumer:
    # A throw-away group id the broker never hears of: partitions are assigned by hand and nothing is committed.
    return make_consumer(
        settings,
        f"clawstream-{role}-{uuid.uuid4().hex[:12]}",
        **{"enable.auto.commit": False, "enable.auto.offset.store": False},
    )


class LiveFeed:
    """Follows the dashboard's topics in a daemon thread and feeds ``state`` under ``lock``."""

    def __init__(
        self,
        settings: KafkaSettings,
        state: DashboardState,
        lock: threading.Lock,
        *,
        since_ms: int | None = None,
        topics: tuple[str, ...] = LIVE_TOPICS,
        recheck_s: float = 3.0,
    ) -> None:
        self.settings = settings
        self.state = state
        self.lock = lock
        self.since_ms = since_ms
        self.topics = topics
        self.recheck_s = recheck_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dashboard-feed", daemon=True)
        self.assigned: set[str] = set()
        self.error: str | None = None  # the last consumer-level problem (shown on the page)

    def start(self) -> LiveFeed:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._prime_weights()
            consumer = _reader(self.settings, "dashboard")
            try:
                self._follow(consumer)
            finally:
                consumer.close()
        except Exception as exc:  # a dead feed must be visible on the page, not only in a log
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("dashboard feed stopped")

    def _prime_weights(self) -> None:
        if WEIGHTS not in self.topics:
            return
        topic = self.settings.topic(WEIGHTS)
        consumer = _reader(self.settings, "dashboard-weights")
        try:
            ends = assign_from_beginning(consumer, topic, missing_ok=True)
            for msg in read_to_end(consumer, topic, ends, timeout=60, stop=self._stop.is_set):
                self._take([(WEIGHTS, msg.value(), where(msg))])
        except ClawstreamError as exc:
            log.warning("could not read %s ahead: %s", topic, exc)
        finally:
            consumer.close()

    def _follow(self, consumer: Consumer) -> None:
        names = {self.settings.topic(t): t for t in self.topics}
        next_check = 0.0
        while not self._stop.is_set():
            if len(self.assigned) < len(names) and time.monotonic() >= next_check:
                self._assign_new(consumer, names)
                next_check = time.monotonic() + self.recheck_s
            if not self.assigned:
                self._stop.wait(0.5)
                continue
            batch = consumer.consume(_BATCH, 0.5)
            items = []
            for msg in batch:
                if msg.error() is not None:
                    log.warning("consumer error: %s", msg.error())
                    continue
                items.append((names.get(msg.topic(), msg.topic()), msg.value(), where(msg)))
            if items:
                self._take(items)

    def _assign_new(self, consumer: Consumer, names: dict[str, str]) -> None:
        try:
            existing = consumer.list_topics(timeout=10).topics
        except KafkaException as exc:
            self.error = f"cannot list topics: {exc}"
            return
        new: list[TopicPartition] = []
        for full in names:
            meta = existing.get(full)
            if full in self.assigned or meta is None or meta.error is not None or not meta.partitions:
                continue
            tps = [TopicPartition(full, p, OFFSET_BEGINNING) for p in sorted(meta.partitions)]
            if self.since_ms is not None:
                try:
                    found = consumer.offsets_for_times(
                        [TopicPartition(full, p, self.since_ms) for p in sorted(meta.partitions)], timeout=10
                    )
                except KafkaException as exc:
                    self.error = f"cannot look up offsets by time in {full}: {exc}"
                    continue
                # No record at or after the time: start at the end (-1 means exactly that to librdkafka).
                tps = [TopicPartition(full, tp.partition, tp.offset if tp.offset >= 0 else -1) for tp in found]
            new.extend(tps)
            self.assigned.add(full)
        if new:
            consumer.incremental_assign(new)
            log.info("dashboard reads %s", ", ".join(sorted({tp.topic for tp in new})))

    def _take(self, items: list[tuple[str, bytes | None, str]]) -> None:
        """Decode and add ``(catalog topic, value, topic[partition]@offset)`` records; a record that does not decode,
        or holds another schema than its catalog topic's, is counted as an error with its position and reason."""
        decoded: list[tuple[str, Event | None, str]] = []
        for topic, value, at in items:  # decode outside the lock: the page's requests wait on it
            try:
                event = decode_event(value)
                spec = BY_NAME.get(topic)
                if spec is not None and event.SCHEMA != spec.value_schema:
                    raise ClawstreamError(f"a {event.SCHEMA} record, not a {spec.value_schema}")
                decoded.append((topic, event, ""))
            except ClawstreamError as exc:
                decoded.append((topic, None, f"{at}: {exc}"))
        with self.lock:
            for topic, event, error in decoded:
                if event is None:
                    self.state.add_error(topic, error)
                elif isinstance(event, DeadLetter):
                    self.state.records[topic] += 1
                else:
                    self.state.add(event, topic)


def read_events(
    consumer: Consumer,
    topic: str,
    starts: dict[int, int],
    ends: dict[int, int],
    *,
    on_error: Callable[[str], Any] | None = None,
    expected: type[Event] | None = None,
) -> Iterator[Event]:
    """Decoded events of ``topic`` from ``starts`` up to ``ends`` (exclusive); undecodable records (and, given
    ``expected``, records of another type) go to ``on_error`` with their position (``topic[partition]@offset``)
    and are skipped."""
    for msg in read_range(consumer, topic, starts, ends):
        try:
            event = decode_event(msg.value())
            if expected is not None and not isinstance(event, expected):
                raise ClawstreamError(f"a {type(event).__name__} record, not a {expected.__name__}")
        except ClawstreamError as exc:
            if on_error is not None:
                on_error(f"{topic}[{msg.partition()}]@{msg.offset()}: {exc}")
            continue
        yield event
