"""Reconcile a run's event log (pure): was anything lost, doubled or trained twice?

Input: the few fields of each record that the guarantees are about (:class:`RunLog`, filled by
``consumers.analytics.audit`` from the topics, or by tests by hand). Output: an :class:`AuditReport` — counts per
topic, and every violation with the record it is about. The rules, each a guarantee the system makes:

1. every started attempt has exactly one terminal status — its reward event, or, for an attempt whose worker died
   before grading, the trajectory the streams settled it into — and its lifecycle moves are allowed ones;
2. every settled attempt is in exactly one trajectory, and a trajectory's reward is that attempt's own reward — but
   of two runs of one request (same rollout id and request attempt: a worker died after the first one's reward and
   before releasing it, docs/faults.md) exactly one is trained, the other counted as a re-run set aside;
3. every trajectory is in at most one batch; every sealed batch has exactly the records its seal announces;
4. every batch is trained at most once, and only a sealed batch; weight versions are contiguous from 1;
5. dead letters are listed with their reasons (not a violation: the system's way to set bad input aside).

Idempotent and order-free: the same records give the same report however often and in whatever order they come.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from schemas.events import RolloutState
from schemas.lifecycle import can_transition

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


@dataclass(frozen=True)
class Settled:
    """A trajectory (or a batch's copy of one): which attempt it is made of, and the reward it carries."""

    rollout_id: str
    attempt_id: str
    status: str
    reward: float | None
    where: Where


@dataclass(frozen=True)
class BatchEntry:
    batch_id: str
    kind: str  # TRAJECTORY | SEAL
    index: int
    trajectory: Settled | None  # TRAJECTORY records only
    where: Where


@dataclass(frozen=True)
class Version:
    policy_version: int
    batch_id: str | None
    where: Where


@dataclass
class RunLog:
    lifecycle: list[Lifecycle] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    trajectories: list[Settled] = field(default_factory=list)
    batches: list[BatchEntry] = field(default_factory=list)
    versions: list[Version] = field(default_factory=list)
    dead_letters: list[tuple[str, str, Where]] = field(default_factory=list)  # (source, reason, where)
    undecodable: list[tuple[str, Where]] = field(default_factory=list)  # (error, where)
    counts: dict[str, int] = field(default_factory=dict)  # records read per topic


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
        }


def reconcile(log: RunLog) -> AuditReport:
    """Check every rule over ``log``; see the module docstring."""
    out: list[Violation] = []
    attempts = _check_attempts(log, out)
    settled, reruns = _check_trajectories(log, attempts, out)
    batched, sealed = _check_batches(log, out)
    trained = _check_versions(log, sealed, out)
    dead = Counter(
        f"{source}: {reason.splitlines()[0][:160] if reason else ''}" for source, reason, _ in log.dead_letters
    )
    return AuditReport(
        counts=dict(log.counts),
        attempts=len(attempts),
        settled=settled,
        batched=batched,
        batches_sealed=len(sealed),
        batches_trained=trained,
        versions=len({v.policy_version for v in log.versions}),
        violations=out,
        dead_letters=dict(dead.most_common()),
        undecodable=[f"{where}: {error}" for error, where in log.undecodable],
        reruns_set_aside=reruns,
    )


def _check_attempts(log: RunLog, out: list[Violation]) -> dict[str, list[Reward]]:
    """Rule 1. Returns every attempt (from lifecycle or rewards) → its reward events."""
    moves: dict[str, list[Lifecycle]] = defaultdict(list)
    for ev in sorted(log.lifecycle, key=lambda e: (e.where.partition, e.where.offset)):
        moves[ev.attempt_id].append(ev)
    rewards: dict[str, list[Reward]] = defaultdict(list)
    for r in log.rewards:
        rewards[r.attempt_id].append(r)
    for attempt_id, events in moves.items():
        state: RolloutState | None = None
        for ev in events:
            if not can_transition(state, ev.state):
                out.append(
                    Violation(
                        DUPLICATED if ev.state == state else INCONSISTENT,
                        "lifecycle",
                        f"attempt {attempt_id} of {ev.rollout_id}: {state.value if state else 'start'} → "
                        f"{ev.state.value} at {ev.where}",
                    )
                )
            else:
                state = ev.state
    settled_without_reward = {t.attempt_id for t in log.trajectories if t.reward is None}
    for attempt_id in sorted(set(moves) | set(rewards)):
        got = rewards.get(attempt_id, [])
        rollout = (moves.get(attempt_id) or got)[0].rollout_id
        if not got and attempt_id not in settled_without_reward:
            out.append(
                Violation(LOST, "terminal status", f"attempt {attempt_id} of {rollout}: no reward, no trajectory")
            )
        elif len(got) > 1:
            at = ", ".join(str(r.where) for r in got)
            out.append(
                Violation(
                    DUPLICATED, "terminal status", f"attempt {attempt_id} of {rollout}: {len(got)} rewards ({at})"
                )
            )
    return {a: rewards.get(a, []) for a in set(moves) | set(rewards)}


