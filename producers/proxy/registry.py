"""The proxy's registrations on Kafka: written on every change, read back by a restarted proxy before it listens.

:class:`RegistrationLog` is the admin's store (``producers.proxy.admin.RegistrationStore``): it publishes a rollout
id's current record to ``clawstream.proxy.registrations`` (compacted, key = rollout id; acks=all, awaited; a
tombstone once nothing is left to remember) and keeps a recent snapshot of the ``clawstream.calls`` end offsets,
which each new registration records as where its call events start (refreshed every ``offsets_every_s``).

:func:`restore_registrations` runs at start, before the port opens: it reads the registrations topic
(read_committed, from the beginning to ends taken first), keeps this proxy's latest records
(``producers.proxy.restore.plan_restore``), reads the calls topic from the earliest offset those registrations
recorded to ends taken first, keeping the events of their keys, replays each live registration's own calls into its
renderer (``replay_calls``) and hands everything to the admin; expired registrations are tombstoned. Nothing is
committed: partitions are assigned by hand.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import defaultdict

from confluent_kafka import Consumer, KafkaException, TopicPartition

from clawbase.errors import ClawstreamError, CodecError
from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end, where
from clawbase.kafka.publisher import Publisher
from clawbase.settings import KafkaSettings
from producers.proxy.admin import Admin
from producers.proxy.restore import plan_restore, replay_calls
from schemas.events import CallEvent, ProxyRegistration, now_ms
from schemas.topics import CALLS, PROXY_REGISTRATIONS

log = logging.getLogger("clawstream.proxy")


class RegistrationLog:
    """Publishes registration records; knows recent end offsets of the calls topic."""

    def __init__(
        self, kafka: KafkaSettings, publisher: Publisher, timeout_s: float = 30.0, read_timeout_s: float = 120.0
    ) -> None:
        self.kafka, self.publisher, self.timeout_s, self.read_timeout_s = kafka, publisher, timeout_s, read_timeout_s
        self.topic, self.calls_topic = kafka.topic(PROXY_REGISTRATIONS), kafka.topic(CALLS)
        self._offsets: dict[str, int] = {}
        self._reader: Consumer | None = None
        self._reading = threading.Lock()  # the reader is used by one thread at a time, and closed by none then

    def calls_offsets(self) -> dict[str, int]:
        return dict(self._offsets)

    async def write(self, rollout_id: str, record: ProxyRegistration | None) -> None:
        value = None if record is None else record.to_bytes()
        await self.publisher.publish(self.topic, rollout_id, value, self.timeout_s)

    # --- reading (blocking: run in a thread) -------------------------------------------------------------------

    def _consumer(self) -> Consumer:
        if self._reader is None:
            self._reader = make_consumer(self.kafka, f"proxy-restore-{uuid.uuid4().hex[:12]}")
        return self._reader

    def close(self) -> None:
        if self._reading.acquire(timeout=15):  # a refresh still in its thread: leave the reader to the exit
            try:
                if self._reader is not None:
                    self._reader.close()
                    self._reader = None
            finally:
                self._reading.release()

    def end_offsets(self, topic: str) -> dict[int, int]:
        """High watermark of every partition of ``topic``, retried while leadership settles."""
        consumer = self._consumer()
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        ends = {}
        for p in sorted(parts):
            for attempt in range(50):
                try:
                    ends[p] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    break
                except KafkaException as exc:
                    if attempt == 49:
                        raise ClawstreamError(f"cannot read the end of {topic}[{p}]: {exc}") from exc
                    time.sleep(0.2)
        return ends

    def take_calls_offsets(self) -> None:
        """Refresh the snapshot of the calls topic's end offsets (any earlier snapshot stays valid meanwhile)."""
        with self._reading:
            self._offsets = {str(p): end for p, end in self.end_offsets(self.calls_topic).items()}

    def read_latest(self) -> dict[str, ProxyRegistration | None]:
        """The latest record per rollout id (None: a tombstone), from the beginning to the ends taken first."""
        with self._reading:
            return self._read_latest()

    def _read_latest(self) -> dict[str, ProxyRegistration | None]:
        consumer = self._consumer()
        ends = assign_from_beginning(consumer, self.topic, timeout=30)
        latest: dict[str, ProxyRegistration | None] = {}
        try:
            for msg in read_to_end(consumer, self.topic, ends, timeout=self.read_timeout_s):
                partition, offset, key = msg.partition(), msg.offset(), msg.key()
                if partition is None or offset is None or offset >= ends.get(partition, 0) or key is None:
                    continue
                value = msg.value()
                try:
                    latest[key.decode()] = None if value is None else ProxyRegistration.from_bytes(value)
                except CodecError as exc:  # the rollout is not restored rather than restored wrongly
                    log.error("%s: undecodable registration of %s: %s", where(msg), key.decode(errors="replace"), exc)
                    latest[key.decode(errors="replace")] = None
        finally:
            consumer.unassign()
        return latest

    def read_calls(self, starts: dict[int, int], wanted: set[str]) -> list[CallEvent]:
        """Call events keyed by one of ``wanted``, from ``starts`` (per partition; missing: the beginning) to the
        ends taken now. The ends become the calls-offsets snapshot."""
        with self._reading:
            return self._read_calls(starts, wanted)

    def _read_calls(self, starts: dict[int, int], wanted: set[str]) -> list[CallEvent]:
        ends = self.end_offsets(self.calls_topic)
        self._offsets = {str(p): end for p, end in ends.items()}
        todo = {p: end for p, end in ends.items() if starts.get(p, 0) < end}
        if not todo or not wanted:
            return []
        consumer = self._consumer()
        consumer.assign([TopicPartition(self.calls_topic, p, starts.get(p, 0)) for p in sorted(todo)])
        out = []
        try:
            for msg in read_to_end(consumer, self.calls_topic, todo, timeout=self.read_timeout_s):
                partition, offset, key = msg.partition(), msg.offset(), msg.key()
                if partition is None or offset is None or offset >= todo.get(partition, 0) or key is None:
                    continue
                if key.decode(errors="replace") not in wanted:
                    continue
                try:
                    out.append(CallEvent.from_bytes(msg.value() or b""))
                except CodecError as exc:  # its rollout then misses a seq: not restored (infra failure)
                    log.error("%s: undecodable call event: %s", where(msg), exc)
        finally:
            consumer.unassign()
        return out

    async def refresh_offsets(self, every_s: float = 60.0) -> None:
        """Keep the calls-offsets snapshot recent (a shorter read after the next restart); runs until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await asyncio.to_thread(self.take_calls_offsets)
            except (ClawstreamError, KafkaException) as exc:
                log.warning("calls offsets not refreshed (the last snapshot stays): %s", exc)


async def restore_registrations(store: RegistrationLog, admin: Admin) -> tuple[int, int, int]:
    """Put back this proxy's registrations (``admin.public_url`` names it): (registrations, finished attempts
    remembered, calls replayed)."""
    latest = await asyncio.to_thread(store.read_latest)
    plan = plan_restore(latest, admin.public_url, now_ms())
    replaying = [reg for reg in plan.live if not reg.sealed]
    maps = [_partition_offsets(reg) for reg in replaying]  # a partition one of them lacks: from its beginning
    starts = {p: min(m.get(p, 0) for m in maps) for p in set().union(*maps)}
    events = await asyncio.to_thread(store.read_calls, starts, {reg.rollout_id for reg in replaying})
    by_rollout: dict[str, list[CallEvent]] = defaultdict(list)
    for event in events:
        by_rollout[event.rollout_id].append(event)
    replayed = 0
    for reg in plan.live:
        state = None if reg.sealed else replay_calls(admin.template, reg, by_rollout[reg.rollout_id])
        rollout = admin.restore(reg, state)
        replayed += 0 if state is None else state.calls_served
        if rollout.refused:
            log.error("rollout %s: not served after the restart: %s", reg.rollout_id, rollout.refused)
    for reg in plan.finished:
        admin.restore_finished(reg)
    await asyncio.gather(*(store.write(rid, None) for rid in plan.expired))
    return len(plan.live), len(plan.finished), replayed


def _partition_offsets(reg: ProxyRegistration) -> dict[int, int]:
    out = {}
    for p, offset in reg.calls_offsets.items():
        try:
            out[int(p)] = offset
        except ValueError:
            continue
    return out
