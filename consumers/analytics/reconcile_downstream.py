"""The audit's downstream rules (pure): what the settled trajectories became — whole groups, batches, trained versions.

``Flow(log).check(report)`` follows the trajectories of a :class:`RunLog` into the batcher's groups and batches and
the learner's versions, and appends to ``report`` what it finds (rule numbers as in ``consumers.analytics.reconcile``,
which runs it with the rules over attempts, trajectories, batch records and versions):
* ``request trained once``: a rollout's reward is trained at most once across its runs;
* ``group whole`` (3): a batched group holds every trainable member that settled before its batch formed; members
  left out for a reason (out of attempts, poison) make it *short* (``report.short_groups``), others are losses;
* ``group batched`` (4): a scored group is batched, dropped for a cause, or still held by the batcher (FIFO per
  harness); a consistency drop (``IncompleteGroup``) is a loss;
* ``batches contiguous`` (5): batch ``{prefix}-{n:06d}`` numbers run without a gap;
* ``batch trained`` (6): a sealed batch is trained, refused for a cause, or sealed after the last trained one; a kill
  (``TrainingStepKilled``) or a refused seal count is a loss;
* ``tampered never trained`` (7): no trained batch holds a trajectory of an attempt with a ``tampered`` call.
What is in flight, not lost, goes to ``report.in_flight``; causes set aside to ``report.set_aside``.
"""

from __future__ import annotations

import re
from collections import defaultdict

from consumers.analytics.run_log import (
    INCONSISTENT,
    LOST,
    TRAINED_TWICE,
    AuditReport,
    BatchEntry,
    Letter,
    RunLog,
    Settled,
    Violation,
    Where,
    request_of,
)

# Refusals that are the system failing, not the batch: the learner killed in its step, a batch short of its seal.
LOSS_REFUSALS = ("TrainingStepKilled", "IncompleteGroup")
_SEAL_COUNT = re.compile(r"^seal says \d+ trajectories, \d+ arrived")


def _gid(entry: BatchEntry) -> str | None:
    return entry.group_id or (entry.trajectory.group_id if entry.trajectory is not None else None)


