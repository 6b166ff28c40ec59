"""Replay: copy a range of recorded topics into a new topic prefix, for off-policy experiments.

Topics: any catalog topic under the source prefix (default ``clawstream.batches``), read_committed → the same topic
names under ``--to-prefix``. Keys, values, headers, partition numbers and the order within each partition are kept;
record timestamps are the time of the copy unless ``--keep-timestamps`` (every event also carries its original
``timestamp_ms`` in its value). The range is offsets ``--from/--to`` (``[from, to)``, per partition with ``P:N``)
and/or times ``--since/--until`` (the broker's offsets-for-times on the record timestamps); on the batches topic a
sealed batch is copied whole or not at all (``consumers.analytics.replay_plan``). Missing destination topics are
created with the catalog's configs and the source's partition count (with the batches topic, also the learner's
outputs: weights, metrics, dead letters); a destination with fewer partitions than the
source is refused, and so is one that already holds records unless ``--append``. The copy is one transactional
producer (``transactional.id`` = ``<to-prefix>clawstream-replay``, so two replays into one prefix fence each other):
on the batches topic a transaction ends at each seal, so a reader of the destination (a learner already running on
it) only ever sees whole batches; elsewhere every ``--commit-every`` records. ``--rate N`` paces it to N records/s.

Replay into a learner: replay the batches into a fresh prefix and start a learner there; the prefix gives it a new
consumer group, transactional id and an empty ``clawstream.weights``, so it trains every replayed batch from its
``--model-dir``. The summary prints the exact command; docs/replay.md has the worked example.

Run: ``clawstream replay --to-prefix P [--topic batches] [--from N --to N | --since T --until T] [--rate N]`` or
``python -m consumers.analytics.replay ...``; progress on stderr, the summary on stdout (``--json`` for a machine).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException, Message, Producer

from clawbase.errors import ClawstreamError, CodecError, ConfigError, TopicError
from clawbase.kafka.clients import create_topics, make_admin, make_producer, where
from clawbase.settings import KafkaSettings, clawstream_home, load_settings
from consumers.analytics.reader import READ_BATCH, offsets_at, open_reader, read_range, watermarks
from consumers.analytics.records import parse_offsets, parse_time_ms
from consumers.analytics.replay_plan import (
    BatchPlan,
    Entry,
    Pacer,
    PartitionCopy,
    PartitionRange,
    TopicCopy,
    partition_ranges,
    plan_batches,
    resolve_topic,
    summary_text,
)
from consumers.analytics.settings import ReplaySettings
from schemas.events import BatchRecord, BatchRecordKind
from schemas.topics import BATCHES, BY_NAME, DEADLETTER, METRICS, WEIGHTS, TopicSpec

# What a learner on the destination prefix writes: created with the replayed batches so it can start at once.
LEARNER_OUTPUTS = (WEIGHTS, METRICS, DEADLETTER)
# librdkafka aborts a transaction open longer than transaction.timeout.ms (60 s by default): commit well before.
MAX_TRANSACTION_S = 20.0


@dataclass
class _Source:
    spec: TopicSpec
    name: str
    dest: str
    partitions: int
    ranges: list[PartitionRange]
    created: bool = False


class Replayer:
    """One replay: resolve and check everything first (nothing written on a bad request), then copy."""

    def __init__(self, kafka: KafkaSettings, settings: ReplaySettings, progress: Callable[[str], None]) -> None:
        self.kafka, self.settings, self.progress = kafka, settings, progress
        if settings.to_prefix == kafka.topic_prefix:
            raise ConfigError(f"--to-prefix {settings.to_prefix!r} is the source prefix: replay copies into another")
        try:
            self.dest = load_settings(KafkaSettings, **{**kafka.model_dump(), "topic_prefix": settings.to_prefix})
        except ConfigError as exc:  # the source settings are valid, so the prefix is what is wrong
            raise ConfigError(
                f"--to-prefix {settings.to_prefix!r}: topic names allow only letters, digits, '.', '_' and '-'"
            ) from exc
        self.specs = [resolve_topic(t) for t in settings.topics]
        if len({s.name for s in self.specs}) != len(self.specs):
            raise ConfigError("--topic: a topic is named twice")
        self.starts = parse_offsets(settings.from_offsets, flag="--from")
        self.ends = parse_offsets(settings.to_offsets, flag="--to")
        if (self.starts or self.ends) and len(self.specs) > 1:
            raise ConfigError(
                "--from/--to are offsets of one topic: pass one --topic with them, or use --since/--until"
            )
        self.since = None if settings.since is None else _time(settings.since, "--since")
        self.until = None if settings.until is None else _time(settings.until, "--until")
        self.pacer = Pacer(settings.rate)
        # One never-committing reader (assign, a group id the broker never hears of); it checks the broker and the
        # first topic, every source topic is checked again in _resolve.
        self.consumer: Consumer
        self.consumer, _ = open_reader(kafka, self.specs[0].name)

    # ---- resolve and check (no writes) ---------------------------------------------------------------------------
    def _resolve(self, spec: TopicSpec) -> _Source:
        name = self.kafka.topic(spec.name)
        if name not in self.consumer.list_topics(timeout=30).topics:
            raise TopicError(
                f"no topic {name}: is the source --topic-prefix {self.kafka.topic_prefix!r} right? "
                "(`clawstream topics list` shows the topics)"
            )
        marks = watermarks(self.consumer, name)
        since = None if self.since is None else offsets_at(self.consumer, name, self.since, marks)
        until = None if self.until is None else offsets_at(self.consumer, name, self.until, marks)
        ranges = partition_ranges(marks, self.starts, self.ends, since, until)
        return _Source(spec, name, self.dest.topic(spec.name), len(marks), ranges)

    def _check_destination(self, source: _Source) -> None:
        admin = make_admin(self.dest)
        try:
            meta = admin.list_topics(source.dest, timeout=30).topics.get(source.dest)
        except KafkaException as exc:
            raise ClawstreamError(f"cannot look up {source.dest}: {exc}") from exc
        if meta is None or meta.error is not None or not meta.partitions:
            source.created = True  # created just before copying (not in a dry run)
            return
        if len(meta.partitions) < source.partitions:
            raise TopicError(
                f"destination {source.dest} has {len(meta.partitions)} partition(s), the source "
                f"{source.name} {source.partitions}: partition numbers are kept, so it needs at least "
                f"{source.partitions}; delete it or pick another --to-prefix"
            )
        if self.settings.append:
            return
        held = watermarks(self.consumer, source.dest)
        busy = {p: high - low for p, (low, high) in held.items() if high > low}
        if busy:
            detail = ", ".join(f"[{p}] {n}" for p, n in sorted(busy.items()))
            raise TopicError(
                f"destination {source.dest} already holds records ({detail} offsets): a replay would "
                "mix with them; pick a fresh --to-prefix, or pass --append to add to it"
            )

    # ---- the run -------------------------------------------------------------------------------------------------
    def run(self) -> list[TopicCopy]:
        try:
            sources = [self._resolve(spec) for spec in self.specs]
            for source in sources:  # every check before the first write: a refused replay writes nothing
                self._check_destination(source)
            copies = [
                TopicCopy(s.name, s.dest, s.created, [PartitionCopy(r.partition, r) for r in s.ranges]) for s in sources
            ]
            producer = None
            if not self.settings.dry_run:
                for source in sources:
                    if source.created:
                        create_topics(self.dest, [source.spec], partitions={source.spec.name: source.partitions})
                if any(spec.name == BATCHES for spec in self.specs):  # a learner on the prefix writes these
                    copied = {spec.name for spec in self.specs}
                    create_topics(self.dest, [BY_NAME[t] for t in LEARNER_OUTPUTS if t not in copied])
                txn_id = f"{self.settings.to_prefix}clawstream-replay"
                producer = make_producer(self.dest, **{"transactional.id": txn_id})
                producer.init_transactions(60)
            for source, copy in zip(sources, copies, strict=True):
                for part in copy.partitions:
                    if part.range.size:
                        self._copy_partition(source, part, copy, producer)
        finally:
            self.consumer.close()
        return copies

    def _copy_partition(self, source: _Source, part: PartitionCopy, copy: TopicCopy, producer: Producer | None) -> None:
        rng = part.range
        plan: BatchPlan | None = None
        if source.spec.name == BATCHES:
            entries = [_entry(msg, self.progress) for msg in self._read(source.name, rng, "planning")]
            plan = plan_batches(entries, rng)
            copy.batches.extend(plan.batches)
            copy.skipped.extend(plan.skipped)
        if producer is None:  # dry run: count what would be copied
            for msg in self._read(source.name, rng, "counting") if plan is None else ():
                part.copied(msg.offset())
            for offset in sorted(plan.copy) if plan is not None else ():
                part.copied(offset)
            return
        txn = _Transaction(producer, part)
        try:
            for msg in self._read(source.name, rng, "copying"):
                offset = msg.offset()
                if plan is not None and offset not in plan.copy:
                    continue
                if txn.age() + self.pacer.delay() > MAX_TRANSACTION_S:  # a slow --rate: do not wait inside one
                    txn.commit()
                self.pacer.wait()
                timestamp = msg.timestamp()[1] if self.settings.keep_timestamps else 0
                txn.produce(source.dest, msg, timestamp)
                part.copied(offset)
                boundary = offset in plan.seals if plan is not None else txn.pending >= self.settings.commit_every
                if boundary or txn.age() > MAX_TRANSACTION_S:
                    txn.commit()
            txn.commit()
        except (KafkaException, ClawstreamError, KeyboardInterrupt) as exc:
            txn.abort()
            done = txn.committed_through
            resume = f"--from {part.partition}:{rng.start if done is None else done + 1}"
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"failed: {exc}"
            raise ClawstreamError(
                f"replay of {source.name}[{part.partition}] {why}; committed to {source.dest} up to source "
                f"offset {done if done is not None else '(none)'}; to continue: --topic {source.spec.name} --append "
                f"{resume} (plus your other bounds)"
            ) from exc
        if plan is not None and len(plan.copy) != part.records:
            raise ClawstreamError(
                f"{source.name}[{part.partition}]: planned {len(plan.copy)} records but read "
                f"{part.records} on the second pass (retention deleted some meanwhile?)"
            )

    def _read(self, topic: str, rng: PartitionRange, what: str) -> Iterator[Message]:
        """The committed records of ``[rng.start, rng.end)`` of one partition, in order; progress on stderr."""
        label = f"{topic}[{rng.partition}]"
        self.progress(f"replay: {what} {label} offsets {rng.start}..{rng.end - 1} ({rng.size})")
        shown, seen = time.monotonic(), 0
        # read_range takes up to READ_BATCH records per poll and counts the time we spend on them (pacing) as
        # time without progress: allow for pacing one poll's worth on top of the stall timeout.
        stall = self.settings.stall_timeout_s + (READ_BATCH / self.settings.rate if self.settings.rate else 0.0)
        for msg in read_range(
            self.consumer, topic, {rng.partition: rng.start}, {rng.partition: rng.end}, stall_s=stall
        ):
            seen += 1
            yield msg
            if time.monotonic() - shown >= 2.0:
                shown = time.monotonic()
                self.progress(f"replay: {what} {label}: offset {msg.offset()} of ..{rng.end - 1}, {seen} records")


class _Transaction:
    """The destination producer's current transaction: produce, count, commit, remember the committed offset."""

    def __init__(self, producer: Producer, part: PartitionCopy) -> None:
        self.producer, self.part = producer, part
        self.pending, self.started = 0, 0.0
        self.last_source: int | None = None
        self.committed_through: int | None = None
        self.errors: list[str] = []

    def produce(self, topic: str, msg: Message, timestamp: int) -> None:
        if self.pending == 0:
            self.producer.begin_transaction()
            self.started = time.monotonic()
        kwargs = {
            "partition": msg.partition(),
            "headers": msg.headers(),
            "timestamp": timestamp,
            "on_delivery": self._delivered,
        }
        deadline = time.monotonic() + 60
        while True:  # a full local queue: serve deliveries and retry, never drop
            try:
                self.producer.produce(topic, key=msg.key(), value=msg.value(), **kwargs)
                break
            except BufferError:
                if time.monotonic() > deadline:
                    raise ClawstreamError(f"producer queue for {topic} stayed full for 60s") from None
                self.producer.poll(0.05)
        self.producer.poll(0)
        self.pending += 1
        self.last_source = msg.offset()

    def _delivered(self, err, msg: Message) -> None:  # noqa: ANN001 - confluent_kafka.KafkaError | None
        if err is not None:
            self.errors.append(str(err))
        else:
            self.part.delivered(msg.offset())

    def age(self) -> float:
        return time.monotonic() - self.started if self.pending else 0.0

    def commit(self) -> None:
        if not self.pending:
            return
        self.producer.commit_transaction(60)  # flushes: every delivery report has been served
        if self.errors:
            raise ClawstreamError(f"delivery failed: {self.errors[0]}")
        self.pending = 0
        self.committed_through = self.last_source

    def abort(self) -> None:
        if self.pending:
            try:
                self.producer.abort_transaction(30)
            except KafkaException:
                pass  # the original error is the one to report; the broker aborts it on timeout anyway
            self.pending = 0