def _check_trajectories(log: RunLog, attempts: dict[str, list[Reward]], out: list[Violation]) -> tuple[int, int]:
    """Rule 2. Returns the number of attempts settled into a trajectory, and of re-runs set aside."""
    by_attempt: dict[str, list[Settled]] = defaultdict(list)
    for t in log.trajectories:
        by_attempt[t.attempt_id].append(t)
    for attempt_id, trajs in sorted(by_attempt.items()):
        if len(trajs) > 1:
            at = ", ".join(str(t.where) for t in trajs)
            out.append(
                Violation(DUPLICATED, "one trajectory", f"attempt {attempt_id}: {len(trajs)} trajectories ({at})")
            )
        t = trajs[0]
        if attempt_id not in attempts:
            out.append(
                Violation(INCONSISTENT, "one trajectory", f"trajectory at {t.where} is of unknown attempt {attempt_id}")
            )
            continue
        own = attempts[attempt_id]
        if t.reward is not None and not any(r.reward == t.reward for r in own):
            out.append(
                Violation(
                    INCONSISTENT,
                    "reward joined",
                    f"trajectory at {t.where} carries reward {t.reward}, attempt {attempt_id}'s own: "
                    f"{[r.reward for r in own]}",
                )
            )
    trained_requests = {request_of(t.rollout_id, t.attempt_id) for t in log.trajectories if t.status != "INFRA_FAILURE"}
    reruns = 0
    for attempt_id, own in sorted(attempts.items()):
        if own and attempt_id not in by_attempt:  # (started, never graded: rule 1 reports it)
            if request_of(own[0].rollout_id, attempt_id) in trained_requests:
                reruns += 1
                continue
            out.append(
                Violation(
                    LOST, "one trajectory", f"attempt {attempt_id} of {own[0].rollout_id} settled in no trajectory"
                )
            )
    return len(by_attempt), reruns


def _check_batches(log: RunLog, out: list[Violation]) -> tuple[int, set[str]]:
    """Rule 3. Returns (trajectories in batches, ids of sealed batches)."""
    members: dict[str, list[BatchEntry]] = defaultdict(list)
    seals: dict[str, list[BatchEntry]] = defaultdict(list)
    for entry in log.batches:
        (seals if entry.kind == "SEAL" else members)[entry.batch_id].append(entry)
    in_batches: dict[str, list[str]] = defaultdict(list)
    for batch_id, entries in members.items():
        for e in entries:
            if e.trajectory is not None:
                in_batches[e.trajectory.attempt_id].append(f"{batch_id}#{e.index}")
    for attempt_id, where in sorted(in_batches.items()):
        if len(where) > 1:
            out.append(
                Violation(DUPLICATED, "one batch", f"attempt {attempt_id}'s trajectory is in {', '.join(where)}")
            )
    for batch_id, closing in sorted(seals.items()):
        if len(closing) > 1:
            out.append(Violation(DUPLICATED, "sealed batch", f"batch {batch_id} sealed {len(closing)} times"))
        announced = closing[0].index
        got = sorted(e.index for e in members.get(batch_id, []))
        if got != list(range(announced)):
            out.append(
                Violation(
                    LOST if len(got) < announced else DUPLICATED,
                    "sealed batch",
                    f"batch {batch_id}: seal at {closing[0].where} announces {announced} records, found indices {got}",
                )
            )
    return sum(len(w) for w in in_batches.values()), set(seals)


def _check_versions(log: RunLog, sealed: set[str], out: list[Violation]) -> int:
    """Rule 4. Returns the number of batches trained."""
    by_batch: dict[str, list[Version]] = defaultdict(list)
    for v in log.versions:
        if v.batch_id:
            by_batch[v.batch_id].append(v)
    for batch_id, vs in sorted(by_batch.items()):
        if len(vs) > 1:
            out.append(
                Violation(
                    TRAINED_TWICE, "trained once", f"batch {batch_id} trained into {[v.policy_version for v in vs]}"
                )
            )
        if batch_id not in sealed:
            out.append(
                Violation(
                    INCONSISTENT, "trained once", f"version {vs[0].policy_version} trained unsealed batch {batch_id}"
                )
            )
    numbers = sorted(v.policy_version for v in log.versions)
    for n, count in Counter(numbers).items():
        if count > 1:
            out.append(Violation(DUPLICATED, "versions contiguous", f"version {n} published {count} times"))
    distinct = sorted(set(numbers))
    if distinct and distinct != list(range(distinct[0], distinct[0] + len(distinct))):
        gaps = sorted(set(range(distinct[0], distinct[-1] + 1)) - set(distinct))
        out.append(
            Violation(LOST, "versions contiguous", f"versions {gaps} missing between {distinct[0]} and {distinct[-1]}")
        )
    if distinct and distinct[0] != 1:
        out.append(Violation(INCONSISTENT, "versions contiguous", f"first version is {distinct[0]}, not 1"))
    return len(by_batch)
