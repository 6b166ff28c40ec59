"""Where a training step's time goes, read back from the run's event log after the fact.

Topics in (the run's prefix, from the beginning, read_committed; nothing produced): ``clawstream.rollout.requests``,
``clawstream.rewards``, ``clawstream.trajectories``, ``clawstream.batches``, ``clawstream.weights``,
``clawstream.metrics`` (the grouper's ``group``, the learner's ``train_step``, the engine's ``weights_applied``).

For each trained batch (one weight version), from the events' own timestamps (ms, each stamped by its producer):

    requested   first request of the batch's rollouts (attempt 0) published by the scheduler
    rollouts    last reward of its rollouts (sandbox worker: harness exited, graded)
    settled     last trajectory of its rollouts (assembler: the rollout's calls, lifecycle and reward joined)
    grouped     last of its GRPO groups closed (grouper)
    sealed      the batch sealed (batcher)
    published   the learner's weight version for it (of which ``step_seconds`` were the training step itself)
    applied     the inference engine serving that version

and the phases are the differences (``rollouts`` = requested → rollouts, ``settle`` = rollouts → settled, …).
Pure decoding and arithmetic below :func:`read_timeline`, which is the Kafka edge.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end
from clawbase.settings import KafkaSettings
from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutRequest,
    Trajectory,
    WeightVersion,
)
from schemas.topics import BATCHES, METRICS, REWARDS, ROLLOUT_REQUESTS, TRAJECTORIES, WEIGHTS

POINTS = ("requested", "rollouts", "settled", "grouped", "sealed", "published", "applied")
PHASES = {
    "rollouts": ("requested", "rollouts"),
    "settle": ("rollouts", "settled"),
    "group": ("settled", "grouped"),
    "batch": ("grouped", "sealed"),
    "learner": ("sealed", "published"),
    "apply": ("published", "applied"),
}


def step_of_group(group_id: str) -> int | None:
    """The scheduler step in a group id ``suite/task|harness|step`` (None for another shape)."""
    tail = group_id.rsplit("|", 1)[-1]
    return int(tail) if tail.lstrip("-").isdigit() else None


@dataclass
class BatchTimes:
    """One trained batch (= one weight version): when each point was reached, in ms."""

    version: int
    batch_id: str
    steps: set[int] = field(default_factory=set)  # scheduler steps its groups came from
    at: dict[str, int] = field(default_factory=dict)
    learner_compute_s: float | None = None

    def phase(self, name: str) -> float | None:
        start, end = PHASES[name]
        if start in self.at and end in self.at:
            return (self.at[end] - self.at[start]) / 1000.0
        return None


def build_timeline(records: Mapping[str, Iterable[bytes]]) -> list[BatchTimes]:
    """Per trained batch, in version order, the time of each point (its own rollouts' times, not the step's:
    a batch may hold groups of two scheduler steps under policy lag); ``records``: topic → values."""
    requested: dict[str, int] = {}
    for raw in records.get(ROLLOUT_REQUESTS, ()):
        req = RolloutRequest.from_bytes(raw)
        if not req.eval and req.attempt == 0:
            requested[req.rollout_id] = req.timestamp_ms
    rewarded: dict[str, int] = {}
    for raw in records.get(REWARDS, ()):
        reward = RewardEvent.from_bytes(raw)
        if reward.status != RewardStatus.INFRA_FAILURE:
            rewarded[reward.rollout_id] = max(rewarded.get(reward.rollout_id, 0), reward.timestamp_ms)
    settled: dict[str, int] = {}
    for raw in records.get(TRAJECTORIES, ()):
        traj = Trajectory.from_bytes(raw)
        settled[traj.rollout_id] = max(settled.get(traj.rollout_id, 0), traj.timestamp_ms)
    members: dict[str, list[BatchRecord]] = defaultdict(list)
    seals: dict[str, int] = {}
    for raw in records.get(BATCHES, ()):
        rec = BatchRecord.from_bytes(raw)
        if rec.kind is BatchRecordKind.TRAJECTORY:
            members[rec.batch_id].append(rec)
        else:
            seals[rec.batch_id] = rec.timestamp_ms
    groups_closed: dict[str, int] = {}
    applied: dict[int, int] = {}
    compute: dict[int, float] = {}
    for raw in records.get(METRICS, ()):
        metric = Metric.from_bytes(raw)
        if metric.name == "group" and "group_id" in metric.labels:
            groups_closed[metric.labels["group_id"]] = metric.timestamp_ms
        elif metric.name == "weights_applied":
            applied.setdefault(metric.policy_version, metric.timestamp_ms)
        elif metric.name == "train_step" and "step_seconds" in metric.values:
            compute[metric.policy_version] = metric.values["step_seconds"]
    out = []
    for raw in records.get(WEIGHTS, ()):
        version = WeightVersion.from_bytes(raw)
        recs = members.get(version.batch_id or "", [])
        if not recs:
            continue
        t = BatchTimes(version.policy_version, version.batch_id or "")
        rids = [r.rollout_id for r in recs if r.rollout_id]
        gids = {r.group_id for r in recs if r.group_id}
        t.steps = {s for g in gids if (s := step_of_group(g)) is not None}
        for name, table, pick in (
            ("requested", requested, min),
            ("rollouts", rewarded, max),
            ("settled", settled, max),
            ("grouped", groups_closed, max),
        ):
            keys = gids if name == "grouped" else rids
            known = [table[k] for k in keys if k in table]
            if known:
                t.at[name] = pick(known)
        if version.batch_id in seals:
            t.at["sealed"] = seals[version.batch_id]
        t.at["published"] = version.timestamp_ms
        if version.policy_version in applied:
            t.at["applied"] = applied[version.policy_version]
        t.learner_compute_s = compute.get(version.policy_version)
        out.append(t)
    return sorted(out, key=lambda t: t.version)


def timeline_table(batches: list[BatchTimes]) -> str:
    """Markdown: per trained batch the seconds of each phase, the learner's compute within its phase, the whole
    (first request → served), and the gap since the previous version was served (the loop's period)."""
    names = list(PHASES)
    lines = [
        "| version | steps | " + " | ".join(names) + " | of which learner compute | requested → served | "
        "since previous served |",
        "|---|---|" + "---|" * (len(names) + 3),
    ]
    previous: int | None = None
    for t in batches:
        cells = [_s(t.phase(n)) for n in names]
        total = (t.at["applied"] - t.at["requested"]) / 1000 if {"applied", "requested"} <= t.at.keys() else None
        period = (t.at["applied"] - previous) / 1000 if previous is not None and "applied" in t.at else None
        steps = ",".join(str(s) for s in sorted(t.steps)) or "-"
        lines.append(
            f"| v{t.version} | {steps} | " + " | ".join(cells) + f" | {_s(t.learner_compute_s)} | "
            f"{_s(total)} | {_s(period)} |"
        )
        previous = t.at.get("applied", previous)
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def timeline_rows(batches: list[BatchTimes]) -> list[dict[str, object]]:
    """summary.json's rows: per trained batch its points (ms), each phase's seconds and the learner's compute."""
    return [
        {
            "version": t.version,
            "batch_id": t.batch_id,
            "steps": sorted(t.steps),
            "at": t.at,
            "phases_s": {name: t.phase(name) for name in PHASES},
            "learner_compute_s": t.learner_compute_s,
        }
        for t in batches
    ]


def read_topics(kafka: KafkaSettings, topics: Iterable[str], timeout: float = 60.0) -> dict[str, list[bytes]]:
    """Every committed record of each of ``topics`` under the run's prefix, from the beginning to its current end."""
    records: dict[str, list[bytes]] = {}
    for topic in topics:
        consumer = make_consumer(kafka, f"{kafka.topic_prefix}timeline-{uuid.uuid4().hex[:8]}")
        try:
            name = kafka.topic(topic)
            ends = assign_from_beginning(consumer, name, timeout, missing_ok=True)
            records[topic] = [m.value() for m in read_to_end(consumer, name, ends, timeout=timeout)]
        finally:
            consumer.close()
    return records


def read_timeline(kafka: KafkaSettings, timeout: float = 60.0) -> list[BatchTimes]:
    """Read the run's topics to their current ends and build the timeline."""
    return build_timeline(
        read_topics(kafka, (ROLLOUT_REQUESTS, REWARDS, TRAJECTORIES, BATCHES, WEIGHTS, METRICS), timeout)
    )