class Flow:
    """The rules that follow trajectories downstream: into whole groups, batches, trained versions (rules 3–6)."""

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.trained = {v.batch_id: v for v in sorted(log.versions, key=lambda v: v.policy_version) if v.batch_id}
        self.seals: dict[str, BatchEntry] = {}
        self.members: dict[str, list[BatchEntry]] = defaultdict(list)
        for e in sorted(log.batches, key=lambda e: (e.where.partition, e.where.offset)):
            if e.kind == "SEAL":
                self.seals.setdefault(e.batch_id, e)
            elif e.trajectory is not None:
                self.members[e.batch_id].append(e)
        self.group_batches: dict[str, set[str]] = defaultdict(set)
        for batch_id, entries in self.members.items():
            for e in entries:
                if (g := _gid(e)) is not None:
                    self.group_batches[g].add(batch_id)
        self.by_group: dict[str, dict[str, list[Settled]]] = defaultdict(lambda: defaultdict(list))
        for t in log.trajectories:
            if t.group_id is not None:
                self.by_group[t.group_id][t.rollout_id].append(t)
        self.max_attempts: dict[str, int] = {}  # rollout → the attempts its requests allow
        for q in log.requests:
            if q.max_attempts is not None:
                self.max_attempts[q.rollout_id] = max(self.max_attempts.get(q.rollout_id, 0), q.max_attempts)
        self.letters: dict[tuple[str, str], list[Letter]] = defaultdict(list)  # (source, what it names) → letters
        for d in sorted(log.dead_letters, key=lambda d: (not _is_loss(d), _pos(d.where))):  # losses first
            for k in {d.rollout_id, d.group_id, d.key} - {None, ""}:
                self.letters[(d.source, k or "")].append(d)

    def check(self, report: AuditReport) -> None:
        out = report.violations
        self._request_trained_once(out)
        self._groups_whole(report, out)
        self._groups_batched(report, out)
        self._batches_contiguous(out)
        self._batches_trained(report, out)
        self._tampered_never_trained(out)

    def _trainable(self, group_id: str) -> list[str]:
        members = self.by_group.get(group_id, {})
        return sorted(r for r, ts in members.items() if any(t.trainable for t in ts))

    def _request_trained_once(self, out: list[Violation]) -> None:
        runs: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for batch_id, entries in self.members.items():
            if batch_id in self.trained:
                for e in entries:
                    assert e.trajectory is not None
                    runs[e.trajectory.rollout_id][e.trajectory.attempt_id].append(f"{batch_id}#{e.index}")
        for rollout, by_attempt in sorted(runs.items()):
            if len(by_attempt) > 1:
                where = "; ".join(f"attempt {a} in {', '.join(b)}" for a, b in sorted(by_attempt.items()))
                out.append(
                    Violation(
                        TRAINED_TWICE,
                        "request trained once",
                        f"rollout {rollout} trained in {len(by_attempt)} runs: {where}",
                    )
                )

    def _groups_whole(self, report: AuditReport, out: list[Violation]) -> None:
        """Rule 3: a batched group holds every trainable member that settled before its batch formed; a member left
        out is a reasoned short (out of attempts, poison, after its group timed out) or a loss (``_left_out``)."""
        for group_id, batch_ids in sorted(self.group_batches.items()):
            batch_id = min(batch_ids)
            formed = self.seals[batch_id].timestamp_ms if batch_id in self.seals else 0
            inside = {e.trajectory.rollout_id for b in batch_ids for e in self.members[b] if e.trajectory is not None}
            short: list[str] = []
            for rollout, ts in sorted(self.by_group.get(group_id, {}).items()):
                if rollout in inside:
                    continue
                t = max(ts, key=lambda t: (t.trainable is True, t.where.offset))
                if (
                    t.trainable
                    and formed
                    and t.timestamp_ms > formed
                    and not self.letters.get(("streams.grouper", rollout))
                ):
                    report.in_flight["late trajectories of trained groups"] = (
                        report.in_flight.get("late trajectories of trained groups", 0) + 1
                    )
                    continue
                reason, lost = self._left_out(rollout, ts, t)
                if not lost:
                    short.append(f"member {rollout} {reason}")
                    continue
                out.append(
                    Violation(
                        LOST,
                        "group whole",
                        f"rollout {rollout} (attempt {t.attempt_id}, {t.status}, reward {t.reward}, settled at "
                        f"{t.where}) of group {group_id} is not in the group's batch {batch_id}: {reason}",
                    )
                )
            if short:
                report.short_groups.append(f"group {group_id} (batch {batch_id}) trained short: {'; '.join(short)}")
        for group_id in sorted(set(self.by_group) - set(self.group_batches)):  # closed without its re-issue, unbatched
            for rollout, ts in sorted(self.by_group[group_id].items()):
                t = max(ts, key=lambda t: (t.trainable is True, t.where.offset))
                if t.trainable and self.letters.get(("streams.grouper", rollout)):
                    reason, lost = self._left_out(rollout, ts, t)
                    if lost:
                        out.append(
                            Violation(
                                LOST,
                                "group whole",
                                f"rollout {rollout} (attempt {t.attempt_id}, settled at {t.where}) of group {group_id} "
                                f"(in no batch): {reason}",
                            )
                        )

    def _left_out(self, rollout: str, ts: list[Settled], t: Settled) -> tuple[str, bool]:
        """Why a member is missing from its group's batch, and whether that is a loss. Reasoned: out of its attempts
        (every one an infrastructure failure), its own cause (poison: dropped, failed, tampered; with its reason), a
        trajectory after its group timed out. A loss: an infrastructure failure with attempts left (the group did not
        wait for its re-issue), a re-issue dead-lettered late by a group that closed complete, no reason at all."""
        infra = sorted(
            {
                int(n)
                for x in ts
                if x.status == "INFRA_FAILURE" and (n := request_of(rollout, x.attempt_id)[1]).isdigit()
            }
        )
        most = self.max_attempts.get(rollout)
        late = self.letters.get(("streams.grouper", rollout))
        if t.trainable and late:
            why = late[0].reason.splitlines()[0][:160]
            if infra and "closed (complete" in why:
                return (
                    f"dead-lettered late ({why}) after its attempt(s) {infra} failed: the group closed before its "
                    "re-issue",
                    True,
                )
            return f"dead-lettered: {why}", False
        if t.trainable:
            return "no dead letter names it", True
        if t.status != "INFRA_FAILURE":
            return f"{t.status}" + (f" ({t.drop_reason})" if t.drop_reason else ""), False
        n = request_of(rollout, t.attempt_id)[1]
        if most is not None and n.isdigit() and int(n) + 1 < most:
            return f"INFRA_FAILURE at attempt {n} of {most}: the group was batched without its re-issue", True
        if most is None:  # a request that announced no limit (or none read): reported as it is
            return f"INFRA_FAILURE x{len(infra) or 1} (its requests name no max_attempts)", False
        return f"out of attempts (INFRA_FAILURE x{len(infra) or 1})", False

    def _groups_batched(self, report: AuditReport, out: list[Violation]) -> None:
        """Rule 4: a scored group is batched, dropped for a reason, or still held by the batcher (FIFO per harness)."""
        scored: dict[str, BatchEntry] = {}
        for e in sorted(self.log.scored, key=lambda e: (e.where.partition, e.where.offset)):
            scored.setdefault(e.group_id or e.batch_id, e)
        dropped = {d.group_id for d in self.log.dead_letters if d.source == "streams.batcher" and d.group_id}
        youngest: dict[str, tuple[Where, str]] = {}  # harness → the latest-scored group batched
        for g in self.group_batches:
            if g in scored and (g_at := scored[g].where) is not None:
                h = scored[g].harness
                if h not in youngest or (g_at.partition, g_at.offset) > _pos(youngest[h][0]):
                    youngest[h] = (g_at, g)
        held = 0
        for g in sorted(set(scored) | dropped):
            if g in self.group_batches:
                continue
            rollouts = ", ".join(self._trainable(g)) or "none settled here"
            letter = next(iter(self.letters.get(("streams.batcher", g), [])), None)
            if letter is not None and not _is_loss(letter):
                report.set_aside.append(f"group {g} ({rollouts}): {letter.reason.splitlines()[0][:160]}")
            elif letter is not None:
                out.append(
                    Violation(
                        LOST,
                        "group batched",
                        f"group {g} dropped by the batcher ({letter.error_type}: {letter.reason.splitlines()[0]}, "
                        f"dead letter at {letter.where}): rollouts {rollouts} never trained",
                    )
                )
            elif g in scored and (y := youngest.get(scored[g].harness)) and _pos(y[0]) > _pos(scored[g].where):
                out.append(
                    Violation(
                        LOST,
                        "group batched",
                        f"group {g} (harness {scored[g].harness or '-'}, scored at {scored[g].where}) is in no batch "
                        f"and no dead letter, but the younger group {y[1]} (scored at {y[0]}) went into batch "
                        f"{min(self.group_batches[y[1]])}: rollouts {rollouts} never trained",
                    )
                )
            else:
                held += 1
        if held:
            report.in_flight["groups held by the batcher"] = held

    def _batches_contiguous(self, out: list[Violation]) -> None:
        """Rule 5: batch ``{prefix}-{n:06d}`` is numbered n by its batcher, and n runs without a gap."""
        steps: dict[str, set[int]] = defaultdict(set)
        for batch_id, seal in self.seals.items():
            prefix, _, n = batch_id.rpartition("-")
            if seal.step is not None and prefix and n == f"{seal.step:06d}":
                steps[prefix].add(seal.step)
        for prefix, got in sorted(steps.items()):
            gaps = sorted(set(range(min(got), max(got) + 1)) - got)
            if gaps:
                missing = ", ".join(f"{prefix}-{n:06d}" for n in gaps[:20])
                out.append(
                    Violation(
                        LOST,
                        "batches contiguous",
                        f"batches {missing} missing between {prefix}-{min(got):06d} and "
                        f"{prefix}-{max(got):06d} ({len(gaps)} in all)",
                    )
                )

    def _batches_trained(self, report: AuditReport, out: list[Violation]) -> None:
        """Rule 6: every sealed batch trained, refused for a cause, or sealed after the last trained one."""
        last = max((_pos(s.where) for b, s in self.seals.items() if b in self.trained), default=None)
        later = {b for b, s in self.seals.items() if b in self.trained and _pos(s.where) == last}
        pending = 0
        for batch_id, seal in sorted(self.seals.items(), key=lambda kv: _pos(kv[1].where)):
            if batch_id in self.trained:
                continue
            entries = self.members.get(batch_id, [])
            what = (
                f"{len(entries)} trajectories of groups {sorted({g for e in entries if (g := _gid(e))}) or '-'}: "
                f"rollouts {sorted(e.trajectory.rollout_id for e in entries if e.trajectory is not None)}"
            )
            refusal = next(iter(self.letters.get(("learner", batch_id), [])), None)
            if refusal is not None and not _is_loss(refusal):
                report.set_aside.append(f"batch {batch_id} refused: {refusal.reason.splitlines()[0][:200]}")
            elif refusal is not None:
                out.append(
                    Violation(
                        LOST,
                        "batch trained",
                        f"batch {batch_id} (sealed at {seal.where}) dead-lettered by the learner "
                        f"({refusal.error_type}: {refusal.reason.splitlines()[0][:200]}): {what} never trained",
                    )
                )
            elif last is not None and _pos(seal.where) < last:
                out.append(
                    Violation(
                        LOST,
                        "batch trained",
                        f"batch {batch_id} (sealed at {seal.where}) never trained nor refused, while the later batch "
                        f"{min(later)} was trained as v{self.trained[min(later)].policy_version}: {what}",
                    )
                )
            else:
                pending += 1
        if pending:
            report.in_flight["batches sealed after the last trained one"] = pending

    def _tampered_never_trained(self, out: list[Violation]) -> None:
        """Rule 7: no trained batch holds a trajectory of an attempt with a tampered call (one without an attempt id
        counts for every attempt of its rollout)."""
        tampered: dict[tuple[str, str | None], list[Where]] = defaultdict(list)
        for c in self.log.calls:
            if c.tampered:
                tampered[(c.rollout_id, c.attempt_id)].append(c.where)
        trained = [(b, e) for b, entries in sorted(self.members.items()) if b in self.trained for e in entries]
        for batch_id, e in trained if tampered else []:
            t = e.trajectory
            assert t is not None
            calls = tampered.get((t.rollout_id, t.attempt_id), []) + tampered.get((t.rollout_id, None), [])
            if calls:
                out.append(
                    Violation(
                        INCONSISTENT,
                        "tampered never trained",
                        f"rollout {t.rollout_id} (attempt {t.attempt_id}) of group {_gid(e) or '-'} trained in "
                        f"batch {batch_id}#{e.index} as v{self.trained[batch_id].policy_version}, though "
                        f"{len(calls)} of its calls held an assistant turn the proxy never generated (first at "
                        f"{min(calls, key=_pos)})",
                    )
                )


def _is_loss(letter: Letter) -> bool:
    """A dead letter for the system failing, not the input: a killed step, a group or batch short of its seal."""
    return letter.error_type in LOSS_REFUSALS or bool(_SEAL_COUNT.match(letter.reason.split(": ", 1)[-1]))


def _pos(where: Where) -> tuple[int, int]:
    return (where.partition, where.offset)
