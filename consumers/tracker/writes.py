"""Events → MLflow writes, and the ledger that makes them idempotent (pure: no Kafka, no MLflow).

A write is keyed so that doing it twice is detectable: a metric by (metric, step), an artifact by its path (which
holds the step or version), a model version by its policy version; the run is the tracker's one MLflow run. The
:class:`Ledger` holds the keys already in MLflow (read back from MLflow when the tracker starts, then kept as it
writes) and :meth:`Ledger.new` drops every write it holds, so re-reading records after a restart writes nothing
twice.

From the topics (the run's prefix):

* ``clawstream.metrics``, the learner's ``train_step``: every value at its step (reward per harness, loss,
  ``policy_loss``, ``clip_frac``, ``is_weight_mean``, ``update_kl``, ``entropy``, ``tokens_per_s``, ...);
* ``clawstream.weights``: ``policy_version`` at the version's step, and the version itself (:class:`VersionWrite`);
* ``clawstream.batches``: a batch is held until its SEAL, then ``staleness/mean|max`` (versions behind the newest
  the batcher knew at the seal), ``batch/trajectories/<harness>`` and ``samples`` of its trajectories chosen by the
  smallest sha256 of their rollout ids (the same choice whatever the read order or restarts).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from schemas.events import BatchRecord, BatchRecordKind, Metric, Trajectory, WeightVersion


@dataclass(frozen=True)
class MetricWrite:
    key: str
    value: float
    step: int
    timestamp_ms: int


@dataclass(frozen=True)
class TrajectoryWrite:
    """One sampled trajectory, logged as the JSON artifact ``path``."""

    path: str
    trajectory: Trajectory
    batch_id: str
    advantage: float


@dataclass(frozen=True)
class VersionWrite:
    """One weight version: a pointer artifact (its URI and sha256; the weights are not copied) and a model version."""

    policy_version: int
    step: int
    model_name: str
    uri: str
    sha256: str
    size_bytes: int
    batch_id: str | None
    timestamp_ms: int

    @property
    def path(self) -> str:
        return f"weights/v{self.policy_version:06d}"


Write = MetricWrite | TrajectoryWrite | VersionWrite


@dataclass
class Ledger:
    """What the MLflow run already holds: (metric, step) pairs, artifact paths, policy versions registered."""

    metrics: set[tuple[str, int]] = field(default_factory=set)
    artifacts: set[str] = field(default_factory=set)
    versions: set[int] = field(default_factory=set)

    def new(self, writes: list[Write]) -> list[Write]:
        """The writes not yet in MLflow (nor twice in ``writes``)."""
        out: list[Write] = []
        seen: set[tuple[str, Any]] = set()
        for write in writes:
            key = _key(write)
            if key in seen or self._holds(write):
                continue
            seen.add(key)
            out.append(write)
        return out

    def record(self, writes: list[Write]) -> None:
        """``writes`` are in MLflow now."""
        for write in writes:
            if isinstance(write, MetricWrite):
                self.metrics.add((write.key, write.step))
            elif isinstance(write, TrajectoryWrite):
                self.artifacts.add(write.path)
            else:
                self.versions.add(write.policy_version)

    def _holds(self, write: Write) -> bool:
        if isinstance(write, MetricWrite):
            return (write.key, write.step) in self.metrics
        if isinstance(write, TrajectoryWrite):
            return write.path in self.artifacts
        return write.policy_version in self.versions


def _key(write: Write) -> tuple[str, Any]:
    if isinstance(write, MetricWrite):
        return ("metric", (write.key, write.step))
    if isinstance(write, TrajectoryWrite):
        return ("artifact", write.path)
    return ("version", write.policy_version)


def metric_writes(metric: Metric) -> list[Write]:
    """The learner's per-step values; other sources' measurements have no training step to key them by."""
    if metric.name != "train_step" or metric.step is None:
        return []
    return [MetricWrite(k, float(v), metric.step, metric.timestamp_ms) for k, v in sorted(metric.values.items())]


def version_writes(version: WeightVersion) -> list[Write]:
    return [
        MetricWrite("policy_version", float(version.policy_version), version.step, version.timestamp_ms),
        VersionWrite(
            version.policy_version,
            version.step,
            version.model_name,
            version.uri,
            version.sha256,
            version.size_bytes,
            version.batch_id,
            version.timestamp_ms,
        ),
    ]


@dataclass
class Batches:
    """The batches topic's records held until their SEAL (one partition: a batch's records arrive in order)."""

    samples_per_step: int = 2
    held: list[tuple[int, BatchRecord]] = field(default_factory=list)  # (offset, record) of the open batch

    def add(self, offset: int, record: BatchRecord) -> list[Write]:
        """Writes of a sealed batch (at its SEAL), else none yet."""
        if record.kind is BatchRecordKind.TRAJECTORY:
            if self.held and self.held[0][1].batch_id != record.batch_id:
                self.held.clear()  # an unsealed batch's records followed by another batch: it never trains
            self.held.append((offset, record))
            return []
        members = [r for _, r in self.held if r.batch_id == record.batch_id]
        self.held.clear()
        return sealed_writes(record, members, self.samples_per_step)

    def first_held_offset(self) -> int | None:
        """The offset to resume from while a batch is open (its records are needed again at its SEAL)."""
        return self.held[0][0] if self.held else None


def sealed_writes(seal: BatchRecord, members: list[BatchRecord], samples: int) -> list[Write]:
    ts, step = seal.timestamp_ms, seal.step
    writes: list[Write] = []
    if members:
        behind = [max(0, seal.policy_version - r.policy_version) for r in members]
        writes += [
            MetricWrite("staleness/mean", sum(behind) / len(behind), step, ts),
            MetricWrite("staleness/max", float(max(behind)), step, ts),
        ]
    writes += [
        MetricWrite(f"batch/trajectories/{h}", float(n), step, ts) for h, n in sorted(seal.harness_counts.items())
    ]
    chosen = sorted(
        ((r, r.trajectory) for r in members if r.trajectory is not None), key=lambda rb: _digest(rb[0].rollout_id or "")
    )
    for record, data in chosen[:samples]:
        trajectory = Trajectory.from_bytes(data)
        path = f"trajectories/step_{step:06d}/{trajectory.harness}-{trajectory.rollout_id}.json"
        writes.append(TrajectoryWrite(path, trajectory, seal.batch_id, record.advantage))
    return writes


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
