"""The audit against a forger: one real run (real broker, proxy, sandbox worker, streams, learner, scheduler: the
soak's stack against its instant engine, ~2 min), read back once by ``clawstream audit``'s reader; then each fault
class is applied to a copy of its records as if it had happened, and the audit must flag it with the right verdict,
naming the rollout, group or batch. Where the forger also adjusted the other evidence (renumbered versions or
batches, fixed a seal's count) exactly one rule is left to see the loss: with that rule skipped the forgery audits
CLEAN, so every rule is needed. Honest end-of-run states (a batch sealed but not trained yet, groups the batcher
still holds, a group trained short for a reason, a batch refused for a cause) stay CLEAN.

The dead letters a forgery adds are built as the services build them (``schemas.dead_letter``) and decoded by the
audit's own reader code, so they carry the real format.
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from collections.abc import Callable

import pytest

from bench.soak import run_soak
from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from consumers.analytics.audit import _letter, format_report, read_run
from consumers.analytics.reconcile import (
    DUPLICATED,
    INCONSISTENT,
    LOST,
    RULES,
    TRAINED_TWICE,
    BatchEntry,
    Request,
    RunLog,
    Settled,
    Version,
    Where,
    reconcile,
)
from schemas.codec import default_codec
from schemas.dead_letter import dead_letter
from schemas.topics import BATCHES, CATALOG

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def run(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> RunLog:
    """A real run of ≥ 4 trained batches of 2 groups × 8 rollouts, read back by the audit's reader (CLEAN)."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=f"t-{uuid.uuid4().hex[:10]}.")
    create_topics(kafka, CATALOG)
    result = run_soak(kafka, tmp_path_factory.mktemp("mutations"), seconds=1, rollouts=16, warm_versions=3)
    assert result.report.clean, result.audit_text
    log = read_run(kafka)
    report = reconcile(log)
    assert report.clean, format_report(report, kafka.topic_prefix)
    assert report.batches_trained >= 4 and log.scored, format_report(report, kafka.topic_prefix)
    return log


