"""A step's outcome out of the learner: its version (or its dead letter) inside the step's transaction, with the
batch's offsets; what an operator sees of it (TensorBoard scalars, the step's log line, the ``vNNNNNN`` link) only
after that transaction commits.

Mixed into ``learner.train.Learner`` (its producer, consumer, settings and version state). Inside the transaction:
the ``WeightVersion`` on ``clawstream.weights``, the step's ``Metric`` on ``clawstream.metrics`` (or the batch's
dead letter on ``clawstream.deadletter``) and the batch's offsets. After the commit (:meth:`Publishing._committed`):
the scalars, the log line, the link to the published attempt and the removal of unpublished attempts' files. A crash
before the commit leaves none of them, so a retrained batch never shows twice. Fault points: ``learner.after_save``
(a version's files saved, nothing produced), ``learner.before_commit`` (the step's records in its open transaction).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from clawbase.faults import fault_point
from clawbase.kafka.clients import produce_reliably
from clawbase.settings import KafkaSettings
from clawbase.watchdog import deadline
from learner.batches import Refusal, SealedBatch
from learner.settings import LearnerSettings
from learner.version_files import VersionFiles, attempt_name
from learner.weights_http import published_uri
from schemas.dead_letter import dead_letter, dead_letter_of
from schemas.events import Metric, WeightVersion, now_ms
from schemas.topics import BATCHES, DEADLETTER, METRICS, WEIGHTS

log = logging.getLogger("clawstream.learner")
TXN_DEADLINE_S = 90.0  # transactional calls time out at 60 s; past this one they hung (clawbase.watchdog)


@dataclass
class Outcome:
    """What a step's transaction holds, for what follows its commit: the version published, or the refusal."""

    batch: SealedBatch
    version: WeightVersion | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    refusal: Refusal | None = None


class Publishing(VersionFiles):
    """The step's transaction's contents, its commit, and what follows the commit."""

    kafka: KafkaSettings
    settings: LearnerSettings
    producer: Producer
    consumer: Consumer
    writer: Any  # torch.utils.tensorboard.SummaryWriter | None
    weights_base_url: str | None
    version: int
    latest: WeightVersion | None
    trained: dict[str, int]
    published: set[str]  # attempt_name of every committed version

    def _publish_version(self, batch: SealedBatch, metrics: dict[str, float]) -> Outcome:
        version = self.version + 1
        saved = self._save_version(version)
        fault_point("learner.after_save")  # saved, not yet published: a crash here must not train the batch twice
        event = WeightVersion(
            policy_version=version,
            timestamp_ms=now_ms(),
            model_name=self.settings.model_name,
            step=batch.step,
            uri=published_uri(saved, self.settings.weight_store, self.weights_base_url),
            sha256=saved.sha256,
            size_bytes=saved.size_bytes,
            batch_id=batch.batch_id,
            metrics={k: v for k, v in metrics.items() if not k.startswith("rollouts/")},
        )
        self._produce(WEIGHTS, self.settings.model_name, event.to_bytes())
        metric = Metric(
            policy_version=version,
            timestamp_ms=now_ms(),
            source="learner",
            name="train_step",
            step=batch.step,
            values=metrics,
            labels={"model": self.settings.model_name},
        )
        self._produce(METRICS, "learner", metric.to_bytes())
        self.version, self.latest = version, event
        self.trained[batch.batch_id] = version
        return Outcome(batch, event, metrics)

    def _dead_letter(self, batch: SealedBatch, refusal: Refusal) -> Outcome:
        letter = dead_letter(
            "learner",
            refusal.reason,
            refusal.kind,
            topic=self.kafka.topic(BATCHES),
            partition=0,
            offset=batch.seal_offset,
            key=batch.batch_id.encode(),
            policy_version=self.version,
            value=batch.seal.to_bytes(),
        )
        self._produce(DEADLETTER, batch.batch_id, letter.to_bytes())
        return Outcome(batch, refusal=refusal)

    def _commit(self, batch: SealedBatch) -> None:
        """The batch's offsets into the transaction, and the transaction committed."""
        fault_point("learner.before_commit")  # the step's records are in its transaction: a crash here shows nothing
        with deadline("commit of a step", TXN_DEADLINE_S):  # a broker restart mid-transaction hung here
            offsets = [TopicPartition(self.kafka.topic(BATCHES), 0, batch.commit_offset)]
            self.producer.send_offsets_to_transaction(offsets, self.consumer.consumer_group_metadata(), 60)
            self.producer.commit_transaction(60)

    def _committed(self, outcome: Outcome) -> None:
        """What follows a step's commit, and only its commit: a crash before it shows nothing of the step."""
        batch, event, metrics = outcome.batch, outcome.version, outcome.metrics
        if event is None:
            reason = outcome.refusal.reason if outcome.refusal else "?"
            log.error("%s: batch %s not trained: %s; dead-lettered", self._where(batch), batch.batch_id, reason)
            return
        self._link(event)  # published: only now may vNNNNNN name this attempt's files
        self.published.add(attempt_name(event))
        self._remove_unpublished(self.published)
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, batch.step)
            self.writer.flush()
        log.info(
            "step %d → v%d: loss %.4e (policy %.4e), update KL %.3e, entropy %.3f, %s",
            batch.step,
            event.policy_version,
            metrics.get("loss", float("nan")),
            metrics.get("policy_loss", float("nan")),
            metrics.get("update_kl", float("nan")),
            metrics.get("entropy", float("nan")),
            {k: round(v, 3) for k, v in metrics.items() if k.startswith("reward/")},
        )

    def _produce(self, topic: str, key: str, value: bytes) -> None:
        produce_reliably(self.producer, self.kafka.topic(topic), key.encode(), value)

    def _dead_letter_raw(self, msg: Message, exc: Exception) -> None:
        # Its own small transaction (a transactional producer cannot write outside one). The record's offset is
        # committed with the next sealed batch; a crash before that dead-letters it again (at-least-once is fine here).
        letter = dead_letter_of(msg, "learner", str(exc), type(exc).__name__)
        self.producer.begin_transaction()
        produce_reliably(self.producer, self.kafka.topic(DEADLETTER), msg.key(), letter.to_bytes())
        with deadline("commit of a dead letter", TXN_DEADLINE_S):
            self.producer.commit_transaction(60)

    def _where(self, batch: SealedBatch) -> str:
        return f"{self.kafka.topic(BATCHES)}[0]@{batch.seal_offset}"  # topic[partition]@offset of its SEAL record


def tensorboard(settings: LearnerSettings) -> Any:  # SummaryWriter | None
    if settings.tensorboard_dir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("tensorboard is not installed; scalars go to clawstream.metrics only")
        return None
    return SummaryWriter(str(settings.tensorboard_dir))
