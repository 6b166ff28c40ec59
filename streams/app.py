"""The clawstream Faust app: assembler → grouper → batcher, one worker process (scale out with more workers).

Topics in: ``clawstream.calls``, ``clawstream.rollout.events``, ``clawstream.rewards``, ``clawstream.rollout.requests``
(co-partitioned, key = rollout id), ``clawstream.weights``. Out: ``clawstream.trajectories``, ``clawstream.batches``,
``clawstream.metrics``, ``clawstream.deadletter``. Internal (names start with the app id, which starts with the Kafka
topic prefix): two tick topics, ``…-by-group`` (trajectories re-keyed by group id), ``…-scored-groups`` (one
partition: scored groups for the batcher) — created by :func:`ensure_internal_topics` at start — and the tables'
changelogs (``…-<table>-changelog``, declared by Faust itself).

This module is the wiring: the agents are data (:func:`stages`), each run by the one skeleton in ``streams.agent``
(decode or dead-letter → the pure core ``streams.assemble`` / ``group`` / ``batch`` → dead-letter rejects → produce).
Tables hold the state in RocksDB (``store="rocksdb://"``, rocksdict driver) or memory; with
``processing_guarantee="exactly_once"`` (the default) every partition number's outputs, changelog writes and offsets
(all co-partitioned topics) commit in one Kafka transaction, between records (``streams.eos``). Timers cannot write
tables in Faust, so a timer sends each owned partition with something due a tick and the agents check deadlines
when the tick arrives, inside the partition's transaction (``streams.state.Deadlines``).

Run: ``python -m streams.app worker`` (Faust's CLI; settings from ``CLAWSTREAM_STREAMS_*`` and
``CLAWSTREAM_KAFKA_*``, see ``streams.settings``). The catalog topics must exist (``clawstream topics create``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
from faust.types import TP, EventT

from clawbase.kafka.clients import bootstrap_servers, create_topics, replication
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from schemas.events import BatchRecord, Event, RolloutEvent, Trajectory, WeightVersion
from schemas.topics import (
    BATCHES,
    CALLS,
    DEADLETTER,
    MAX_MESSAGE_BYTES,
    METRICS,
    REWARDS,
    ROLLOUT_EVENTS,
    ROLLOUT_PARTITIONS,
    ROLLOUT_REQUESTS,
    TRAJECTORIES,
    WEIGHTS,
    TopicSpec,
)
from streams import eos, store
from streams.agent import Action, Emit, Forward, Reject, Stage, add_agent, decode, now_ms
from streams.assemble import Assembler
from streams.batch import Batcher, BatchOutput
from streams.codec import CODEC_NAME
from streams.group import Emission, Grouper
from streams.settings import StreamsSettings
from streams.state import Deadlines

log = logging.getLogger(__name__)
RAW: dict[str, Any] = {"key_serializer": "raw", "value_serializer": "raw"}
# Table keys are str (Faust serialises them as JSON, so they come back as str after recovery); values are our own
# bytes (value_type=bytes makes Faust use the "raw" codec: a schema= argument would be ignored for the changelog).
TABLE_TYPES: dict[str, Any] = {"key_type": str, "value_type": bytes}
_ = CODEC_NAME  # importing streams.codec registers the project's Avro codec with Faust
PRODUCER_BATCH_BYTES = 512 * 1024  # per partition and request; Faust's 16 KiB held about 12 call events


# Tables: name → (partitions, what it holds). Partitions match the source topics (Faust checks it).
TABLES: dict[str, tuple[int, str]] = {
    "assembler-state": (ROLLOUT_PARTITIONS, "rollout id → RolloutAccumulator JSON"),
    "assembler-calls": (ROLLOUT_PARTITIONS, "rollout id NUL call id → CallEvent bytes"),
    "assembler-index": (ROLLOUT_PARTITIONS, "partition → DueIndex JSON"),
    "grouper-groups": (ROLLOUT_PARTITIONS, "group id → GroupState JSON"),
    "grouper-members": (ROLLOUT_PARTITIONS, "group id NUL rollout id → Trajectory bytes"),
    "grouper-index": (ROLLOUT_PARTITIONS, "partition → DueIndex JSON"),
    "batcher-state": (1, "'batcher' → BatcherState JSON"),
    "batcher-members": (1, "group id NUL index → BatchRecord bytes"),
}


def internal_topics(cfg: StreamsSettings, kafka: KafkaSettings) -> dict[str, TopicSpec]:
    """The app's own topics, by role; full names. Changelogs are ``<app id>-<table>-changelog`` as Faust names them."""
    app_id = kafka.topic_prefix + cfg.app_id
    big = {"max.message.bytes": str(MAX_MESSAGE_BYTES + 1024 * 1024)}
    hour = {"retention.ms": str(3600 * 1000)}
    changelogs = {
        f"{name}-changelog": TopicSpec(
            f"{app_id}-{name}-changelog", "table key", "bytes", partitions, {**big, "cleanup.policy": "compact"}
        )
        for name, (partitions, _) in TABLES.items()
    }
    return changelogs | {
        "ticks-assemble": TopicSpec(f"{app_id}-ticks-assemble", "-", "-", ROLLOUT_PARTITIONS, hour),
        "ticks-group": TopicSpec(f"{app_id}-ticks-group", "-", "-", ROLLOUT_PARTITIONS, hour),
        "by-group": TopicSpec(f"{app_id}-by-group", "group_id", "Trajectory", ROLLOUT_PARTITIONS, big),
        "scored-groups": TopicSpec(f"{app_id}-scored-groups", "group_id", "BatchRecord", 1, big),
    }


