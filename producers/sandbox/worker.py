"""Sandbox worker: runs rollout requests in sandboxes through real harnesses, publishing lifecycle events and rewards.

Topics: in ``clawstream.rollout.requests`` (consumer group ``CLAWSTREAM_SANDBOX_GROUP_ID``, cooperative-sticky
assignment, manual commits); out ``clawstream.rollout.events`` and ``clawstream.rewards`` (exactly one per attempt),
keyed by rollout id and acknowledged (acks=all) before the request counts as done. Poison (undecodable, a request
that makes no sense here, a duplicate: :meth:`SandboxWorker._take`) goes to ``clawstream.deadletter`` with the
reason, its offset is committed, and the worker goes on (docs/faults.md#poison). One attempt =
``producers.sandbox.rollout.execute``. Up to ``concurrency`` rollouts run at once on one asyncio loop; when full,
the partitions are paused but ``poll`` keeps running (the group sees no stall).
Commits: per partition, the lowest offset still in flight (``producers.sandbox.offsets``), after the request's terminal
events were acknowledged. If Kafka refuses a terminal event, the worker stops without committing it (exit code 1).
Rebalances (docs/faults.md#sandbox-worker-rebalances): a partition kept across one keeps its fetch position and its
in-flight offsets. A record redelivered while its attempt still runs here (same topic, partition, offset: the
partition went and came back) starts nothing; its offset is committed once that attempt finishes. A partition that
really moves away: its running attempts finish and publish their terminal events, but commit nothing. Its new owner
gets the request again and asks the proxy (``execute`` returns ``held``): while the attempt holding the rollout id
renews its lease, it waits (taking no concurrency slot); once that attempt finished, it commits the offset without
running it; a lease that lapsed (the holder's worker died) is revoked, scoped to that attempt id, and the request
re-run under a new attempt id.
A dead worker's harness died with it (``PR_SET_PDEATHSIG``) and its sandbox is removed by any worker's sweep.

Run: ``python -m producers.sandbox.worker [--concurrency N] [--proxy-url URL]`` (admin token in
``CLAWSTREAM_SANDBOX_PROXY_ADMIN_TOKEN``)
(env ``CLAWSTREAM_SANDBOX_*``, Kafka from ``CLAWSTREAM_KAFKA_*``); SIGTERM finishes running rollouts, then exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from clawbase.errors import ClawstreamError, CodecError, TopicError
from clawbase.kafka.clients import check_broker, make_consumer, where
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from producers.harnesses.base import HarnessAdapter
from producers.harnesses.catalog import all_adapters
from producers.sandbox.base import SandboxBackend, SandboxError
from producers.sandbox.docker_backend import DockerBackend
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.offsets import OffsetTracker, Partition, SeenRequests, open_store, seen_path
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.relay import raise_open_files_limit
from producers.sandbox.rollout import Outcome, RolloutContext, execute, new_attempt_id
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.model import TaskError
from schemas.dead_letter import dead_letter_of
from schemas.events import RewardEvent, RewardStatus, RolloutEvent, RolloutRequest, RolloutState, now_ms
from schemas.lifecycle import transition
from schemas.topics import DEADLETTER, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS

log = logging.getLogger("clawstream.sandbox_worker")


def nonsense(req: RolloutRequest, ctx: RolloutContext) -> str | None:
    """Why a decoded request cannot be run here, or None. Checked before anything is registered or created."""
    rid = req.rollout_id
    if not rid or not all(c.isalnum() or c in "-_." for c in rid):  # the proxy's rule for rollout ids
        return f"rollout_id {rid[:200]!r}: letters, digits, '-', '_', '.' only, not empty"
    if req.attempt < 0:
        return f"attempt {req.attempt} < 0"
    if math.isnan(req.timeout_s) or req.timeout_s < 0:
        return f"timeout_s {req.timeout_s}: must be >= 0 (0: the task's)"
    if req.harness not in ctx.adapters:
        return f"unknown harness {req.harness!r}; known: {', '.join(sorted(ctx.adapters))}"
    try:
        ctx.catalog.task(req.suite, req.task_id)
    except TaskError as exc:  # unknown suite or task (or a configured suite that does not load)
        return str(exc)
    return None


def make_backend(settings: SandboxSettings) -> SandboxBackend:
    """The sandbox backend the settings name (``local`` or ``docker``)."""
    return DockerBackend(settings) if settings.backend == "docker" else LocalBackend(settings)


class KafkaSink:
    """EventSink publishing to Kafka and waiting for each acknowledgement."""

    def __init__(self, publisher: KafkaPublisher, kafka: KafkaSettings, timeout_s: float) -> None:
        self.publisher, self.kafka, self.timeout_s = publisher, kafka, timeout_s

    async def event(self, event: RolloutEvent) -> None:
        await self.publisher.publish(
            self.kafka.topic(ROLLOUT_EVENTS), event.rollout_id, event.to_bytes(), self.timeout_s
        )

    async def reward(self, reward: RewardEvent) -> None:
        await self.publisher.publish(self.kafka.topic(REWARDS), reward.rollout_id, reward.to_bytes(), self.timeout_s)


def exe_resolver(settings: SandboxSettings):  # noqa: ANN201 - returns an ExeResolver
    async def resolve(adapter: HarnessAdapter) -> tuple[str, str]:
        if adapter.install is None:
            return "", ""
        from producers.harnesses.install import (
            MARKER,
            NODE24,
            HarnessInstallError,
            executable,
            harness_root,
            install_adapter,
            install_node24,
            package_of,
        )

        pkg = package_of(adapter)
        assert pkg is not None
        if pkg.kind == "path":  # a user's executable, used as it is; its directory bound read-only and on PATH
            if not Path(pkg.package).is_file():
                raise SandboxError(f"harness {adapter.name}: install = {pkg.package!r} is not a file")
            return pkg.package, str(Path(pkg.package).parent)
        if settings.backend == "docker":  # installed in the sandbox image by the same installer (same layout)
            root = harness_root(Path(settings.docker_harness_home))
            node = str(executable(NODE24, root).parent) if adapter.node24 else ""
            return str(executable(pkg, root)), node

        if not settings.install_harnesses:  # use what is installed, whatever its version
            root = harness_root()
            exe_path = executable(pkg, root)
            if not (root / pkg.name / MARKER).exists() or not exe_path.exists():
                raise SandboxError(f"harness {adapter.name} is not installed and install_harnesses is off")
            node = str(executable(NODE24, root).parent) if adapter.node24 else ""
            return str(exe_path), node
        try:
            exe = await asyncio.to_thread(install_adapter, adapter)
            extra = str((await asyncio.to_thread(install_node24)).parent) if adapter.node24 else ""
        except HarnessInstallError as exc:
            raise SandboxError(f"harness {adapter.name}: {exc}") from exc
        return str(exe), extra

    return resolve


class SandboxWorker:
    def __init__(
        self,
        settings: SandboxSettings,
        kafka: KafkaSettings,
        *,
        adapters: Mapping[str, HarnessAdapter] | None = None,
        backend: SandboxBackend | None = None,
        catalog: SuiteCatalog | None = None,
        keep_outcomes: bool = False,
    ) -> None:
        self.settings, self.kafka = settings, kafka
        self.keep_outcomes = keep_outcomes
        self.publisher = KafkaPublisher(kafka, settings.publish_timeout_s)
        proxy = ProxyAdmin(
            settings.proxy_url, settings.proxy_admin_token, settings.proxy_timeout_s, settings.proxy_connect_retries
        )
        self.ctx = RolloutContext(
            backend=backend or make_backend(settings),
            proxy=proxy,
            catalog=catalog or SuiteCatalog(settings.suites),
            adapters=adapters if adapters is not None else all_adapters(extra_files=settings.harness_files),
            sink=KafkaSink(self.publisher, kafka, settings.publish_timeout_s),
            settings=settings,
            resolve_exe=exe_resolver(settings),
        )
        if settings.worker_id:
            self.ctx.worker_id = settings.worker_id
        self.tracker = OffsetTracker()
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: dict[tuple[Partition, int], asyncio.Task[None]] = {}  # (partition, offset) → its attempt
        self.owned: set[Partition] = set()  # the current assignment
        self.waiting = 0  # requests waiting for another attempt of theirs to end: they hold no sandbox
        # Every outcome only with keep_outcomes (benches read them): a serving worker finishes 10^5–10^6 rollouts,
        # each outcome ~1.3 KB (its reward, timings, cleanup report); it counts them in ``finished``.
        self.outcomes: list[Outcome] = []
        self.finished = 0
        self.seen = SeenRequests(settings.seen_cache_size)  # on disk from run() on (seen_dir)
        self.fatal: BaseException | None = None
        self._consumer = None
        self._paused = False
        self._reassigned = False  # an assignment came in: set its pause state again (see _on_assign)
        self._stopping = False

    # --- consumer callbacks (run inside poll, on the loop's thread) ---------------------------------------------
    # Cooperative-sticky: each callback gets only the partitions that change; Consumer_rebalance_cb then calls
    # incremental_assign / incremental_unassign itself (the callbacks assign nothing).

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:  # noqa: ANN001
        self.owned.update((p.topic, p.partition) for p in partitions)
        log.info("assigned %s", [f"{p.topic}[{p.partition}]" for p in partitions])
        # librdkafka keeps a partition's pause flag across its loss and re-assignment (a broker restart: the worker
        # paused while full, its partitions lost, then assigned again — it fetched nothing for good): the loop sets
        # the pause state of the whole assignment again on its next turn.
        self._reassigned = True

    def _on_revoke(self, consumer, partitions: list[TopicPartition]) -> None:  # noqa: ANN001
        tps = [(p.topic, p.partition) for p in partitions]
        self._commit(only=set(tps))
        self._release(tps)
        log.info("revoked %s", [f"{t}[{p}]" for t, p in tps])

    def _on_lost(self, consumer, partitions: list[TopicPartition]) -> None:  # noqa: ANN001
        tps = [(p.topic, p.partition) for p in partitions]
        self._release(tps)  # no commit: the group already gave them to another member
        log.warning("lost %s", [f"{t}[{p}]" for t, p in tps])

    def _release(self, tps: list[Partition]) -> None:
        # Rollouts still running there finish and publish their terminal events, but are no longer ours to commit.
        self.tracker.forget(tps)
        self.owned.difference_update(tps)

    def _commit(self, only: set[tuple[str, int]] | None = None) -> None:
        points = {tp: off for tp, off in self.tracker.commit_points().items() if only is None or tp in only}
        if not points or self._consumer is None:
            return
        try:
            self._consumer.commit(
                offsets=[TopicPartition(t, p, off) for (t, p), off in points.items()], asynchronous=False
            )
        except KafkaException as exc:  # e.g. a rebalance is in progress: retried on the next turn
            log.warning("commit of %s failed: %s", points, exc)
            return
        for tp, off in points.items():
            self.tracker.committed(tp, off)
            self.seen.committed(tp, off)
            log.debug("committed %s[%d]@%d", tp[0], tp[1], off)

    # --- main loop ----------------------------------------------------------------------------------------------

    async def _run_one(self, req: RolloutRequest, tp: Partition, offset: int) -> None:
        waiting = False
        try:
            while True:
                try:
                    outcome = await execute(req, self.ctx)
                except Exception as exc:  # noqa: BLE001 - PublishError above all; anything else is a bug: same handling
                    # The terminal events may not have reached Kafka: do not commit, stop, let the group re-run it.
                    log.error("rollout %s at %s[%d]@%d: events not acknowledged: %s", req.rollout_id, *tp, offset, exc)
                    self.fatal = exc
                    return
                held = outcome.held
                if held is None:
                    break
                if held.finished:  # its terminal events are out (published by whichever worker ran it)
                    log.info("%s[%d]@%d: %s; committed without running", *tp, offset, held)
                    self.tracker.done(tp, offset)
                    return
                if tp not in self.owned or self._stopping:  # moved on meanwhile: its new owner asks the proxy
                    log.info("%s[%d]@%d: %s; no longer ours to wait for", *tp, offset, held)
                    return
                if not waiting:
                    log.info("%s[%d]@%d: %s; waiting for it to end", *tp, offset, held)
                    waiting, self.waiting = True, self.waiting + 1
                await asyncio.sleep(self.settings.held_retry_s)
        finally:
            if waiting:
                self.waiting -= 1
        self.finished += 1
        if self.keep_outcomes:
            self.outcomes.append(outcome)
        self.tracker.done(tp, offset)
        log.info(
            "rollout %s at %s[%d]@%d done: %s reward=%s",
            req.rollout_id,
            *tp,
            offset,
            outcome.state,
            outcome.reward.reward if outcome.reward else None,
        )

    async def _dead_letter(self, msg, reason: str, error_type: str, rollout_id: str | None = None) -> None:  # noqa: ANN001
        record = dead_letter_of(msg, "sandbox_worker", reason, error_type, rollout_id=rollout_id or None)
        key = (msg.key() or b"").decode(errors="replace")
        await self.publisher.publish(
            self.kafka.topic(DEADLETTER), key, record.to_bytes(), self.settings.publish_timeout_s
        )

    async def _settle_failed(self, req: RolloutRequest, reason: str) -> None:
        """FAILED + an INFRA_FAILURE reward for a request that was never started (as a failed setup publishes)."""
        attempt_id = new_attempt_id(req)
        state = transition(None, RolloutState.FAILED)
        common = {"rollout_id": req.rollout_id, "policy_version": req.policy_version, "attempt_id": attempt_id}
        await self.ctx.sink.event(
            RolloutEvent(
                **common,
                timestamp_ms=now_ms(),
                state=state,
                group_id=req.group_id,
                harness=req.harness,
                attempt=req.attempt,
                worker_id=self.ctx.worker_id,
                reason=reason[:2000],
            )
        )
        await self.ctx.sink.reward(
            RewardEvent(
                **common, timestamp_ms=now_ms(), status=RewardStatus.INFRA_FAILURE, grader="none", reason=reason[:2000]
            )
        )

    def _duplicate_of(self, req: RolloutRequest, tp: Partition, offset: int) -> str | None:
        """Why ``req`` at ``tp@offset`` is a duplicate of a request seen here, or None (new, or the same record read
        again: a redelivery), or a replay of one below the committed position. Remembers it otherwise, on disk."""
        return self.seen.check(req.rollout_id, req.attempt, tp, offset)

    async def _take(self, msg) -> RolloutRequest | None:  # noqa: ANN001
        """The request to run, or None: ``msg`` was poison, dead-lettered with the reason and its offset done.

        Poison: undecodable bytes, an unknown writer schema, a tombstone; a request that makes no sense here
        (:func:`nonsense`), also settled by FAILED and an INFRA_FAILURE reward when its rollout id is usable, as a
        failed setup is (the scheduler re-issues it at most ``max_attempts`` times); a duplicate of a request read
        here (same rollout id and attempt at another offset, or an older attempt than one read here): nothing
        published, the original's events stand. A duplicate of one run by another worker is not recognised here:
        the proxy reports its attempt held or finished, and it is waited for or committed unrun, as a redelivery.
        """
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        self.tracker.start(tp, offset)
        try:
            if msg.value() is None:
                raise CodecError("a tombstone (no value), not a RolloutRequest")
            req = RolloutRequest.from_bytes(msg.value())
        except (CodecError, TypeError, ValueError, KeyError) as exc:
            log.error("%s: undecodable request: %s", where(msg), exc)
            await self._dead_letter(msg, f"undecodable RolloutRequest: {exc}", type(exc).__name__)
        else:
            why = nonsense(req, self.ctx)
            if why is not None:
                log.error("%s: invalid request %r: %s", where(msg), req.rollout_id, why)
                await self._dead_letter(msg, f"invalid request: {why}", "InvalidRequest", req.rollout_id)
                if req.rollout_id and not why.startswith("rollout_id "):
                    await self._settle_failed(req, f"invalid request: {why}")
            elif (dup := self._duplicate_of(req, tp, offset)) is not None:
                log.error("%s: %s; not run", where(msg), dup)
                await self._dead_letter(msg, dup, "DuplicateRequest", req.rollout_id)
            else:
                return req
        self.tracker.done(tp, offset)
        return None

    async def _sweep_loop(self) -> None:
        while True:
            try:
                removed = await self.ctx.backend.sweep()
                if removed:
                    log.info("swept %d stale sandbox(es) of dead workers", removed)
            except (OSError, ClawstreamError) as exc:
                log.warning("sandbox sweep failed: %s", exc)
            await asyncio.sleep(self.settings.sweep_interval_s)

    def _subscribe(self) -> Consumer:
        consumer = make_consumer(
            self.kafka,
            self.settings.group_id,
            **{
                "partition.assignment.strategy": "cooperative-sticky",
                "session.timeout.ms": self.settings.session_timeout_ms,
                "heartbeat.interval.ms": max(500, min(3000, self.settings.session_timeout_ms // 3)),
                "client.id": f"sandbox-worker-{self.ctx.worker_id}",
            },
        )
        self._consumer = consumer
        consumer.subscribe(
            [self.kafka.topic(ROLLOUT_REQUESTS)],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        return consumer

    def _start(self, msg: Message, req: RolloutRequest) -> None:
        """Run the request's attempt as a task of its own (unless its attempt, redelivered, still runs here)."""
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        log.info(
            "%s: rollout %s (%s/%s, %s, attempt %d)",
            where(msg),
            req.rollout_id,
            req.suite,
            req.task_id,
            req.harness,
            req.attempt,
        )
        # _take started its offset (a redelivered one's is committed when its attempt here finishes)
        mine = self.running.get((tp, offset))
        if mine is not None and not mine.done():  # redelivered (the partition went and came back)
            log.info("%s: its attempt still runs here: not started again", where(msg))
            return
        task = asyncio.create_task(self._run_one(req, tp, offset))
        self.tasks.add(task)
        self.running[(tp, offset)] = task
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _t, key=(tp, offset): self.running.pop(key, None))

    async def _close(self, consumer: Consumer, sweeper: asyncio.Task[None]) -> None:
        """Cancel what still runs, then close the consumer, the backend and the publisher."""
        sweeper.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        consumer.close()
        self._consumer = None
        try:
            await self.ctx.backend.close()
        except (OSError, ClawstreamError) as exc:
            log.warning("sandbox backend close failed: %s", exc)
        self.publisher.close()
        close = getattr(self.seen.store, "close", None)
        if close is not None:
            close()

    def _open_seen(self, consumer: Consumer) -> None:
        try:
            cluster_id = consumer.list_topics(timeout=30).cluster_id
        except KafkaException as exc:
            raise TopicError(f"sandbox worker: cluster metadata unavailable: {exc}") from exc
        self.seen.store = open_store(seen_path(self.settings, cluster_id))

    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        consumer = self._subscribe()  # assignments (which read the seen store) come with the first poll, below
        self._open_seen(consumer)
        sweeper = asyncio.create_task(self._sweep_loop())
        try:
            while not stop.is_set() and self.fatal is None:
                full = len(self.tasks) - self.waiting >= self.settings.concurrency
                if (full != self._paused or self._reassigned) and consumer.assignment():
                    (consumer.pause if full else consumer.resume)(consumer.assignment())
                    self._paused, self._reassigned = full, False
                msg = consumer.poll(0)
                self._commit()
                if msg is None:
                    await asyncio.sleep(0.05)
                    continue
                if msg.error():
                    log.warning("consumer error: %s", msg.error())
                    continue
                req = await self._take(msg)
                if req is not None:
                    self._start(msg, req)
            self._stopping = True
            if self.tasks:  # graceful stop: finish what runs (each rollout has its own timeout)
                log.info("stopping: waiting for %d rollout(s)", len(self.tasks))
                await asyncio.gather(*list(self.tasks), return_exceptions=True)
            if self.fatal is None:
                self._commit()
        finally:
            await self._close(consumer, sweeper)
        return 1 if self.fatal is not None else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.sandbox.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--backend", choices=("local", "docker"))
    parser.add_argument("--proxy-url")
    parser.add_argument(
        "--proxy-admin-token",
        help="the proxy's admin token; prefer CLAWSTREAM_SANDBOX_PROXY_ADMIN_TOKEN: a flag is readable by every local "
        "process in /proc/PID/cmdline",
    )
    parser.add_argument("--group-id")
    parser.add_argument(
        "--unsafe-no-isolation",
        action="store_true",
        help="local backend without bubblewrap (CLAWSTREAM_SANDBOX_ISOLATION=none): a rollout can read other "
        "rollouts' and this worker's secrets and write outside its workspace; trusted harnesses only",
    )
    parser.add_argument(
        "--harness-file",
        action="append",
        dest="harness_files",
        metavar="FILE",
        help="a harness adapter file (TOML) to run besides the built-in and added ones (repeatable)",
    )
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    own = ("concurrency", "backend", "proxy_url", "proxy_admin_token", "group_id", "harness_files")
    overrides = {k: v for k, v in vars(args).items() if k in own and v is not None}
    if args.unsafe_no_isolation:
        overrides["isolation"] = "none"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise_open_files_limit()  # every sandbox's relayed connections are this process's fds
    settings = load_settings(SandboxSettings, **overrides)
    try:
        backend = make_backend(settings)  # refuses an unisolated local backend unless told (bubblewrap missing)
    except SandboxError as exc:
        log.error("%s", exc)
        return 2
    if settings.backend == "local" and settings.isolation == "none":
        log.warning("local sandboxes are NOT isolated (--unsafe-no-isolation): run trusted harnesses only")
    kafka = kafka_settings(args)
    log.info("Kafka at %s", check_broker(kafka))

    async def serve() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await SandboxWorker(settings, kafka, backend=backend).run(stop)

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
