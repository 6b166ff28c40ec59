"""Proxy replicas: several proxies behind one public URL (a load balancer), any of them serving any rollout's call.

With ``replica_id`` set, a replica follows the compacted registrations topic in a thread (:class:`RegistrationTail`:
every replica's records) and, before it handles a harness call or an admin request of a rollout, makes its state of
that rollout current (:meth:`Replicas.current`): it takes the topic's end offset, waits until the tail has read that
far, and looks at the rollout's latest record. Naming this replica, with the rollout in memory: current (the usual
case behind a balancer that hashes on the rollout id; it costs one end-offset request). Naming another replica (the
balancer failed over, or calls alternate between replicas): this replica takes the rollout over. It replays the
rollout's own call events from the offsets its registration recorded (``producers.proxy.restore.replay_calls``:
renderer, seq, quotas), writes the record naming itself (acks=all, awaited), and only then serves. Every record is
written, and every call event published, before the answer that follows it is released, so whatever another
replica did is in the log before the harness or the sandbox worker can send the next request.
A finished record or a tombstone drops the rollout from memory. Expired records are tombstoned by any replica.
Not covered: two calls of one rollout in flight at once on two replicas (parallel calls split by a failover) are
both served from the same state; the transcript a seal returns holds only the sealing replica's last main call.
Docs: docs/scaling.md#proxy-replicas.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from confluent_kafka import Consumer, KafkaException, TopicPartition

from clawbase.errors import ClawstreamError, CodecError
from clawbase.kafka.clients import assign_from_beginning, make_consumer, where
from clawbase.kafka.publisher import PublishError
from clawbase.settings import KafkaSettings
from producers.proxy.admin import Admin
from producers.proxy.registry import RegistrationLog, _partition_offsets
from producers.proxy.restore import replay_calls, secret_matches
from schemas.events import ProxyRegistration, now_ms

log = logging.getLogger("clawstream.proxy")


class ReplicaUnavailable(ClawstreamError):
    """The registrations topic could not be read to its end in time: the request is answered 503."""


class RegistrationTail:
    """The latest registration record of every rollout id, read as records are written (a thread of its own)."""

    def __init__(self, kafka: KafkaSettings, topic: str) -> None:
        self.topic = topic
        self.latest: dict[str, ProxyRegistration | None] = {}  # None: a tombstone
        self.positions: dict[int, int] = {}  # partition -> next offset to read (published by the tail thread)
        self._reader = make_consumer(kafka, f"proxy-replica-tail-{uuid.uuid4().hex[:12]}", **{"fetch.wait.max.ms": 20})
        self._ends_reader: Consumer = make_consumer(kafka, f"proxy-replica-ends-{uuid.uuid4().hex[:12]}")
        self._ends_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy-registrations-tail", daemon=True)
        self.error: str | None = None

    def start(self) -> None:
        assign_from_beginning(self._reader, self.topic)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._reader.close()
        with self._ends_lock:
            self._ends_reader.close()

    def _run(self) -> None:
        parts: list[TopicPartition] = []
        while not self._stop.is_set():
            msg = self._reader.poll(0.05)
            raw_key = None if msg is None or msg.error() is not None else msg.key()
            if msg is not None and raw_key is not None:
                key, value = raw_key.decode(errors="replace"), msg.value()
                try:
                    self.latest[key] = None if value is None else ProxyRegistration.from_bytes(value)
                except CodecError as exc:  # never taken over rather than taken over wrongly
                    log.error("%s: undecodable registration of %s: %s", where(msg), key, exc)
                    self.latest[key] = None
            elif msg is not None and msg.error() is not None:
                log.warning("registrations tail: %s", msg.error())
            try:  # the position, not last offset + 1: it moves past transaction markers too
                parts = parts or self._reader.assignment()
                for tp in self._reader.position(parts):
                    if tp.offset >= 0:
                        self.positions[tp.partition] = tp.offset
            except KafkaException as exc:
                log.warning("registrations tail position: %s", exc)

    def ends(self, timeout: float) -> dict[int, int]:
        """High watermark of each partition that holds records (blocking: run in a thread)."""
        with self._ends_lock:
            try:
                meta = self._ends_reader.list_topics(self.topic, timeout=timeout).topics[self.topic]
                out = {}
                for p in sorted(meta.partitions):
                    low, high = self._ends_reader.get_watermark_offsets(
                        TopicPartition(self.topic, p), timeout=timeout, cached=False
                    )
                    if high > low:
                        out[p] = high
                return out
            except KafkaException as exc:
                raise ReplicaUnavailable(f"cannot read the end of {self.topic}: {exc}") from exc

    def read(self, ends: dict[int, int]) -> bool:
        return all(self.positions.get(p, -1) >= end for p, end in ends.items())


class Replicas:
    """Keeps one replica's rollouts current with what the other replicas did (see the module docstring)."""

    def __init__(self, admin: Admin, store: RegistrationLog, tail: RegistrationTail, replica_id: str, wait_s: float):
        self.admin, self.store, self.tail, self.replica_id, self.wait_s = admin, store, tail, replica_id, wait_s
        self._locks: dict[str, tuple[int, asyncio.Lock]] = {}  # rid -> (users, lock): one takeover at a time
        self.takeovers = 0
        self.sweeping: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self.sweeping is not None:
            self.sweeping.cancel()
        await asyncio.to_thread(self.tail.close)

    async def caught_up(self) -> None:
        """Wait until the tail has read every record written before now (ReplicaUnavailable past wait_s)."""
        deadline = time.monotonic() + self.wait_s
        ends = await asyncio.to_thread(self.tail.ends, self.wait_s)
        while not self.tail.read(ends):
            if time.monotonic() > deadline:
                raise ReplicaUnavailable(f"the registrations topic was not read to {ends} within {self.wait_s:.0f}s")
            await asyncio.sleep(0.002)

    async def current(self, rid: str, key: str | None = None) -> None:
        """Make this replica's state of ``rid`` the latest one, taking the rollout over when another replica holds
        it. ``key``: a harness call's API key; a rollout is taken over for a call only when it is the rollout's
        secret (a stray call must not move rollouts between replicas). Raises ReplicaUnavailable (the caller
        answers 503)."""
        users, lock = self._locks.get(rid, (0, asyncio.Lock()))
        self._locks[rid] = (users + 1, lock)
        try:
            async with lock:
                await self._current(rid, key)
        except ClawstreamError:
            raise
        except Exception as exc:  # never a 500: logged with its traceback, answered 503 (the client retries)
            log.exception("rollout %s: making this replica's state current failed", rid)
            raise ReplicaUnavailable(f"rollout {rid}: {type(exc).__name__}: {exc}") from exc
        finally:
            users, _ = self._locks[rid]
            if users == 1:
                del self._locks[rid]
            else:
                self._locks[rid] = (users - 1, lock)

    async def _current(self, rid: str, key: str | None) -> None:
        await self.caught_up()
        record = self.tail.latest.get(rid)
        if record is None:  # never registered, or forgotten with nothing to remember
            if rid in self.tail.latest:
                self.admin.forget_finished(rid)
                self.admin.drop(rid)
            return
        if record.finished:
            self.admin.drop(rid)
            self.admin.restore_finished(record)
            return
        if record.replica == self.replica_id and rid in self.admin.rollouts:
            return
        self.admin.drop(rid)  # what this replica holds of it is stale: another replica's state is the latest
        if record.expires_at_ms < now_ms() or (key is not None and not secret_matches(key, record.secret_sha256)):
            return  # expired (swept later), or not this rollout's key: the call is refused as unknown
        t0 = time.perf_counter()
        state = None
        if not record.sealed:
            try:
                events = await asyncio.to_thread(self.store.read_calls, _partition_offsets(record), {rid})
            except (ClawstreamError, KafkaException) as exc:
                raise ReplicaUnavailable(f"cannot read rollout {rid}'s call events: {exc}") from exc
            state = replay_calls(self.admin.template, record, events)
        self.admin.forget_finished(rid)
        rollout = self.admin.restore(record, state)
        try:
            await self.admin.sync(rid)
        except PublishError as exc:
            self.admin.drop(rid)
            raise ReplicaUnavailable(f"rollout {rid}: the takeover could not be recorded: {exc}") from exc
        self.takeovers += 1
        self.admin.metrics.takeovers.inc()
        log.info(
            "rollout %s: taken over from replica %r (%d calls replayed in %.3f s)%s",
            rid,
            record.replica,
            rollout.calls_served,
            time.perf_counter() - t0,
            f"; not served: {rollout.refused}" if rollout.refused else "",
        )

    def forget_stale(self) -> list[str]:
        """Drop rollouts another replica took over since (their memory); tombstone-worthy expired records' ids."""
        now = now_ms()
        for rid in list(self.admin.rollouts):
            record = self.tail.latest.get(rid)
            if rid in self.tail.latest and (record is None or record.replica != self.replica_id):
                self.admin.drop(rid)
        return [rid for rid, rec in list(self.tail.latest.items()) if rec is not None and rec.expires_at_ms < now]

    async def sweep(self, every_s: float = 30.0) -> None:
        """Forget what other replicas took over and tombstone expired records (any replica may); until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            for rid in self.forget_stale():
                try:
                    await self.store.write(rid, None)
                except PublishError as exc:
                    log.warning("expired registration %s not tombstoned: %s", rid, exc)


async def start_replicas(
    admin: Admin, store: RegistrationLog, kafka: KafkaSettings, replica_id: str, wait_s: float
) -> Replicas:
    """Follow the registrations topic, read it to its end, have ``admin`` make each rollout current through the
    replicas before a request of it (:meth:`Admin.follow`) and start the sweep; :meth:`Replicas.close` stops both."""
    tail = RegistrationTail(kafka, store.topic)
    try:
        await asyncio.to_thread(tail.start)
        replicas = Replicas(admin, store, tail, replica_id, wait_s)
        await replicas.caught_up()
        await asyncio.to_thread(store.take_calls_offsets)  # where new registrations' call events start
    except BaseException:
        tail.close()
        raise
    admin.follow(replicas)
    replicas.sweeping = asyncio.ensure_future(replicas.sweep())
    known = sum(r is not None for r in tail.latest.values())
    log.info("replica %r: %d registrations known; a rollout is taken over on its first request here", replica_id, known)
    return replicas