def _time(value: str, flag: str) -> int:
    try:
        return parse_time_ms(value)
    except ClawstreamError as exc:  # its message does not say which flag
        raise ConfigError(f"{flag}: {exc}") from exc


def _entry(msg: Message, report: Callable[[str], None]) -> Entry:
    try:
        if msg.value() is None:
            raise CodecError("a tombstone (no value)")
        rec = BatchRecord.from_bytes(msg.value())
    except (ClawstreamError, KeyError, TypeError, ValueError) as exc:  # copied as it is (the learner dead-letters it)
        report(f"replay: undecodable {where(msg)}: {type(exc).__name__}: {exc} (copied as it is)")
        return Entry(msg.offset())
    return Entry(msg.offset(), rec.batch_id, rec.kind is BatchRecordKind.SEAL, rec.index)


def learner_command(dest: KafkaSettings) -> str:
    """The command that trains a fresh learner on the replayed batches (model dir left for the user to fill)."""
    store = clawstream_home() / "replay" / (dest.topic_prefix.strip(".") or "unprefixed") / "weights"
    bootstrap = f" --bootstrap {dest.bootstrap_servers}" if dest.bootstrap_servers else ""
    return (
        f"clawstream learner --model-dir MODEL_DIR --weight-store {store} --topic-prefix {dest.topic_prefix}{bootstrap}"
    )