class Run:
    """A copy of the recorded run, with the edits a fault would have made."""

    def __init__(self, log: RunLog) -> None:
        self.log = copy.deepcopy(log)
        self.versions = sorted(self.log.versions, key=lambda v: v.policy_version)

    def batch(self, k: int) -> str:
        """The batch trained as the k-th version (0-based; -1 the last)."""
        batch_id = self.versions[k].batch_id
        assert batch_id is not None
        return batch_id

    def entries(self, batch_id: str) -> list[BatchEntry]:
        return sorted(
            (e for e in self.log.batches if e.batch_id == batch_id and e.kind != "SEAL"), key=lambda e: e.index
        )

    def groups(self, batch_id: str) -> list[str]:
        return sorted({e.group_id for e in self.entries(batch_id) if e.group_id})

    def _end(self, topic: str) -> Where:
        last = max((w for w in self._wheres() if w.topic == topic), key=lambda w: w.offset)
        return Where(topic, last.partition, last.offset + 1)

    def _wheres(self) -> list[Where]:
        lg = self.log
        kept = (lg.lifecycle, lg.rewards, lg.trajectories, lg.batches, lg.versions, lg.requests)
        return [x.where for xs in kept for x in xs]

    def reseal(self, batch_id: str) -> None:
        """Number the batch's records 0..n-1 and make its seal announce n (a forger covering a change)."""
        keep = self.entries(batch_id)
        renumbered = {id(e): dataclasses.replace(e, index=i) for i, e in enumerate(keep)}
        self.log.batches = [
            dataclasses.replace(e, index=len(keep))
            if e.batch_id == batch_id and e.kind == "SEAL"
            else renumbered.get(id(e), e)
            for e in self.log.batches
        ]

    def drop_entries(self, keep: Callable[[BatchEntry], bool]) -> None:
        self.log.batches = [e for e in self.log.batches if keep(e)]

    def untrain(self, batch_id: str, renumber: bool) -> None:
        """Remove the version that trained ``batch_id``; ``renumber``: later versions move down to close the gap."""
        gone = next(v for v in self.log.versions if v.batch_id == batch_id)
        self.log.versions = [
            dataclasses.replace(v, policy_version=v.policy_version - 1)
            if renumber and v.policy_version > gone.policy_version
            else v
            for v in self.log.versions
            if v is not gone
        ]

    def add_entry(self, batch_id: str, entry: BatchEntry) -> None:
        self.log.batches.append(dataclasses.replace(entry, batch_id=batch_id, where=self._end(entry.where.topic)))
        self.reseal(batch_id)

    def letter(
        self, source: str, reason: str, error_type: str, key: str | None = None, rollout_id: str | None = None
    ) -> None:
        """A dead letter as ``schemas.dead_letter`` builds it, decoded by the audit's reader."""
        raw = dead_letter(
            source,
            reason,
            error_type,
            topic=BATCHES,
            key=key.encode() if key else None,
            rollout_id=rollout_id,
            policy_version=1,
        ).to_bytes()
        _, rec = default_codec().decode(raw, expected="DeadLetter")
        self.log.dead_letters.append(_letter(rec, Where("t.clawstream.deadletter", 0, len(self.log.dead_letters))))

    def member(self, k: int, i: int) -> Settled:
        """The i-th trajectory of the batch trained as the k-th version, taken out of it (the seal adjusted)."""
        b = self.batch(k)
        gone = self.entries(b)[i]
        assert gone.trajectory is not None
        self.drop_entries(lambda e: e is not gone)
        self.reseal(b)
        return gone.trajectory

    def erase(self, rollout_id: str) -> Request:
        """Every record of the rollout but its request gone (as if it never ran); returns its request."""
        lg = self.log
        lg.lifecycle = [x for x in lg.lifecycle if x.rollout_id != rollout_id]
        lg.rewards = [x for x in lg.rewards if x.rollout_id != rollout_id]
        lg.trajectories = [x for x in lg.trajectories if x.rollout_id != rollout_id]
        lg.calls = [x for x in lg.calls if x.rollout_id != rollout_id]
        return next(q for q in lg.requests if q.rollout_id == rollout_id)

    def infra_failure(self, attempt_id: str) -> None:
        """The attempt ends as an infrastructure failure (its reward and trajectory say so, nothing to train)."""
        lg = self.log
        lg.rewards = [
            dataclasses.replace(x, status="INFRA_FAILURE", reward=None) if x.attempt_id == attempt_id else x
            for x in lg.rewards
        ]
        lg.trajectories = [
            dataclasses.replace(x, status="INFRA_FAILURE", reward=None, trainable=False)
            if x.attempt_id == attempt_id
            else x
            for x in lg.trajectories
        ]

    def reissue(self, t: Settled, attempt: int, infra: bool) -> Settled:
        """Attempt ``attempt`` of ``t``'s rollout, as the scheduler re-issues it: its request, events, reward and
        trajectory (copies of ``t``'s, at the ends of their topics); ``infra``: it failed too."""
        lg = self.log
        aid = f"{t.rollout_id}.a{attempt}.forged"
        q = next(q for q in lg.requests if q.rollout_id == t.rollout_id)
        lg.requests.append(dataclasses.replace(q, attempt=attempt, where=self._end(q.where.topic)))
        for ev in [e for e in lg.lifecycle if e.attempt_id == t.attempt_id]:
            lg.lifecycle.append(dataclasses.replace(ev, attempt_id=aid, where=self._end(ev.where.topic)))
        for rw in [x for x in lg.rewards if x.attempt_id == t.attempt_id]:
            lg.rewards.append(dataclasses.replace(rw, attempt_id=aid, where=self._end(rw.where.topic)))
        own = next(x for x in lg.trajectories if x.attempt_id == t.attempt_id)
        again = dataclasses.replace(own, attempt_id=aid, where=self._end(own.where.topic))
        lg.trajectories.append(again)
        if infra:
            self.infra_failure(aid)
        return again

    def rename_batches_after(self, batch_id: str) -> None:
        """Batches numbered after ``batch_id`` (removed) move down one: ``{prefix}-{n:06d}`` and step n → n−1."""
        prefix, _, gone = batch_id.rpartition("-")

        def moved(b: str) -> tuple[str, int] | None:
            head, _, n = b.rpartition("-")
            return (f"{prefix}-{int(n) - 1:06d}", int(n) - 1) if head == prefix and int(n) > int(gone) else None

        self.log.batches = [
            dataclasses.replace(e, batch_id=m[0], step=m[1]) if (m := moved(e.batch_id)) else e
            for e in self.log.batches
        ]
        self.log.versions = [
            dataclasses.replace(v, batch_id=m[0]) if v.batch_id and (m := moved(v.batch_id)) else v
            for v in self.log.versions
        ]