def ensure_internal_topics(cfg: StreamsSettings, kafka: KafkaSettings) -> dict[str, str]:
    """Create the internal topics (idempotent; replicated by create_topics' rule), before the worker subscribes.

    Faust only declares topics an agent reads on its own (ours are read merged with catalog topics), and a changelog
    it declares itself can be seen with 0 partitions by its consumer's metadata for minutes, failing every table
    write (PartitionsMismatch).
    """
    unprefixed = kafka.model_copy(update={"topic_prefix": ""})
    return create_topics(unprefixed, internal_topics(cfg, kafka).values())


def faust_app(cfg: StreamsSettings, kafka: KafkaSettings) -> faust.App:
    """The Faust app with the project's settings, bare (nothing connects before the worker starts)."""
    app_id = kafka.topic_prefix + cfg.app_id  # changelogs, internal topics, group and transactional ids follow it
    exactly_once = cfg.processing_guarantee == "exactly_once"
    big = MAX_MESSAGE_BYTES + 1024 * 1024
    app = faust.App(
        app_id,
        broker=[f"kafka://{hp.strip()}" for hp in bootstrap_servers(kafka).split(",")],
        broker_credentials=_credentials(kafka),
        store=cfg.store,
        datadir=str(cfg.data_dir),
        processing_guarantee=cfg.processing_guarantee,
        topic_disable_leader=True,  # auto-creation is off and this app needs no leader election topic
        topic_partitions=ROLLOUT_PARTITIONS,
        # Faust's default is 1 replica: a topic it creates itself would die with one broker of a cluster. The rule
        # of create_topics (which makes the internal topics first): min(3, brokers), or the setting.
        topic_replication_factor=replication(kafka).factor,
        web_enabled=False,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=cfg.commit_interval_s,
        broker_session_timeout=cfg.session_timeout_s,
        broker_heartbeat_interval=min(3.0, cfg.session_timeout_s / 3),
        # Exactly-once, nothing is readable before the commit, which sends whatever lingers: a longer linger costs no
        # latency there and makes fewer, larger produce requests (request building, compression and a socket write
        # per batch were a fifth of the worker's time at 5 ms). At least once, outputs are readable when sent.
        producer_linger=cfg.producer_linger_s if exactly_once else 0.005,
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        producer_max_request_size=big,
        producer_compression_type="zstd",
        consumer_max_fetch_size=big,
        table_key_index_size=cfg.table_key_index_size,
    )
    # Faust leaves the root logger at DEBUG (its handlers filter): aiokafka would build a record for every request.
    logging.getLogger("aiokafka").setLevel(logging.INFO)
    return app


