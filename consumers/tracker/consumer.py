"""The tracker's loop: a run's topics in, MLflow writes out, consumer offsets committed only after the writes.

Topics in (the run's prefix; consumer group ``<prefix>tracker``): ``clawstream.metrics``, ``clawstream.weights``,
``clawstream.batches``. Nothing is produced. Per record: decode → writes (``consumers.tracker.writes``) → the
ones MLflow does not hold yet (the ledger, read back from MLflow at start) → MLflow; a chunk's offsets are committed
after its writes (on the batches topic never past an unsealed batch's first record). A tracker killed between a
write and its commit reads those records again and finds their writes in the ledger: every metric of every step is
logged exactly once. Fault point ``tracker.after_log`` (a record's writes in MLflow, its offset not committed).

Run: ``clawstream track --mlflow http://HOST:PORT --prefix PREFIX`` or ``python -m consumers.tracker ...``
(``--once``: read to the end, log the demo's report files from ``--run-dir``, end the MLflow run, exit).
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from clawbase.errors import ClawstreamError
from clawbase.faults import fault_point
from clawbase.kafka.clients import make_consumer, require_topics
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from consumers.tracker.mlflow_edge import TrackedRun, run_params
from consumers.tracker.settings import TrackerSettings
from consumers.tracker.trajectory_json import Decode
from consumers.tracker.writes import Batches, Ledger, Write, metric_writes, version_writes
from schemas.events import BatchRecord, Metric, WeightVersion
from schemas.topics import BATCHES, METRICS, WEIGHTS

log = logging.getLogger("clawstream.tracker")
TOPICS = (METRICS, WEIGHTS, BATCHES)
CHUNK = 500


class Tracker:
    """One clawstream run's topics → its MLflow run."""

    def __init__(self, kafka: KafkaSettings, settings: TrackerSettings) -> None:
        self.kafka, self.settings = kafka, settings
        self.run = TrackedRun(settings, kafka.topic_prefix)
        self.ledger: Ledger = self.run.ledger()
        self.batches = Batches(settings.samples_per_step)
        self.decode: Decode | None = _decoder(settings.model_dir)
        self.params_logged = False
        self.stopping = False
        self.consumer: Consumer = make_consumer(kafka, f"{kafka.topic_prefix}tracker")
        log.info(
            "MLflow run %s at %s: %d metric points, %d trajectories, %d versions already there",
            self.run.run_id,
            settings.mlflow_uri,
            len(self.ledger.metrics),
            len(self.ledger.artifacts),
            len(self.ledger.versions),
        )

    def follow(self) -> bool:
        """Until stopped (or, with ``once``, until every topic is read to its end as of now); with ``once``, whether
        the end was reached (then the report is logged and the MLflow run ended)."""
        names = [self.kafka.topic(t) for t in TOPICS]
        ends = self._ends(names) if self.settings.once else {}
        self.consumer.subscribe(names)
        try:
            while not self.stopping and not (ends and self._at_end(ends)):
                self._chunk()
            if not self.params_logged:
                self.run.log_params(run_params(self.settings))
            if self.stopping or not self.settings.once:
                return not self.settings.once
            if self.settings.run_dir is not None:
                print(f"report files logged: {self.run.log_report(self.settings.run_dir)}", flush=True)
            self.run.finish()
            return True
        finally:
            self.consumer.close()

    def _chunk(self) -> None:
        messages = self.consumer.consume(CHUNK, self.settings.poll_timeout_s)
        next_offsets: dict[tuple[str, int], int] = {}
        for msg in messages:
            if msg.error() is not None:
                log.warning("consumer error: %s", msg.error())
                continue
            self._apply(self._writes(msg))
            next_offsets[(msg.topic(), msg.partition())] = msg.offset() + 1
        if not next_offsets:
            return
        # The consumer's positions, past a transaction's commit marker: committed, a read to the end shows as one.
        for tp in self.consumer.position([TopicPartition(t, p) for t, p in next_offsets]):
            next_offsets[(tp.topic, tp.partition)] = max(tp.offset, next_offsets[(tp.topic, tp.partition)])
        held = self.batches.first_held_offset()
        batches = (self.kafka.topic(BATCHES), 0)
        if held is not None and batches in next_offsets:
            next_offsets[batches] = held  # an open batch's records are read again after a restart
        self.consumer.commit(
            offsets=[TopicPartition(t, p, o) for (t, p), o in next_offsets.items()], asynchronous=False
        )

    def _writes(self, msg: Message) -> list[Write]:
        topic, value = msg.topic(), msg.value()
        try:
            if topic == self.kafka.topic(METRICS):
                return metric_writes(Metric.from_bytes(value))
            if topic == self.kafka.topic(WEIGHTS):
                version = WeightVersion.from_bytes(value)
                if not self.params_logged:
                    self.run.log_params(run_params(self.settings, version.model_name))
                    self.params_logged = True
                return version_writes(version)
            return self.batches.add(msg.offset(), BatchRecord.from_bytes(value))
        except ClawstreamError as exc:  # a record this version cannot decode: the run goes on without it
            log.warning("%s[%d]@%d skipped: %s", topic, msg.partition(), msg.offset(), exc)
            return []

    def _apply(self, writes: list[Write]) -> None:
        new = self.ledger.new(writes)
        if not new:
            return
        self.run.write(new, self.decode)
        self.ledger.record(new)
        fault_point("tracker.after_log")  # in MLflow, offset not committed: a restart must not log it again

    def _ends(self, names: list[str]) -> dict[tuple[str, int], int]:
        ends: dict[tuple[str, int], int] = {}
        try:
            for name in names:
                for p in self.consumer.list_topics(name, timeout=30).topics[name].partitions:
                    ends[(name, p)] = self.consumer.get_watermark_offsets(TopicPartition(name, p), timeout=30)[1]
        except KafkaException as exc:
            raise ClawstreamError(f"cannot read the end offsets of {', '.join(names)}: {exc}") from exc
        return ends

    def _at_end(self, ends: dict[tuple[str, int], int]) -> bool:
        """Every partition read to ``ends`` (positions, so a transaction's trailing marker counts as read)."""
        assigned = {(tp.topic, tp.partition): tp for tp in self.consumer.assignment()}
        if not assigned:
            return False
        positions = self.consumer.position(list(assigned.values()))
        unread = [tp for tp in positions if tp.offset < 0]  # nothing fetched yet: the group's committed offset
        positions = [tp for tp in positions if tp.offset >= 0]
        positions += self.consumer.committed(unread, timeout=30) if unread else []
        reached = {(tp.topic, tp.partition) for tp in positions if tp.offset >= ends.get((tp.topic, tp.partition), 0)}
        empty = {tp for tp, end in ends.items() if end == 0}
        return set(ends) <= reached | empty