# ---- the forgeries: each edits a copy of the run, and says which (verdict, rule) the audit must report ----------


def member_missing(r: Run) -> str:
    """A group trained with a member missing: its record gone from the batch, the seal's count adjusted."""
    b = r.batch(1)
    gone = r.entries(b)[3]
    r.drop_entries(lambda e: e is not gone)
    r.reseal(b)
    assert gone.trajectory is not None
    return gone.trajectory.rollout_id


def batcher_drop(r: Run) -> str:
    """The batcher drops a group, dead-lettering "SEAL announces 8 records, 7 arrived"."""
    b = r.batch(1)
    g = r.groups(b)[0]
    r.drop_entries(lambda e: not (e.batch_id == b and e.group_id == g))
    r.reseal(b)
    r.letter("streams.batcher", f"group {g}: SEAL announces 8 records, 7 arrived", "IncompleteGroup", key=g)
    return g


def batch_lost(r: Run) -> str:
    """A whole sealed batch (its 16 trajectories and seal) lost before the learner; later versions renumbered."""
    b = r.batch(1)
    r.drop_entries(lambda e: e.batch_id != b)
    r.untrain(b, renumber=True)
    return b


def batch_lost_renumbered(r: Run) -> str:
    """The same, and the later batches renumbered too: only the batcher's order gives it away."""
    lost = r.groups(r.batch(1))[0]
    r.rename_batches_after(batch_lost(r))
    return lost


def batch_lost_with_its_groups(r: Run) -> str:
    """A whole batch lost, and its groups erased from the batcher's input: only the batch numbers give it away."""
    b = r.batch(1)
    groups = set(r.groups(b))
    batch_lost(r)
    r.log.scored = [e for e in r.log.scored if e.group_id not in groups]
    return b


def batch_never_trained(r: Run) -> str:
    """A sealed batch the learner never trains; later versions renumbered (no gap)."""
    b = r.batch(1)
    r.untrain(b, renumber=True)
    return b


def batch_never_trained_gap(r: Run) -> str:
    b = r.batch(1)
    r.untrain(b, renumber=False)
    return b


def killed_twice(r: Run) -> str:
    """The learner killed twice in the last batch's step: dead-lettered as TrainingStepKilled, never trained."""
    b = r.batch(-1)
    r.untrain(b, renumber=False)
    reason = f"batch {b} (t.clawstream.batches[0]@9): attempted 2 times without finishing: the learner was killed"
    r.letter("learner", reason, "TrainingStepKilled", key=b)
    return b


def killed_mid_run(r: Run) -> str:
    b = r.batch(1)
    r.untrain(b, renumber=True)
    r.letter("learner", f"batch {b}: attempted 2 times without finishing", "TrainingStepKilled", key=b)
    return b