@dataclass(frozen=True)
class Channels:
    """The agents' inputs and the app's outputs (Faust topics; the internal ones by role)."""

    assembler_in: faust.TopicT
    grouper_in: faust.TopicT
    batcher_in: faust.TopicT
    a_ticks: faust.TopicT
    g_ticks: faust.TopicT
    by_group: faust.TopicT
    scored_groups: faust.TopicT
    trajectories: faust.TopicT
    batches: faust.TopicT
    metrics: faust.TopicT
    deadletter: faust.TopicT

    @classmethod
    def declare(cls, app: faust.App, cfg: StreamsSettings, kafka: KafkaSettings) -> Channels:
        def topic(*names: str) -> faust.TopicT:
            return app.topic(*names, **RAW)

        own = {role: topic(spec.name) for role, spec in internal_topics(cfg, kafka).items()}
        a_ticks, g_ticks, by_group = own["ticks-assemble"], own["ticks-group"], own["by-group"]
        scored_groups = own["scored-groups"]
        assembler_in = topic(
            *(kafka.topic(n) for n in (CALLS, ROLLOUT_EVENTS, REWARDS, ROLLOUT_REQUESTS)), a_ticks.get_topic_name()
        )
        grouper_in = topic(by_group.get_topic_name(), g_ticks.get_topic_name())
        batcher_in = topic(scored_groups.get_topic_name(), kafka.topic(WEIGHTS))
        trajectories, batches = topic(kafka.topic(TRAJECTORIES)), topic(kafka.topic(BATCHES))
        metrics, deadletter = topic(kafka.topic(METRICS)), topic(kafka.topic(DEADLETTER))
        return cls(
            assembler_in=assembler_in,
            grouper_in=grouper_in,
            batcher_in=batcher_in,
            a_ticks=a_ticks,
            g_ticks=g_ticks,
            by_group=by_group,
            scored_groups=scored_groups,
            trajectories=trajectories,
            batches=batches,
            metrics=metrics,
            deadletter=deadletter,
        )


@dataclass
class CallsProgress:
    """How far this worker has read each calls partition (``read[p]``: the next offset) and where it ends now."""

    app: faust.App
    topic: str
    read: dict[int, int] = field(default_factory=dict)

    def end(self, partition: int) -> int | None:
        """The partition's high watermark from the last fetch (None before the first: unknown)."""
        try:
            return self.app.consumer.highwater(TP(self.topic, partition))
        except Exception:  # noqa: BLE001 - no consumer yet, or the partition not assigned here: unknown
            return None


def stages(
    io: Channels,
    assembler: Assembler,
    grouper: Grouper,
    batcher: Batcher,
    since_ms: Callable[[], int],
    calls: CallsProgress,
) -> list[Stage[Any]]:
    """The agents as data: assemble, rekey, group, batch. ``since_ms()``: when this worker started listening;
    ``calls``: how far it has read each calls partition, and where each ends."""

    def assembled(record: Event, event: EventT, now: int) -> list[Action]:
        msg = event.message
        if msg.topic == calls.topic:
            calls.read[msg.partition] = msg.offset + 1
        end = calls.end(msg.partition) if isinstance(record, RolloutEvent) else None
        result = assembler.on_record(record, msg.value, msg.partition, now, end)
        bad = result.rejected
        dead = [Reject(bad.reason, bad.verdict.value, getattr(record, "rollout_id", None))] if bad else []
        return [*dead, Emit(io.trajectories, result.trajectories, "rollout_id", msg.partition)]

    def assemble_tick(partition: int, now: int) -> list[Action]:
        result = assembler.on_tick(partition, now, since_ms(), calls.read.get(partition))
        return [Emit(io.trajectories, result.trajectories, "rollout_id", partition)]

    def group_outputs(out: Emission) -> list[Action]:
        return [Emit(io.scored_groups, out.records, "batch_id"), Emit(io.metrics, out.metrics, "source")]

    def grouped(t: Trajectory, event: EventT, now: int) -> list[Action]:
        out = grouper.on_trajectory(t, event.message.value, event.message.partition, now)
        bad = out.rejected
        return [*([Reject(bad.reason, bad.verdict.value, t.rollout_id)] if bad else []), *group_outputs(out)]

    def batched(record: BatchRecord | WeightVersion, event: EventT, now: int) -> list[Action]:
        out: BatchOutput
        if isinstance(record, BatchRecord):
            out = batcher.on_envelope(record, event.message.value, now)
        else:
            out = batcher.on_weights(record.policy_version, now)
        dropped: list[Action] = [
            Reject(
                reason, "StaleGroup" if reason.startswith("stale") else "IncompleteGroup", note=f"group {gid} dropped"
            )
            for gid, reason in out.dropped
        ]
        return [Emit(io.batches, out.records, "batch_id"), *dropped]

    scored = io.scored_groups.get_topic_name()
    return [
        Stage(
            name="assemble",
            help="calls / lifecycle events / rewards / requests (+ ticks) → trajectories.",
            source="streams.assembler",
            channel=io.assembler_in,
            decoder=lambda _topic: decode,
            handle=assembled,
            ticks=io.a_ticks.get_topic_name(),
            on_tick=assemble_tick,
        ),
        Stage(
            name="rekey",
            help="trajectories (key = rollout id) → by-group (key = group id).",
            source="streams.grouper",
            channel=io.trajectories,
            decoder=lambda _topic: Trajectory.from_bytes,
            handle=lambda t, _event, _now: [Forward(io.by_group, t.group_id.encode())],
        ),
        Stage(
            name="group",
            help="by-group trajectories (+ ticks) → scored groups (BatchRecord envelopes + SEAL) and group metrics.",
            source="streams.grouper",
            channel=io.grouper_in,
            decoder=lambda _topic: Trajectory.from_bytes,
            handle=grouped,
            ticks=io.g_ticks.get_topic_name(),
            on_tick=lambda partition, now: group_outputs(grouper.on_tick(partition, now, since_ms())),
        ),
        Stage(
            name="batch",
            help="scored groups + weight versions → training batches (TRAJECTORY records, then SEAL).",
            source="streams.batcher",
            channel=io.batcher_in,
            decoder=lambda topic: BatchRecord.from_bytes if topic == scored else WeightVersion.from_bytes,
            handle=batched,
        ),
    ]


