"""Reconcile a run's event log (pure): was anything lost, doubled or trained twice?

Input: a :class:`RunLog` (``consumers.analytics.run_log``; filled by ``consumers.analytics.audit``). Output: an
:class:`AuditReport`: every violation naming its rollout, group and batch, and what was in flight when the run
stopped. The rules (``RULES``; from groups on in ``consumers.analytics.reconcile_downstream``), stage by stage:
1. an attempt has one terminal status (its reward, or the trajectory the streams settled a dead worker's attempt
   into) and moves as ``schemas.lifecycle`` allows; a request runs or is dead-lettered for a cause, never as a
   replay unrun (``lifecycle``, ``terminal status``, ``request settled``);
2. a graded attempt is in exactly one trajectory carrying its own reward; a second run of one request (a worker died
   between reward and release, docs/faults.md) is a re-run set aside; a rollout's reward is trained at most once
   across its runs (``one trajectory``, ``reward joined``, ``request trained once``);
3. a batched group holds every trainable member that settled before its batch formed; one left out for a reason
   (out of attempts, poison) makes it *short*, reported; with attempts left it is a loss (``group whole``);
4. a scored group is batched or dropped for a reason: a stale group is set aside; a consistency drop
   (``IncompleteGroup``) or a group passed over for a younger one of its harness is a loss (``group batched``);
5. a trajectory is in at most one batch, a seal announces its records, batch numbers have no gap (``one batch``,
   ``sealed batch``, ``batches contiguous``);
6. a sealed batch is trained once or refused for a cause; a kill (``TrainingStepKilled``, written by learners that
   took kills for out-of-memory deaths) or a seal count refused is a loss, as is a batch passed over for a later one
   (``batch trained``, ``trained once``); ``TrainingStepOutOfMemory`` (with the evidence) is a cause; versions from 1;
7. no trained batch holds a trajectory of an attempt with a ``tampered`` call (its request held an assistant turn the
   proxy never generated); such a rollout settles DROPPED and its group trains short (``tampered never trained``).

In flight: requests not taken, groups not closed or held by the batcher, batches sealed after the last trained one.
``reconcile(log, skip=...)`` leaves rules out (the mutation tests show each is needed). Idempotent, order-free."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from consumers.analytics.reconcile_downstream import Flow
from consumers.analytics.run_log import (
    DUPLICATED,
    INCONSISTENT,
    LOST,
    TRAINED_TWICE,
    AuditReport,
    BatchEntry,
    Call,
    Letter,
    Lifecycle,
    Request,
    Reward,
    RunLog,
    Settled,
    Version,
    Violation,
    Where,
    request_of,
)
from schemas.events import RolloutState
from schemas.lifecycle import can_transition

__all__ = [  # the run log's names, re-exported: callers import them from here with reconcile()
    "DUPLICATED",
    "INCONSISTENT",
    "LOST",
    "RULES",
    "TRAINED_TWICE",
    "AuditReport",
    "BatchEntry",
    "Call",
    "Letter",
    "Lifecycle",
    "Request",
    "Reward",
    "RunLog",
    "Settled",
    "Version",
    "Violation",
    "Where",
    "reconcile",
    "request_of",
]

_NAMED_ATTEMPT = re.compile(r"\battempt (\d+)\b")  # the request a sandbox worker's dead letter names


RULES = (
    "lifecycle",
    "terminal status",
    "request settled",
    "one trajectory",
    "reward joined",
    "request trained once",
    "group whole",
    "group batched",
    "one batch",
    "sealed batch",
    "batches contiguous",
    "batch trained",
    "trained once",
    "versions contiguous",
    "tampered never trained",
)


def reconcile(log: RunLog, *, skip: frozenset[str] | set[str] = frozenset()) -> AuditReport:
    """Check every rule over ``log`` but those named in ``skip`` (see ``RULES``); see the module docstring."""
    unknown = set(skip) - set(RULES)
    if unknown:
        raise ValueError(f"skip names no rule: {sorted(unknown)}; the rules are {list(RULES)}")
    out: list[Violation] = []
    attempts = _check_attempts(log, out)
    settled, reruns = _check_trajectories(log, attempts, out)
    batched, sealed = _check_batches(log, out)
    trained = _check_versions(log, sealed, out)
    flow = Flow(log)
    report = AuditReport(
        counts=dict(log.counts),
        attempts=len(attempts),
        settled=settled,
        batched=batched,
        batches_sealed=len(sealed),
        batches_trained=trained,
        versions=len({v.policy_version for v in log.versions}),
        violations=out,
        dead_letters=dict(
            Counter(
                f"{d.source}: {d.reason.splitlines()[0][:160] if d.reason else ''}" for d in log.dead_letters
            ).most_common()
        ),
        undecodable=[f"{where}: {error}" for error, where in log.undecodable],
        reruns_set_aside=reruns,
    )
    _check_requests(log, report, out)
    flow.check(report)
    report.violations = [v for v in out if v.rule not in skip]
    return report


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


def _check_requests(log: RunLog, report: AuditReport, out: list[Violation]) -> None:
    """Rule 1b: every request reaches a terminal status (rule 1 follows an attempt from its first event) or a reasoned
    dead letter. A request never run — no event, reward or trajectory of its attempt, no later attempt of its rollout —
    is lost when the sandbox worker dead-lettered it as a replay, duplicate or stale (``DuplicateRequest``: that
    worker thought another run stood for it), or when a later request of its partition was taken (workers read a
    partition in order); a poison request's dead letter is a cause; with neither, it was not taken yet (in flight)."""
    latest: dict[str, int] = {}  # rollout → its latest attempt number with any record
    ran: set[tuple[str, str]] = set()
    for rid, aid in [(x.rollout_id, x.attempt_id) for xs in (log.lifecycle, log.rewards, log.trajectories) for x in xs]:
        rollout, n = request_of(rid, aid)
        ran.add((rollout, n))
        # an attempt id that names no request number counts for every request of its rollout
        latest[rollout] = max(latest.get(rollout, -1), int(n) if n.isdigit() else 1 << 62)
    letters: dict[str, list[Letter]] = defaultdict(list)
    for d in sorted(log.dead_letters, key=lambda d: (d.where.partition, d.where.offset)):
        if d.source == "sandbox_worker" and d.rollout_id:
            letters[d.rollout_id].append(d)
    first: dict[tuple[str, int], Request] = {}
    verdict: dict[tuple[str, int], Letter | bool] = {}  # True: run; a letter: dead-lettered; False: no trace
    taken: dict[tuple[str, int], int] = {}  # requests partition → the last offset read (run or dead-lettered)
    for q in sorted(log.requests, key=lambda q: (q.where.partition, q.where.offset)):
        key = (q.rollout_id, q.attempt)
        first.setdefault(key, q)
        if key not in verdict:
            named = [d for d in letters.get(q.rollout_id, []) if _names_attempt(d, q.attempt)]
            run = (q.rollout_id, str(q.attempt)) in ran or latest.get(q.rollout_id, -1) > q.attempt
            verdict[key] = True if run else (named[0] if named else False)
        if verdict[key] is not False:
            part = (q.where.topic, q.where.partition)
            taken[part] = max(taken.get(part, -1), q.where.offset)
    waiting = 0
    for key, q in sorted(first.items(), key=lambda kv: (kv[1].where.partition, kv[1].where.offset)):
        what = f"request {q.rollout_id} attempt {q.attempt} (group {q.group_id or '-'}, at {q.where})"
        found = verdict[key]
        if found is True:
            continue
        if isinstance(found, Letter) and found.error_type != "DuplicateRequest":
            report.set_aside.append(f"{what}: {found.reason.splitlines()[0][:200]}")
        elif isinstance(found, Letter):
            out.append(
                Violation(
                    LOST,
                    "request settled",
                    f"{what} dead-lettered by the sandbox worker at {found.where} "
                    f"({found.reason.splitlines()[0][:200]}) and never run: no lifecycle event, no reward, no "
                    "trajectory, no other attempt",
                )
            )
        elif (last := taken.get((q.where.topic, q.where.partition), -1)) > q.where.offset:
            out.append(
                Violation(
                    LOST,
                    "request settled",
                    f"{what} never run nor dead-lettered, while the later request at "
                    f"{q.where.topic}[{q.where.partition}]@{last} was taken",
                )
            )
        else:
            waiting += 1
    if waiting:
        report.in_flight["requests not taken yet"] = waiting


def _names_attempt(letter: Letter, attempt: int) -> bool:
    """Whether a sandbox worker's dead letter of the rollout is about ``attempt`` (one naming no attempt: any)."""
    named = _NAMED_ATTEMPT.search(letter.reason)
    return named is None or int(named.group(1)) == attempt


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