def trained_twice_through_two_runs(r: Run) -> str:
    """One request run twice (a worker died after the reward), both runs trained: the copy in a later batch."""
    first = r.entries(r.batch(1))[0]
    t = first.trajectory
    assert t is not None
    rerun = t.attempt_id.rsplit(".", 1)[0] + ".mutant"
    lg = r.log
    for ev in [e for e in lg.lifecycle if e.attempt_id == t.attempt_id]:
        lg.lifecycle.append(dataclasses.replace(ev, attempt_id=rerun, where=r._end(ev.where.topic)))
    for rw in [x for x in lg.rewards if x.attempt_id == t.attempt_id]:
        lg.rewards.append(dataclasses.replace(rw, attempt_id=rerun, where=r._end(rw.where.topic)))
    own = next(x for x in lg.trajectories if x.attempt_id == t.attempt_id)
    lg.trajectories.append(dataclasses.replace(own, attempt_id=rerun, where=r._end(own.where.topic)))
    r.add_entry(r.batch(-1), dataclasses.replace(first, trajectory=dataclasses.replace(t, attempt_id=rerun)))
    return t.rollout_id


def in_two_batches(r: Run) -> str:
    """Control: one trajectory in two batches."""
    first = r.entries(r.batch(0))[0]
    r.add_entry(r.batch(-1), first)
    assert first.trajectory is not None
    return first.trajectory.attempt_id


def batch_trained_twice(r: Run) -> str:
    """Control: a batch trained into a second version."""
    b = r.batch(0)
    top = r.versions[-1]
    r.log.versions.append(Version(top.policy_version + 1, b, r._end(top.where.topic)))
    return b


def versions_from_2(r: Run) -> str:
    """Every version numbered one higher (a learner resumed past a version nobody published)."""
    r.log.versions = [dataclasses.replace(v, policy_version=v.policy_version + 1) for v in r.log.versions]
    return "first version is 2"


def tampered_trained(r: Run) -> str:
    """A rollout whose requests held an assistant turn the proxy never generated (its calls marked tampered), trained
    anyway: the streams should have dropped it."""
    e = r.entries(r.batch(1))[2]
    t = e.trajectory
    assert t is not None
    mine = [c for c in r.log.calls if c.rollout_id == t.rollout_id and c.attempt_id in (None, t.attempt_id)]
    assert mine, f"no recorded calls of {t.attempt_id}"
    r.log.calls = [dataclasses.replace(c, tampered=True) if c in mine else c for c in r.log.calls]
    return t.rollout_id


def request_replayed_never_run(r: Run) -> str:
    """A request the sandbox worker dead-lettered as a replay (a store of another run said it was done), never run:
    the rollout has no event, reward or trajectory, its group trained without it (the seal adjusted)."""
    t = r.member(1, 3)
    q = r.erase(t.rollout_id)
    where = f"{q.where.topic}[{q.where.partition}]@{q.where.offset}"
    reason = f"replay: rollout {q.rollout_id} attempt {q.attempt} at {where} is below its partition's committed "
    r.letter("sandbox_worker", reason + "position 1000: already done", "DuplicateRequest", rollout_id=q.rollout_id)
    return q.rollout_id


def request_never_taken(r: Run) -> str:
    """A request that left no trace at all, while later requests of its partition ran."""
    t = r.member(0, 1)
    return r.erase(t.rollout_id).rollout_id


def short_with_attempts_left(r: Run) -> str:
    """A member's attempt lost to the infrastructure (a proxy kill), its group trained without waiting for the
    re-issue: reported short as an infrastructure failure, though the scheduler had attempts left."""
    t = r.member(1, 2)
    r.infra_failure(t.attempt_id)
    return t.rollout_id