def add_ticks(app: faust.App, interval_s: float, ticks: Sequence[tuple[faust.TopicT, Deadlines]]) -> Any:
    """The timer that sends a tick to every owned partition of a tick topic whose stage has something due."""

    def has_due(deadlines: Deadlines, partition: int, now: int) -> bool:
        try:
            earliest = deadlines.earliest(partition)  # a read of the local table (the agents' view), no write
        except Exception:  # noqa: BLE001 - e.g. a store being closed by a rebalance: tick anyway, the agent decides
            return True
        return earliest is not None and earliest <= now

    @app.timer(interval=interval_s)
    async def tick() -> None:
        """Tick every owned partition that has something due (a tick before its earliest due visits nothing, and an
        idle one costs a record's whole path through Faust); sent outside any transaction (a lost or repeated tick
        only shifts a check)."""
        now = now_ms()
        for tp in app.consumer.assignment():
            for channel, deadlines in ticks:
                if tp.topic == channel.get_topic_name() and has_due(deadlines, tp.partition, now):
                    await channel.send(key=b"tick", value=b"", partition=tp.partition)
        await eos.send_untransacted(app)  # a tick waiting out the producer's linger would delay every settle

    return tick


def create_app(cfg: StreamsSettings, kafka: KafkaSettings) -> faust.App:
    """Build the app, its topics, tables, agents and timer (nothing connects before the worker starts)."""
    app_id = kafka.topic_prefix + cfg.app_id
    app = faust_app(cfg, kafka)
    eos.patch_faust_resume()
    if cfg.processing_guarantee == "exactly_once":
        eos.install(app)
    io = Channels.declare(app, cfg, kafka)
    tables = {
        name: app.Table(name, default=None, partitions=n, help=help, **TABLE_TYPES)
        for name, (n, help) in TABLES.items()
    }
    memory = store.bound(tables.values(), cfg.rocksdb_memory_mb, cfg.memory_trace_top)
    assembler = Assembler(cfg, tables["assembler-state"], tables["assembler-calls"], tables["assembler-index"])
    grouper = Grouper(cfg, tables["grouper-groups"], tables["grouper-members"], tables["grouper-index"])
    batcher = Batcher(cfg, tables["batcher-state"], tables["batcher-members"], app_id)

    # Deadlines count silence only while this worker listens: from its last completed rebalance (tables recovered).
    listening = {"since_ms": now_ms()}
    calls = CallsProgress(app, kafka.topic(CALLS))

    @app.on_rebalance_complete.connect
    async def _listening(sender: Any, **_: Any) -> None:
        listening["since_ms"] = now_ms()
        calls.read.clear()  # a partition may have been read by another worker meanwhile: unknown until read again

    agents = [
        add_agent(app, io.deadletter, s)
        for s in stages(io, assembler, grouper, batcher, lambda: listening["since_ms"], calls)
    ]
    tick = add_ticks(app, cfg.tick_interval_s, ((io.a_ticks, assembler.deadlines), (io.g_ticks, grouper.deadlines)))
    if memory is not None:

        @app.timer(interval=cfg.memory_report_interval_s)
        async def _report_memory() -> None:
            log.info("%s", await asyncio.to_thread(memory.report))  # malloc_trim walks the heap: off the loop

    app.clawstream_agents = (*agents, tick)  # type: ignore[attr-defined]
    return app