def _decoder(model_dir: Path | None) -> Decode | None:
    if model_dir is None:
        return None
    from consumers.analytics.records import load_tokenizer

    return load_tokenizer(model_dir)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clawstream track", description="Follow a run's topics into an MLflow run (consumers/tracker)."
    )
    parser.add_argument("--mlflow", metavar="URI", help="MLflow tracking server (env CLAWSTREAM_TRACKER_MLFLOW_URI)")
    parser.add_argument("--prefix", dest="topic_prefix", help="the run's topic prefix (as --topic-prefix)")
    parser.add_argument("--experiment", help="MLflow experiment (default clawstream)")
    parser.add_argument("--run-dir", help="a demo run's directory: its config as params, its report as artifacts")
    parser.add_argument("--model", dest="model_dir", help="model directory whose tokenizer decodes trajectories")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="one more run param")
    parser.add_argument("--samples-per-step", type=int, help="trajectories logged per step (default 2)")
    parser.add_argument("--once", action="store_true", help="read to the end, log the report, end the run, exit")
    add_kafka_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        kafka = kafka_settings(args)
        overrides: dict[str, Any] = {
            k: v
            for k, v in {
                "mlflow_uri": args.mlflow,
                "experiment": args.experiment,
                "run_dir": args.run_dir,
                "model_dir": args.model_dir,
                "samples_per_step": args.samples_per_step,
            }.items()
            if v is not None
        }
        if args.param:
            overrides["params"] = dict(p.split("=", 1) for p in args.param if "=" in p)
        if args.once:
            overrides["once"] = True
        settings = load_settings(TrackerSettings, **overrides)
        require_topics(kafka, TOPICS)
        tracker = Tracker(kafka, settings)
        signal.signal(signal.SIGTERM, lambda *_: setattr(tracker, "stopping", True))
        print(f"tracking prefix '{kafka.topic_prefix}' into MLflow run {tracker.run.run_id}", flush=True)
        if not tracker.follow():
            print("clawstream track: stopped before the end of the topics (--once)", flush=True)
            return 1
    except ClawstreamError as exc:
        print(f"clawstream track: {exc}", flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