def reissue_late_after_complete(r: Run) -> str:
    """The proxy kill's race: attempt 0 an infrastructure failure, the group closed "complete" anyway, and the
    re-issue's trainable trajectory dead-lettered late by the grouper."""
    t = r.member(1, 2)
    r.reissue(t, 1, infra=False)
    r.infra_failure(t.attempt_id)
    late = f"late trajectory {t.rollout_id}: group {t.group_id or '-'} closed (complete, 8/8 rollouts)"
    r.letter("streams.grouper", late, "late", rollout_id=t.rollout_id)
    return t.rollout_id


def trajectory_lost(r: Run) -> str:
    """Control: a graded attempt's trajectory lost."""
    gone = r.log.trajectories[5]
    r.log.trajectories.remove(gone)
    return gone.attempt_id


FORGED: dict[str, tuple[Callable[[Run], str], set[tuple[str, str]]]] = {
    "member missing": (member_missing, {(LOST, "group whole")}),
    "batcher drop": (batcher_drop, {(LOST, "group batched")}),
    "batch lost": (batch_lost, {(LOST, "group batched"), (LOST, "batches contiguous")}),
    "batch lost, batches renumbered": (batch_lost_renumbered, {(LOST, "group batched")}),
    "batch lost with its groups": (batch_lost_with_its_groups, {(LOST, "batches contiguous")}),
    "batch never trained": (batch_never_trained, {(LOST, "batch trained")}),
    "batch never trained, version gap": (
        batch_never_trained_gap,
        {(LOST, "batch trained"), (LOST, "versions contiguous")},
    ),
    "killed twice in the last step": (killed_twice, {(LOST, "batch trained")}),
    "killed twice mid-run": (killed_mid_run, {(LOST, "batch trained")}),
    "request trained through two runs": (trained_twice_through_two_runs, {(TRAINED_TWICE, "request trained once")}),
    "in two batches": (in_two_batches, {(DUPLICATED, "one batch")}),
    "batch trained twice": (batch_trained_twice, {(TRAINED_TWICE, "trained once")}),
    "trajectory lost": (trajectory_lost, {(LOST, "one trajectory")}),
    "request dead-lettered as a replay, never run": (request_replayed_never_run, {(LOST, "request settled")}),
    "request never taken, later ones run": (request_never_taken, {(LOST, "request settled")}),
    "short: infra failure with attempts left": (short_with_attempts_left, {(LOST, "group whole")}),
    "short: re-issue late after its group closed complete": (reissue_late_after_complete, {(LOST, "group whole")}),
    "tampered rollout trained": (tampered_trained, {(INCONSISTENT, "tampered never trained")}),
    "versions from 2": (versions_from_2, {(INCONSISTENT, "versions contiguous")}),
}


@pytest.mark.parametrize("name", FORGED)
def test_each_forgery_is_flagged_with_its_verdict_and_names_what_was_lost(run: RunLog, name: str) -> None:
    forge, expected = FORGED[name]
    r = Run(run)
    named = forge(r)
    report = reconcile(r.log)
    got = {(v.kind, v.rule) for v in report.violations}
    assert got == expected, format_report(report, name)
    assert any(named in v.detail for v in report.violations), format_report(report, name)


@pytest.mark.parametrize("name", FORGED)
def test_with_its_rules_skipped_each_forgery_audits_clean(run: RunLog, name: str) -> None:
    """The rules that flag a forgery are what see it: skip them and it passes (a single rule: that rule is needed)."""
    forge, expected = FORGED[name]
    r = Run(run)
    forge(r)
    report = reconcile(r.log, skip={rule for _, rule in expected})
    assert report.clean, format_report(report, name)


def test_every_rule_is_the_only_one_to_see_some_forgery() -> None:
    alone = {rule for _, expected in FORGED.values() if len(expected) == 1 for _, rule in expected}
    rules_without_own_unit_test = set(RULES) - {"lifecycle", "terminal status", "reward joined", "sealed batch"}
    assert rules_without_own_unit_test <= alone, rules_without_own_unit_test - alone


# ---- honest end-of-run states and causes: CLEAN, and the report says what was in flight or set aside -------------