def _credentials(kafka: KafkaSettings) -> Any:
    if kafka.security_protocol == "PLAINTEXT":
        return None
    import ssl

    context = None
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_ca_location)
        if kafka.ssl_certificate_location:
            context.load_cert_chain(kafka.ssl_certificate_location, kafka.ssl_key_location)
    if kafka.security_protocol == "SSL":
        return faust.SSLCredentials(context)
    return faust.SASLCredentials(
        username=kafka.sasl_username, password=kafka.sasl_password, mechanism=kafka.sasl_mechanism, ssl_context=context
    )


class _CleanShutdown:
    """Writes the RocksDB clean-shutdown marker when the app stops without crashing (see streams.eos)."""

    def __init__(self, app: faust.App) -> None:
        self.app = app
        original = app.on_shutdown

        async def on_shutdown() -> None:
            await original()
            if app.crash_reason is None:
                eos.mark_clean_shutdown(Path(app.conf.tabledir))

        app.on_shutdown = on_shutdown  # type: ignore[method-assign]


def usage() -> str:
    """What ``--help`` prints: the command, then every setting with its environment variable and description."""
    lines = [
        "usage: python -m streams.app worker [--bootstrap HOST:PORT] [--topic-prefix PREFIX] [faust worker options]"
        "   (clawstream streams [worker ...])",
        "",
        (__doc__ or "").split("\n")[0],
        "",
        "Kafka: --bootstrap HOST:PORT[,...] (env CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS; default: the broker of "
        "`clawstream kafka up`), --topic-prefix PREFIX (env CLAWSTREAM_KAFKA_TOPIC_PREFIX); other CLAWSTREAM_KAFKA_*",
        "settings from the environment.",
        "",
        "Settings (environment):",
    ]
    prefix = str(StreamsSettings.model_config.get("env_prefix", ""))
    for name, spec in StreamsSettings.model_fields.items():
        default = spec.get_default(call_default_factory=True)
        lines.append(f"  {prefix}{name.upper():<34} {spec.description or ''} (default: {default!r})")
    lines.append("\nFaust's own options: python -m streams.app worker --help (needs a reachable broker).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m streams.app worker [...]``: settings from the environment, then Faust's CLI."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        # Answer without a broker: building the app resolves the bootstrap address and creates topics.
        print(usage())
        return
    flags = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_kafka_arguments(flags)
    known, args = flags.parse_known_args(args)  # --bootstrap / --topic-prefix are ours, the rest is Faust's
    cfg, kafka = load_settings(StreamsSettings), kafka_settings(known)
    ensure_internal_topics(cfg, kafka)
    app = create_app(cfg, kafka)
    if cfg.store.startswith("rocksdb://"):
        tabledir = Path(app.conf.tabledir)
        if eos.prepare_rocksdb(tabledir, exactly_once=cfg.processing_guarantee == "exactly_once"):
            # Faust has not set up logging yet (and something gives this logger a NullHandler): say it plainly.
            print(
                f"streams: no clean-shutdown marker in {tabledir}: wiping local tables, they are rebuilt from the "
                "changelogs",
                file=sys.stderr,
            )
        _CleanShutdown(app)
    # "worker" is not args[0] when Faust's app options come first (the demo passes --datadir DIR worker ...).
    if "worker" in args and not {"--with-web", "--without-web"} & set(args):
        # Faust's worker command turns its web server on by default, whatever web_enabled says, and binds port
        # 6066 on every interface: a second worker on the same host (scaling out) would fail to start.
        args.append("--without-web")
    sys.argv = [sys.argv[0], *args]
    app.main()


if __name__ == "__main__":
    main()