def replay(
    kafka: KafkaSettings, settings: ReplaySettings, progress: Callable[[str], None] | None = None
) -> list[TopicCopy]:
    """Run one replay; returns what was copied per topic (raises :class:`ClawstreamError` on a bad request)."""
    return Replayer(kafka, settings, progress or (lambda line: print(line, file=sys.stderr, flush=True))).run()


def main(argv: list[str] | None = None) -> int:
    from clawbase.settings import add_kafka_arguments, kafka_settings

    parser = argparse.ArgumentParser(
        prog="clawstream replay",
        description=__doc__.split("\n\n")[0],
        epilog="The source is --topic-prefix (or CLAWSTREAM_KAFKA_TOPIC_PREFIX). Example, the batches of run A\n"
        "into B, then a fresh learner on B:\n  clawstream replay --topic-prefix runA. --to-prefix replayB.\n"
        "  clawstream learner --model-dir MODEL --weight-store NEW_DIR --topic-prefix replayB.\n"
        "Details: docs/replay.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--to-prefix", required=True, metavar="PREFIX", help="destination topic prefix (e.g. 'replay1.')"
    )
    parser.add_argument(
        "--topic",
        action="append",
        default=[],
        metavar="NAME",
        help="catalog topic to copy, repeatable (default: batches); e.g. batches, trajectories",
    )
    parser.add_argument(
        "--from",
        dest="from_offsets",
        action="append",
        default=[],
        metavar="[P:]OFFSET",
        help="first offset to copy, in every partition or in partition P (negative: counted back "
        "from the end; P:N only: only partition P); default: the beginning",
    )
    parser.add_argument(
        "--to",
        dest="to_offsets",
        action="append",
        default=[],
        metavar="[P:]OFFSET",
        help="copy offsets before this one (exclusive); default: the end as of the start",
    )
    parser.add_argument(
        "--since",
        metavar="TIME",
        help="from the first record at/after TIME: epoch ms, ISO 8601 "
        "(UTC unless a zone is given) or an age such as 2h, 30m, 7d",
    )
    parser.add_argument("--until", metavar="TIME", help="up to the first record at/after TIME (exclusive)")
    parser.add_argument("--rate", type=float, default=None, metavar="N", help="pace the copy to N records per second")
    parser.add_argument("--append", action="store_true", help="allow destination topics that already hold records")
    parser.add_argument(
        "--keep-timestamps",
        action="store_true",
        help="keep the source timestamps (old ones can fall out of retention at once)",
    )
    parser.add_argument("--dry-run", action="store_true", help="resolve ranges and plan batches; write nothing")
    parser.add_argument(
        "--commit-every",
        type=int,
        default=500,
        metavar="N",
        help="records per transaction outside the batches topic (default 500)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    try:
        kafka = kafka_settings(args)
        settings = load_settings(
            ReplaySettings,
            to_prefix=args.to_prefix,
            topics=args.topic or [BATCHES],
            from_offsets=args.from_offsets,
            to_offsets=args.to_offsets,
            since=args.since,
            until=args.until,
            rate=args.rate,
            append=args.append,
            keep_timestamps=args.keep_timestamps,
            dry_run=args.dry_run,
            commit_every=args.commit_every,
        )
        started = time.monotonic()
        copies = replay(kafka, settings)
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"dry_run": settings.dry_run, "topics": [c.to_json() for c in copies]}))
        return 0
    print(summary_text(copies, settings.dry_run))
    total = sum(c.records for c in copies)
    print(f"{'would copy' if settings.dry_run else 'copied'} {total} record(s) in {time.monotonic() - started:.1f}s")
    if any(c.source.endswith(BATCHES) for c in copies) and not settings.dry_run:
        dest = load_settings(KafkaSettings, **{**kafka.model_dump(), "topic_prefix": settings.to_prefix})
        print(
            "train a fresh learner on them (new group and weights topic come with the prefix; a new weight store, "
            f"since versions restart at v1):\n  {learner_command(dest)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
