"""Exactly-once for the Faust app: one Kafka transaction per partition number of the co-partitioned topics (Kafka
Streams' task), committed only between two records, plus a fix to Faust's resume order that both guarantees need.

faust-streaming 0.15's ``processing_guarantee="exactly_once"`` gets the following wrong, found with the fault tests;
docs/method.md#exactly-once-in-the-stream-processors tells each (what was measured, why the fix works), numbered as
here. This module patches them:

1. every send goes into the transaction of the *source* partition being processed
   (:class:`SourcePartitionTransactionManager`);
2. table changelog writes wait for the commit, which hands them over first (:class:`ChangelogBuffer`);
3. commits happen between records: agents process each record inside :func:`processing`, and a commit waits for the
   records in progress (:class:`CommitGate`, :class:`EosConsumer`);
4. (both guarantees) seek to the committed offsets before the stream partitions resume (:func:`patch_faust_resume`);
5. RocksDB tables left by an unclean stop are wiped and rebuilt from the changelogs (:func:`prepare_rocksdb`);
6. a partition's offset commits one past its highest acknowledged record (``EosConsumer._new_offset``);
7. recovery asks the broker where each changelog ends (:class:`EosConsumerThread`);
8. a rebalance commits every transaction before Faust drops the acknowledged offsets
   (``EosConsumer.on_partitions_revoked``); a worker evicted meanwhile exits at once (``close_dirty``);
9. (both guarantees) a stream partition never committed is read from its start after a rebalance
   (:func:`seek_uncommitted_to_start`);
10. Faust's commit-livelock check learns of the transactional commits (``EosConsumer._record_commit_round``), so it
    reports only a partition whose commits stopped, not every exactly-once worker.

Use: :func:`install`; agents call :func:`start_agent`, then process each record in :func:`processing`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from time import monotonic
from typing import Any, NoReturn, cast

import faust
from aiokafka import TopicPartition as AioTopicPartition
from faust.streams import current_event
from faust.tables.recovery import Recovery
from faust.transport.consumer import TransactionManager
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import AppT
from faust.types.tuples import FutureMessage

log = logging.getLogger(__name__)
CLEAN_MARKER = ".clean-shutdown"


EVICTED_EXIT = 75  # EX_TEMPFAIL: a supervisor restarts the worker


def close_dirty(reason: str) -> NoReturn:
    """Exit now, committing and sending nothing more: the worker was evicted or fenced (point 8).

    Its tables may miss what the worker that took its partitions over did meanwhile, and Faust would keep them for a
    partition assigned back to it (neither revoked nor new from where it stands), so it must not process another
    record. Faust's own crash is asynchronous and let the rejoin go on: an evicted worker got its old partitions
    back, processed them on stale tables and committed, and a group lost a member. Open transactions are aborted by
    the next owner's initialisation; a restart rebuilds the tables from the changelogs (RocksDB ones are wiped: no
    clean-shutdown marker).
    """
    log.critical("eos: closing dirty: %s", reason)
    logging.shutdown()
    os._exit(EVICTED_EXIT)


class SourcePartitionTransactionManager(TransactionManager):
    """Route each send to the transaction of the source partition being processed (module docstring, point 1)."""

    _changelogs: frozenset[str] | None = None

    def _changelog_topics(self) -> frozenset[str]:
        if self._changelogs is None:
            self._changelogs = frozenset(t.changelog_topic.get_topic_name() for t in self.app.tables.values())
        return self._changelogs

    async def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        partition: int | None,
        timestamp: float | None,
        headers: Any,
        *,
        transactional_id: str | None = None,
    ) -> Any:
        if topic in self._changelog_topics():  # explicit partition = the source partition: Faust's routing is right
            return await super().send(topic, key, value, partition, timestamp, headers)
        event = current_event()
        tid = None
        if event is not None:
            msg = event.message
            tid = f"{self.app.conf.id}-{self.app.assignor.group_for_topic(msg.topic)}-{msg.partition}"
        return await self.producer.send(topic, key, value, partition, timestamp, headers, transactional_id=tid)

    async def on_rebalance(self, assigned: Any, revoked: Any, newly_assigned: Any) -> None:
        """Stop the producer of every transactional id this worker no longer owns, then start the owned ones.

        Faust stops only the ids of the partitions it computes as revoked, and that set came out empty when a
        second worker joined: the first kept the producers of the partitions it gave away, got them back at the
        next rebalance and sent into transactions the other worker had fenced (``ProducerFenced``, then
        ``IllegalOperation`` in the commit and a crashed worker). A fresh producer re-initialises its id, fencing
        whoever held it before.
        """
        owned = self._tps_to_transactional_ids(assigned)
        held = set(cast(Any, self.producer)._transaction_producers)
        if gone := sorted(held - owned):
            log.info("eos: stopping %d transactional producer(s) no longer owned: %s", len(gone), gone)
            await self._stop_transactions(gone)
        await super().on_rebalance(assigned, set(), newly_assigned)

    async def commit(self, offsets: Any, start_new_transaction: bool = True) -> bool:
        await flush_changelog(self.app)
        return await super().commit(offsets, start_new_transaction=start_new_transaction)


class CommitGate:
    """Commits happen between records (module docstring, point 3): records wait while a commit runs, a commit waits
    until the records in progress are done. Records of different agents still run concurrently with each other."""

    def __init__(self) -> None:
        self.in_progress = 0
        self.committing = False
        self.commits = 0  # finished commits (tests read it)
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def record(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.committing)
            self.in_progress += 1
        try:
            yield
        finally:
            # Faust acknowledges the record synchronously when the agent's loop asks for the next one, before the
            # agent yields to the event loop again: a commit woken here reads the offsets after that acknowledgement.
            async with self._changed:
                self.in_progress -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def commit(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self.committing)
            self.committing = True
            await self._changed.wait_for(lambda: self.in_progress == 0)
        try:
            yield
        finally:
            async with self._changed:
                self.committing = False
                self.commits += 1
                self._changed.notify_all()


_GATES: dict[int, CommitGate] = {}


def gate(app: AppT) -> CommitGate:
    return _GATES.setdefault(id(app), CommitGate())


class EosConsumer(faust_aiokafka.Consumer):
    """Faust's consumer whose commits pass through the app's :class:`CommitGate` and whose recovery reads where the
    changelogs end from the broker (:class:`EosConsumerThread`)."""

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return EosConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def force_commit(self, topics: Any = None, start_new_transaction: bool = True) -> bool:
        async with gate(self.app).commit():
            # All partitions, not just ``topics``: the transactions being committed hold every record processed since
            # the last commit, so every acknowledged offset must go with them.
            done = await super().force_commit(None, start_new_transaction=start_new_transaction)
            self._record_commit_round()
            return done

    def _record_commit_round(self) -> None:
        """Tell Faust's commit-livelock check which partitions are committed up to date (point 10).

        The check (``AIOKafkaConsumerThread.verify_event_path``) reports a partition that has records past the
        fetch position, processed a record within ``stream_processing_timeout`` and has no entry in
        ``tp_last_committed_at`` newer than ``broker_commit_livelock_soft_timeout``; only Faust's non-transactional
        commit writes that entry, so every exactly-once worker was reported as never having committed. A finished
        commit round leaves a partition with nothing acknowledged and uncommitted up to date (whether or not it had
        anything to commit: an idle partition is not stuck); a commit that hangs, a record that never finishes (the
        round waits for it) or a crash records nothing, so a partition stuck that way is still reported.
        """
        thread = getattr(self, "_thread", None)
        if thread is None or self.app.crash_reason is not None:
            return
        now = monotonic()
        thread.tp_last_committed_at.update({tp: now for tp in self.assignment() if not self._acked.get(tp)})

    async def on_partitions_revoked(self, revoked: Any) -> None:
        """Commit every partition's transaction while still a group member, then let Faust revoke (point 8).

        Faust drops the acknowledged offsets of the revoked partitions first and then waits for the streams, so
        what was processed since the last commit stayed in open transactions without its offsets; a partition the
        worker got back was sought to the last commit and processed a second time into the same transaction. Here
        the flow stops, the records in progress finish, and everything acknowledged commits with its outputs and
        table writes, before anything is dropped. A worker evicted meanwhile (its partitions taken over, its
        producers fenced) exits at once instead (:func:`close_dirty`).
        """
        if self.app.in_transaction and self.assignment() and self._evicted():
            close_dirty("evicted from the consumer group while alive (heartbeats lapsed past the session timeout)")
        if self.app.in_transaction and not self.app.should_stop and self.assignment():
            self.stop_flow()
            self.app.flow_control.suspend()
            self.app.flow_control.clear()
            await self.wait_empty()  # waits for the records in progress, committing as they are acknowledged
            await self.force_commit(None)  # a periodic commit running meanwhile made wait_empty's last one a no-op
            if self.app.crash_reason is not None:  # Faust turns ProducerFenced in a commit into a crash
                close_dirty(f"the commit before revoking failed: {self.app.crash_reason!r}")
            log.info("eos: committed every partition's transaction before revoking %d partition(s)", len(revoked))
        await super().on_partitions_revoked(revoked)

    def _evicted(self) -> bool:
        """True when the group dropped this member (heartbeats lapsed): aiokafka reset its generation to -1."""
        consumer = getattr(getattr(self, "_thread", None), "_consumer", None)
        coordinator = getattr(consumer, "_coordinator", None)
        return getattr(coordinator, "generation", 0) == -1

    def _new_offset(self, tp: Any) -> int | None:
        """The offset to commit for ``tp``: one past the highest acknowledged record (module docstring, point 6).

        Each of our topics is read by one agent, in order, so every record below the highest acknowledged one has
        been processed. Faust's own rule commits only up to the first hole in the acknowledged offsets that it has
        not recorded as a gap, and transaction markers and aborted records leave such holes.
        """
        acked = self._acked[tp]
        if not acked:
            return None
        top = max(acked) + 1
        faust = _faust_offset(sorted(acked), self._committed_offset[tp], self._gap[tp])
        if faust != top:
            log.debug(
                "eos: %s: committing %d where Faust's rule gives %s (acked %s..%s, committed %s)",
                tp,
                top,
                faust,
                min(acked),
                max(acked),
                self._committed_offset[tp],
            )
        acked.clear()
        self._acked_index[tp].clear()
        if self._gap[tp]:
            self._gap[tp].chop(0, top)
        return top


def _faust_offset(acked: list[int], committed: int | None, gaps: Any) -> int | None:
    """What faust-streaming 0.15's ``Consumer._new_offset`` would return (without changing anything)."""
    filled = set(acked)
    for iv in gaps.overlap(0, max(acked)) if gaps else ():
        filled.update(range(iv.begin, iv.end))
    ordered = sorted(filled)
    if committed and ordered[0] - committed > 1:
        return None
    end = ordered[0]
    for x in ordered[1:]:
        if x != end + 1:
            break
        end = x
    return end + 1


class EosConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer thread with changelog ends read from the broker (module docstring, point 7)."""

    async def _highwaters(self, partitions: Any) -> Any:
        return await committed_end_offsets(self._ensure_consumer(), partitions)


async def committed_end_offsets(consumer: Any, partitions: Any) -> dict[Any, int]:
    """Where each partition ends for a ``read_committed`` consumer: the last stable offset, asked of the broker.

    aiokafka's ``end_offsets`` sends ListOffsets with the consumer's isolation level, so for a ``read_committed``
    consumer the broker answers the LSO (an open transaction's records are not yet readable); unlike
    ``last_stable_offset`` it does not depend on a fetch having happened.
    """
    if getattr(consumer, "_isolation_level", None) != "read_committed":  # aiokafka keeps the name it was given
        raise RuntimeError("committed_end_offsets needs a read_committed consumer")
    return dict(await consumer.end_offsets(list(partitions)))


class EosProducer(faust_aiokafka.Producer):
    """Faust's producer, committing the partition numbers' transactions concurrently instead of one after another.

    The transactions are independent (one per partition number, each with its own producer and connection), and
    every record waits at the :class:`CommitGate` while they commit: one round of AddOffsetsToTxn / TxnOffsetCommit /
    EndTxn for all of them, not nine in a row, keeps that pause short. Every commit is awaited before the first error
    (if any) is raised, so the caller sees the same failure as with Faust's loop, after the others finished.
    """

    async def commit_transactions(
        self, tid_to_offset_map: Any, group_id: str, start_new_transaction: bool = True
    ) -> None:
        one = super().commit_transactions
        commits = [
            one({tid: offsets}, group_id, start_new_transaction=start_new_transaction)
            for tid, offsets in tid_to_offset_map.items()
        ]
        results = await asyncio.gather(*commits, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


class EosTransport(faust_aiokafka.Transport):
    TransactionManager = SourcePartitionTransactionManager
    Consumer = EosConsumer
    Producer = EosProducer


class ChangelogBuffer:
    """Holds table changelog messages until the commit (or :func:`flush_changelog`) hands them to the producer.

    Only a key's last write since the last flush is sent: a changelog is compacted and restored in order, so earlier
    writes of the same key in the same transaction change nothing a recovery sees (a rollout's state, rewritten by
    every one of its records, or a partition's due index, rewritten by every tick that settles something, then
    costs one changelog message per commit instead of one per record). The local store was written at once.
    """

    def __init__(self) -> None:
        self.pending: dict[Any, FutureMessage] = {}
        self.puts = 0  # changelog writes the tables made (a test reads it)

    def put(self, fut: FutureMessage) -> None:
        msg = fut.message
        try:
            slot: Any = (msg.channel.get_topic_name(), msg.partition, msg.key)  # type: ignore[attr-defined]
            hash(slot)
        except TypeError:  # an unhashable key: keep every write
            slot = id(fut)
        self.pending.pop(slot, None)  # re-inserted at the end: the last write of a key goes out after the others
        self.pending[slot] = fut
        self.puts += 1

    async def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, {}
            for fut in batch.values():
                await fut.message.channel.publish_message(fut, wait=False)


_BUFFERS: dict[int, ChangelogBuffer] = {}


def install(app: faust.App) -> None:
    """Use the source-partition transaction manager and the changelog buffer (exactly-once apps only)."""
    app.transport = EosTransport(app.conf.broker_consumer, app)


def _buffer(app: AppT) -> ChangelogBuffer | None:
    if not app.in_transaction:
        return None
    buf = _BUFFERS.get(id(app))
    if buf is None:
        buf = _BUFFERS[id(app)] = ChangelogBuffer()
        app.producer.buffer.put = buf.put  # type: ignore[method-assign]  # tables call producer.buffer.put
    return buf


def start_agent(app: AppT) -> None:
    """Call at the top of every agent (before any table write) so changelog writes are captured."""
    _buffer(app)


@contextlib.asynccontextmanager
async def processing(app: AppT) -> AsyncIterator[None]:
    """Wrap the processing of one record (decode → state → outputs → :func:`flush_changelog`): no commit runs inside
    it (module docstring, point 3). A no-op without exactly-once."""
    if not app.in_transaction:
        yield
        return
    async with gate(app).record():
        yield


async def flush_changelog(app: AppT) -> None:
    """Hand the table changelog writes made so far to the producer (in the current transactions). The commit does
    it before it commits (inside the gate); an agent may call it at the end of a record, but need not."""
    buf = _buffer(app)
    if buf is not None:
        await buf.flush()


async def send_untransacted(app: AppT) -> None:
    """Send now what was produced outside any transaction (the ticks), instead of after the producer's linger."""
    plain = getattr(app.producer, "_producer", None)  # Faust's aiokafka producer for sends without a transaction
    if plain is not None:
        await plain.flush()


def prepare_rocksdb(tabledir: Path, *, exactly_once: bool) -> bool:
    """Before start: wipe RocksDB tables a crashed run may have left with aborted writes. True if wiped."""
    marker = tabledir / CLEAN_MARKER
    clean = marker.exists()
    marker.unlink(missing_ok=True)
    if exactly_once and not clean and tabledir.exists() and any(tabledir.iterdir()):
        log.warning(
            "no clean-shutdown marker in %s: wiping local tables, they are rebuilt from the changelogs", tabledir
        )
        shutil.rmtree(tabledir)
        return True
    return False


def mark_clean_shutdown(tabledir: Path) -> None:
    if tabledir.exists():
        (tabledir / CLEAN_MARKER).touch()


async def _seek_then_resume(recovery: Recovery) -> None:
    """Seek the (still paused) stream partitions to their committed offsets, empty and resume the agents' flow,
    then let the stream partitions fetch: nothing fetched before the seek can be cleared away afterwards."""
    app, consumer = recovery.app, recovery.app.consumer
    assignment = consumer.assignment()
    if assignment:
        recovery.log.info("Seek stream partitions to committed offsets.")
        await recovery._wait(consumer.perform_seek(), timeout=app.conf.broker_request_timeout)
        streams = {tp for tp in assignment if not recovery._is_changelog_tp(tp)}
        await recovery._wait(seek_uncommitted_to_start(consumer, streams), timeout=app.conf.broker_request_timeout)
    recovery.completed.set()
    app.flow_control.resume()  # clears the agents' queues: they hold nothing from the stream partitions yet
    consumer.resume_flow()
    consumer.resume_partitions({tp for tp in assignment if not recovery._is_changelog_tp(tp)})
    await cast(Any, app)._fetcher.maybe_start()


async def seek_uncommitted_to_start(consumer: Any, partitions: set[Any]) -> list[Any]:
    """Seek each stream partition with no committed offset to its first offset (module docstring, point 9).

    aiokafka's ``seek_to_committed`` seeks only partitions whose committed offset is above 0 and leaves the others
    where the fetcher got to. A partition kept through a rebalance before its first commit had records fetched and
    then cleared from the agents' queues; without this seek they were skipped, and the next commit went past them
    (seen in the zombie test: the first trajectories of a partition never reached ``by-group``, groups closed by
    their timeout one member short). Returns the partitions sought.
    """
    committed = await consumer.seek_to_committed()
    fresh = sorted(tp for tp in partitions if not committed.get(tp))
    if fresh:
        log.info("eos: %d stream partition(s) never committed: reading them from their start: %s", len(fresh), fresh)
        # aiokafka wants its own TopicPartition; the delegating consumer does not expose the call.
        await consumer._thread.seek_to_beginning(*(AioTopicPartition(tp.topic, tp.partition) for tp in fresh))
        for tp in fresh:
            consumer._read_offset.pop(tp, None)
    return fresh


async def _on_recovery_completed(self: Recovery, generation_id: int = 0) -> None:
    """Faust's ``Recovery.on_recovery_completed`` with the resume order fixed (module docstring, point 3)."""
    self.log.info("Restore complete!")
    await self.app.on_rebalance_complete.send()
    self._set_recovery_ended()
    callbacks = [
        asyncio.ensure_future(t.on_recovery_completed(self.actives_for_table[t], self.standbys_for_table[t]))
        for t in self.tables.values()
    ]
    if callbacks:
        await asyncio.wait(callbacks)
    if self.app.consumer_generation_id != generation_id:
        self.log.warning(
            "Recovery rebalancing again app id %s param %s", self.app.consumer_generation_id, generation_id
        )
        return
    await _seek_then_resume(self)
    self.tables.on_actives_ready()
    if not self.app.assignor.assigned_standbys():
        self.tables.on_standbys_ready()
    self.app.on_rebalance_end()
    self.log.info("Worker ready")


async def _resume_streams(self: Recovery, generation_id: int = 0) -> None:
    """Faust's ``Recovery._resume_streams`` (no recovery needed) with the resume order fixed."""
    await self.app.on_rebalance_complete.send()
    if self.app.consumer_generation_id != generation_id:
        self.log.warning("Recovery rebalancing again")
        return
    await _seek_then_resume(self)
    self.tables.on_actives_ready()
    self.tables.on_standbys_ready()
    self.app.on_rebalance_end()
    self.log.info("Worker ready")


def patch_faust_resume() -> None:
    """Install the fixed resume order (idempotent; both processing guarantees need it)."""
    Recovery.on_recovery_completed = _on_recovery_completed  # type: ignore[method-assign]
    Recovery._resume_streams = _resume_streams  # type: ignore[method-assign]
