"""The audit's view of a run (pure data): the few fields of each record the guarantees are about, and the report.

``consumers.analytics.audit`` fills a :class:`RunLog` from the topics (tests fill one by hand);
``consumers.analytics.reconcile`` judges it into an :class:`AuditReport`. Every record keeps its :class:`Where`
(``topic[partition]@offset``) so that a violation can name it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from schemas.events import RolloutState

LOST, DUPLICATED, TRAINED_TWICE, INCONSISTENT = "lost", "duplicated", "trained twice", "inconsistent"
_REQUEST_ATTEMPT = re.compile(r"\.a(\d+)\.[^.]*$")  # attempt ids are {rollout_id}.a{attempt}.{random}


def request_of(rollout_id: str, attempt_id: str) -> tuple[str, str]:
    """(rollout id, request attempt number) of an attempt id; the id itself when it does not have that form."""
    match = _REQUEST_ATTEMPT.search(attempt_id)
    return (rollout_id, match.group(1) if match else attempt_id)


@dataclass(frozen=True)
class Where:
    """A record's place in the log: ``topic[partition]@offset``."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass(frozen=True)
class Lifecycle:
    rollout_id: str
    attempt_id: str
    state: RolloutState
    where: Where


@dataclass(frozen=True)
class Reward:
    rollout_id: str
    attempt_id: str
    status: str
    reward: float | None
    where: Where


@dataclass(frozen=True, slots=True)
class Request:
    """A rollout request the scheduler published: which rollout and attempt, its group, and how many attempts the
    scheduler allows the rollout (``max_attempts`` as the request announced it; None when it did not)."""

    rollout_id: str
    attempt: int
    where: Where
    group_id: str = ""
    max_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class Call:
    """A model call the proxy recorded: whose attempt it served (None: the registration named none), and whether its
    request held an assistant turn the proxy never generated (``tampered``). Kept for every call: slotted."""

    rollout_id: str
    attempt_id: str | None
    tampered: bool
    where: Where


@dataclass(frozen=True)
class Settled:
    """A trajectory (or a batch's copy of one): which attempt it is made of, and the reward it carries. ``trainable``
    (a non-eval COMPLETE / TIMED_OUT with a reward and segments) and ``group_id``: None when unknown."""

    rollout_id: str
    attempt_id: str
    status: str
    reward: float | None
    where: Where
    group_id: str | None = None
    trainable: bool | None = None
    drop_reason: str | None = None
    timestamp_ms: int = 0


@dataclass(frozen=True)
class BatchEntry:
    batch_id: str
    kind: str  # TRAJECTORY | SEAL
    index: int
    trajectory: Settled | None  # TRAJECTORY records only
    where: Where
    group_id: str | None = None
    step: int | None = None
    harness: str = ""
    timestamp_ms: int = 0


@dataclass(frozen=True)
class Version:
    policy_version: int
    batch_id: str | None
    where: Where


@dataclass(frozen=True)
class Letter:
    """A dead letter: who set what aside and why; ``key`` its original key (a batch id for the learner's), ``group_id``
    the group a batcher's drop names."""

    source: str
    reason: str
    where: Where
    error_type: str = ""
    rollout_id: str | None = None
    key: str | None = None
    group_id: str | None = None


@dataclass
class RunLog:
    lifecycle: list[Lifecycle] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    trajectories: list[Settled] = field(default_factory=list)
    batches: list[BatchEntry] = field(default_factory=list)
    versions: list[Version] = field(default_factory=list)
    dead_letters: list[Letter] = field(default_factory=list)
    undecodable: list[tuple[str, Where]] = field(default_factory=list)  # (error, where)
    counts: dict[str, int] = field(default_factory=dict)  # records read per topic
    scored: list[BatchEntry] = field(default_factory=list)  # the grouper's SEALs, in the batcher's input order
    calls: list[Call] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class Violation:
    kind: str  # LOST | DUPLICATED | TRAINED_TWICE | INCONSISTENT
    rule: str
    detail: str


@dataclass
class AuditReport:
    counts: dict[str, int]
    attempts: int
    settled: int
    batched: int
    batches_sealed: int
    batches_trained: int
    versions: int
    violations: list[Violation]
    dead_letters: dict[str, int]  # "source: reason" → count
    undecodable: list[str]
    reruns_set_aside: int = 0  # second runs of a request whose first run was trained (rule 2)
    in_flight: dict[str, int] = field(default_factory=dict)  # what the run still held when it stopped
    short_groups: list[str] = field(default_factory=list)  # groups trained without some members, each with its reason
    set_aside: list[str] = field(default_factory=list)  # groups and batches refused for a cause (stale, poison)

    @property
    def clean(self) -> bool:
        return not self.violations and not self.undecodable

    def tally(self) -> dict[str, int]:
        by_kind = Counter(v.kind for v in self.violations)
        return {k: by_kind.get(k, 0) for k in (LOST, DUPLICATED, TRAINED_TWICE, INCONSISTENT)}

    def to_json(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            **self.tally(),
            "counts": self.counts,
            "attempts": self.attempts,
            "settled": self.settled,
            "batched_trajectories": self.batched,
            "batches_sealed": self.batches_sealed,
            "batches_trained": self.batches_trained,
            "versions": self.versions,
            "violations": [vars(v) for v in self.violations],
            "dead_letters": self.dead_letters,
            "undecodable": self.undecodable,
            "reruns_set_aside": self.reruns_set_aside,
            "in_flight": self.in_flight,
            "short_groups": self.short_groups,
            "set_aside": self.set_aside,
        }