def last_batch_not_trained_yet(r: Run) -> None:
    r.untrain(r.batch(-1), renumber=False)


def last_batch_not_formed_yet(r: Run) -> None:
    b = r.batch(-1)
    r.untrain(b, renumber=False)
    r.drop_entries(lambda e: e.batch_id != b)


def member_dropped_for_a_reason(r: Run) -> None:
    b = r.batch(1)
    gone = r.entries(b)[2]
    assert gone.trajectory is not None
    aid = gone.trajectory.attempt_id
    r.drop_entries(lambda e: e is not gone)
    r.reseal(b)
    r.log.trajectories = [
        dataclasses.replace(t, status="DROPPED", trainable=False, drop_reason="no trainable tokens (0 main calls)")
        if t.attempt_id == aid
        else t
        for t in r.log.trajectories
    ]


def member_out_of_attempts(r: Run) -> None:
    """A member whose three attempts were each lost to the infrastructure (three proxy kills): out of attempts, its
    group trained short with that reason."""
    t = r.member(1, 2)
    r.infra_failure(t.attempt_id)
    r.reissue(t, 1, infra=True)
    r.reissue(t, 2, infra=True)


def stale_group(r: Run) -> None:
    b = r.batch(-1)
    g = r.groups(b)[0]
    r.drop_entries(lambda e: not (e.batch_id == b and e.group_id == g))
    r.reseal(b)
    r.letter("streams.batcher", f"stale group {g}: policy version 0, newest 3, lag bound 1", "StaleGroup")


def last_batch_refused_for_a_cause(r: Run) -> None:
    b = r.batch(-1)
    r.untrain(b, renumber=False)
    r.letter("learner", f"cannot pack the batch: a tree of {b} is over the token budget", "UntrainableBatch", key=b)


def tampered_dropped(r: Run) -> None:
    """A tampered rollout as the streams settle it: DROPPED with the reason, out of its batch (its group short)."""
    b = r.batch(1)
    gone = r.entries(b)[2]
    assert gone.trajectory is not None
    aid = gone.trajectory.attempt_id
    tampered_trained(r)
    r.drop_entries(lambda e: e is not gone)
    r.reseal(b)
    r.log.trajectories = [
        dataclasses.replace(t, status="DROPPED", trainable=False, drop_reason="tampered (2 call(s))")
        if t.attempt_id == aid
        else t
        for t in r.log.trajectories
    ]


HONEST: dict[str, tuple[Callable[[Run], None], str]] = {
    "last batch sealed, not trained yet": (last_batch_not_trained_yet, "batches sealed after the last trained one"),
    "last groups held by the batcher": (last_batch_not_formed_yet, "groups held by the batcher"),
    "member dropped for a reason": (member_dropped_for_a_reason, "no trainable tokens"),
    "member out of attempts": (member_out_of_attempts, "out of attempts (INFRA_FAILURE x3)"),
    "stale group set aside": (stale_group, "stale group"),
    "last batch refused for a cause": (last_batch_refused_for_a_cause, "cannot pack the batch"),
    "tampered rollout dropped with its reason": (tampered_dropped, "DROPPED (tampered (2 call(s)))"),
}


@pytest.mark.parametrize("name", HONEST)
def test_honest_end_states_and_reasoned_refusals_stay_clean(run: RunLog, name: str) -> None:
    edit, said = HONEST[name]
    r = Run(run)
    edit(r)
    report = reconcile(r.log)
    assert report.clean, format_report(report, name)
    assert said in format_report(report, name), format_report(report, name)


def test_the_audit_is_idempotent_and_order_free(run: RunLog) -> None:
    r = Run(run)
    batch_lost(r)
    first = reconcile(r.log).to_json()
    for xs in (r.log.batches, r.log.trajectories, r.log.scored, r.log.versions, r.log.dead_letters):
        xs.reverse()
    assert reconcile(r.log).to_json() == first == reconcile(r.log).to_json()
