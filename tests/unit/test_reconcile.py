"""The audit's rules (consumers.analytics.reconcile): a clean run is clean, and each kind of loss, duplicate and
double training is found and named, whatever the order of the records."""

from __future__ import annotations

import dataclasses
import random

from consumers.analytics.reconcile import (
    DUPLICATED,
    INCONSISTENT,
    LOST,
    RULES,
    TRAINED_TWICE,
    BatchEntry,
    Letter,
    Lifecycle,
    Request,
    Reward,
    RunLog,
    Settled,
    Version,
    Where,
    reconcile,
)
from schemas.events import RolloutState

_offsets: dict[str, int] = {}


def at(topic: str) -> Where:
    _offsets[topic] = _offsets.get(topic, -1) + 1
    return Where(topic, 0, _offsets[topic])


def clean_run(rollouts: int = 4, batches: int = 2) -> RunLog:
    """``rollouts`` rollouts per batch, each started, exited, graded, settled, batched; each batch trained once."""
    log = RunLog()
    for b in range(batches):
        batch = f"b{b}"
        for i in range(rollouts):
            rid, aid = f"r{b}-{i}", f"r{b}-{i}#0"
            reward = i / rollouts
            log.lifecycle += [
                Lifecycle(rid, aid, RolloutState.STARTED, at("events")),
                Lifecycle(rid, aid, RolloutState.HARNESS_EXITED, at("events")),
            ]
            log.rewards.append(Reward(rid, aid, "OK", reward, at("rewards")))
            log.trajectories.append(Settled(rid, aid, "COMPLETE", reward, at("trajectories")))
            log.batches.append(
                BatchEntry(batch, "TRAJECTORY", i, Settled(rid, aid, "COMPLETE", reward, at("x")), at("batches"))
            )
        log.batches.append(BatchEntry(batch, "SEAL", rollouts, None, at("batches")))
        log.versions.append(Version(b + 1, batch, at("weights")))
    return log


def kinds(log: RunLog) -> list[tuple[str, str]]:
    return sorted((v.kind, v.rule) for v in reconcile(log).violations)


def test_a_clean_run_is_clean_in_any_order() -> None:
    log = clean_run()
    report = reconcile(log)
    assert report.clean and report.violations == []
    assert (report.attempts, report.settled, report.batched, report.batches_sealed, report.batches_trained) == (
        8,
        8,
        8,
        2,
        2,
    )
    for field in ("rewards", "trajectories", "batches", "versions"):
        random.Random(0).shuffle(getattr(log, field))
    assert reconcile(log).clean


def test_an_attempt_without_a_reward_or_trajectory_is_lost() -> None:
    log = clean_run()
    log.lifecycle.append(Lifecycle("r9", "r9#0", RolloutState.STARTED, at("events")))
    assert kinds(log) == [(LOST, "terminal status")]


def test_an_attempt_settled_by_the_streams_without_a_reward_is_not_lost() -> None:
    log = clean_run()  # its worker died before grading; the streams superseded it with an infra-failure trajectory
    log.lifecycle.append(Lifecycle("r9", "r9#0", RolloutState.STARTED, at("events")))
    log.trajectories.append(Settled("r9", "r9#0", "INFRA_FAILURE", None, at("trajectories")))
    assert reconcile(log).clean


def test_two_rewards_for_one_attempt_are_a_duplicate() -> None:
    log = clean_run()
    log.rewards.append(log.rewards[0])
    assert kinds(log) == [(DUPLICATED, "terminal status")]


def test_a_graded_attempt_in_no_trajectory_is_lost_and_in_two_is_doubled() -> None:
    log = clean_run()
    lost = log.trajectories.pop(0)
    assert kinds(log) == [(LOST, "one trajectory")]
    log.trajectories += [lost, lost]
    assert kinds(log) == [(DUPLICATED, "one trajectory")]


def test_a_trajectory_carrying_another_attempts_reward_is_inconsistent() -> None:
    log = clean_run()
    t = log.trajectories[1]
    log.trajectories[1] = Settled(t.rollout_id, t.attempt_id, t.status, 0.77, t.where)
    assert kinds(log) == [(INCONSISTENT, "reward joined")]


def test_a_trajectory_in_two_batches_is_a_duplicate() -> None:
    log = clean_run()
    first = log.batches[0]
    log.batches.append(BatchEntry("b1", "TRAJECTORY", 4, first.trajectory, at("batches")))
    got = kinds(log)
    assert (DUPLICATED, "one batch") in got
    assert (DUPLICATED, "sealed batch") in got  # b1 now holds five records under a seal announcing four


def test_a_seal_announcing_records_that_never_came_is_a_loss() -> None:
    log = clean_run()
    del log.batches[1]  # b0's record #1
    assert kinds(log) == [(LOST, "sealed batch")]


def test_a_batch_trained_twice_and_a_version_published_twice_are_found() -> None:
    log = clean_run()
    log.versions.append(Version(3, "b1", at("weights")))
    assert kinds(log) == [(TRAINED_TWICE, "trained once")]
    log.versions.append(Version(3, "b1", at("weights")))
    assert (DUPLICATED, "versions contiguous") in kinds(log)


def test_a_gap_in_versions_is_a_loss() -> None:
    log = clean_run(batches=3)
    log.versions = [v for v in log.versions if v.policy_version != 2]
    assert kinds(log) == [(LOST, "batch trained"), (LOST, "versions contiguous")]  # b1 also passed over for b2


def test_a_disallowed_lifecycle_move_is_found() -> None:
    log = clean_run()
    e = log.lifecycle[0]
    log.lifecycle.append(Lifecycle(e.rollout_id, e.attempt_id, RolloutState.STARTED, at("events")))
    assert kinds(log) == [(INCONSISTENT, "lifecycle")]


def test_dead_letters_are_listed_not_violations() -> None:
    log = clean_run()
    log.dead_letters.append(Letter("streams", "undecodable value: bad magic", at("dead")))
    report = reconcile(log)
    assert report.clean and report.dead_letters == {"streams: undecodable value: bad magic": 1}


def test_a_second_run_of_a_trained_request_is_set_aside_but_a_lost_reissue_is_not() -> None:
    """A worker died after a run's reward and before releasing it: the request ran again (same request attempt, new
    attempt id) and only the first run was trained — a re-run set aside, not a loss. A re-issue after an
    infrastructure failure (a higher request attempt) that reached no trajectory is still lost."""
    log = clean_run(rollouts=2, batches=1)
    rerun = "r0-0.a0.second"
    log.lifecycle += [
        Lifecycle("r0-0", rerun, RolloutState.STARTED, at("events")),
        Lifecycle("r0-0", rerun, RolloutState.HARNESS_EXITED, at("events")),
    ]
    log.rewards.append(Reward("r0-0", rerun, "OK", 0.5, at("rewards")))
    for t in log.trajectories:  # attempt ids of the real form: {rollout_id}.a{attempt}.{random}
        object.__setattr__(t, "attempt_id", t.attempt_id.replace("#0", ".a0.first"))
    for rec in (*log.lifecycle, *log.rewards):
        object.__setattr__(rec, "attempt_id", rec.attempt_id.replace("#0", ".a0.first"))
    for entry in log.batches:
        if entry.trajectory is not None:
            object.__setattr__(entry.trajectory, "attempt_id", entry.trajectory.attempt_id.replace("#0", ".a0.first"))
    report = reconcile(log)
    assert report.clean and report.reruns_set_aside == 1, report.violations
    reissue = "r0-1.a1.again"  # attempt 1 of r0-1: nothing trained it
    log.rewards.append(Reward("r0-1", reissue, "OK", 1.0, at("rewards")))
    assert kinds(log) == [(LOST, "one trajectory")]


def grouped_run(batches: int = 3) -> RunLog:
    """``clean_run`` with each batch one group (``g{b}``), batches numbered ``s-{n:06d}``, and the scored SEALs."""
    log = clean_run(batches=batches)
    batch_of = {f"b{b}": f"s-{b:06d}" for b in range(batches)}
    log.trajectories = [
        Settled(t.rollout_id, t.attempt_id, t.status, t.reward, t.where, "g" + t.rollout_id[1], True)
        for t in log.trajectories
    ]
    log.batches = [
        BatchEntry(
            batch_of[e.batch_id],
            e.kind,
            e.index,
            e.trajectory,
            e.where,
            group_id="g" + batch_of[e.batch_id][-1],
            step=int(batch_of[e.batch_id][2:]),
        )
        for e in log.batches
    ]
    log.versions = [Version(v.policy_version, batch_of[v.batch_id or ""], v.where) for v in log.versions]
    log.scored = [BatchEntry(f"g{b}", "SEAL", 4, None, at("scored"), group_id=f"g{b}", harness="h") for b in range(3)]
    return log


def test_a_group_trained_without_a_member_is_lost_unless_a_reason_names_it() -> None:
    log = grouped_run()
    assert reconcile(log).clean
    log.batches = [e for e in log.batches if not (e.trajectory and e.trajectory.rollout_id == "r1-2")]
    assert ("lost", "group whole") in kinds(log)
    log.dead_letters.append(
        Letter("streams.grouper", "late trajectory r1-2: group g1 closed", at("d"), rollout_id="r1-2")
    )
    report = reconcile(log)
    assert (LOST, "group whole") not in kinds(log) and "r1-2 dead-lettered: late" in report.short_groups[0]


def test_a_group_left_behind_by_the_batcher_is_lost_the_youngest_are_held() -> None:
    log = grouped_run()
    log.batches = [e for e in log.batches if e.batch_id != "s-000002"]
    log.versions = [v for v in log.versions if v.batch_id != "s-000002"]
    report = reconcile(log)
    assert report.clean and report.in_flight == {"groups held by the batcher": 1}
    log = grouped_run()
    log.batches = [e for e in log.batches if e.batch_id != "s-000001"]
    log.versions = [
        Version(v.policy_version - (v.policy_version > 2), v.batch_id, v.where)
        for v in log.versions
        if v.batch_id != "s-000001"
    ]
    assert kinds(log) == [(LOST, "batches contiguous"), (LOST, "group batched")]
    log.dead_letters.append(Letter("streams.batcher", "x", at("d"), "StaleGroup", group_id="g1"))
    assert kinds(log) == [(LOST, "batches contiguous")]
    log.dead_letters[-1] = Letter(
        "streams.batcher", "group g1: SEAL announces 4 records, 3 arrived", at("d"), "IncompleteGroup", group_id="g1"
    )
    assert kinds(log) == [(LOST, "batches contiguous"), (LOST, "group batched")]


def test_a_sealed_batch_is_trained_refused_for_a_cause_or_in_flight_a_killed_step_is_a_loss() -> None:
    log = grouped_run()
    log.versions = [v for v in log.versions if v.batch_id != "s-000002"]
    report = reconcile(log)
    assert report.clean and report.in_flight == {"batches sealed after the last trained one": 1}
    log.dead_letters.append(
        Letter("learner", "cannot pack the batch: too long", at("d"), "UntrainableBatch", key="s-000002")
    )
    assert reconcile(log).clean and reconcile(log).set_aside == [
        "batch s-000002 refused: cannot pack the batch: too long"
    ]
    log.dead_letters[-1] = Letter("learner", "attempted 2 times", at("d"), "TrainingStepKilled", key="s-000002")
    assert kinds(log) == [(LOST, "batch trained")]
    log = grouped_run()
    log.versions = [
        Version(v.policy_version - (v.policy_version > 2), v.batch_id, v.where)
        for v in log.versions
        if v.batch_id != "s-000001"
    ]
    assert kinds(log) == [(LOST, "batch trained")]
    assert reconcile(log, skip={"batch trained"}).clean


def test_one_request_trained_through_two_runs_is_trained_twice() -> None:
    log = grouped_run()
    t = log.trajectories[0]
    rerun = Settled(t.rollout_id, t.attempt_id + "-again", t.status, t.reward, at("trajectories"), t.group_id, True)
    log.lifecycle.append(Lifecycle(t.rollout_id, rerun.attempt_id, RolloutState.STARTED, at("events")))
    log.rewards.append(Reward(t.rollout_id, rerun.attempt_id, "OK", t.reward, at("rewards")))
    log.trajectories.append(rerun)
    log.batches.append(BatchEntry("s-000002", "TRAJECTORY", 4, rerun, at("batches"), group_id="g0", step=2))
    log.batches = [
        BatchEntry(e.batch_id, e.kind, 5, None, e.where, e.group_id, e.step)
        if e.kind == "SEAL" and e.batch_id == "s-000002"
        else e
        for e in log.batches
    ]
    assert kinds(log) == [(TRAINED_TWICE, "request trained once")]


def _infra_attempts(log: RunLog, rid: str, group: str, n: int, max_attempts: int = 3) -> None:
    """``rid`` out of its group's batch; its attempts 0..n-1 each an INFRA_FAILURE, as the scheduler re-issued them."""
    batch = next(e.batch_id for e in log.batches if e.trajectory and e.trajectory.rollout_id == rid)
    kept = [e for e in log.batches if e.batch_id == batch and e.kind != "SEAL" and e.trajectory.rollout_id != rid]
    renumbered = [dataclasses.replace(e, index=i) for i, e in enumerate(kept)]
    log.batches = [e for e in log.batches if e.batch_id != batch or e.kind == "SEAL"] + renumbered
    log.batches = [
        dataclasses.replace(e, index=len(kept)) if e.batch_id == batch and e.kind == "SEAL" else e for e in log.batches
    ]
    log.lifecycle = [x for x in log.lifecycle if x.rollout_id != rid]
    log.rewards = [x for x in log.rewards if x.rollout_id != rid]
    log.trajectories = [x for x in log.trajectories if x.rollout_id != rid]
    for a in range(n):
        aid = f"{rid}.a{a}.x"
        log.requests.append(Request(rid, a, at("requests"), group, max_attempts))
        log.lifecycle += [
            Lifecycle(rid, aid, RolloutState.STARTED, at("events")),
            Lifecycle(rid, aid, RolloutState.FAILED, at("events")),
        ]
        log.rewards.append(Reward(rid, aid, "INFRA_FAILURE", None, at("rewards")))
        log.trajectories.append(Settled(rid, aid, "INFRA_FAILURE", None, at("trajectories"), group, False))


def test_a_member_out_of_attempts_is_a_reasoned_short_one_with_attempts_left_is_lost() -> None:
    log = grouped_run()
    _infra_attempts(log, "r1-2", "g1", 3)
    report = reconcile(log)
    assert report.clean and report.short_groups == [
        "group g1 (batch s-000001) trained short: member r1-2 out of attempts (INFRA_FAILURE x3)"
    ], report.short_groups
    log = grouped_run()
    _infra_attempts(log, "r1-2", "g1", 2)  # attempt 1 of 3 failed: the group should have waited for attempt 2
    report = reconcile(log)
    assert kinds(log) == [(LOST, "group whole")] and not report.short_groups
    assert "r1-2" in report.violations[0].detail and "attempt 1 of 3" in report.violations[0].detail
    assert reconcile(log, skip={"group whole"}).clean


def test_a_reissue_dead_lettered_late_by_a_group_closed_complete_is_lost_after_a_timeout_it_is_reasoned() -> None:
    log = grouped_run()
    _infra_attempts(log, "r1-2", "g1", 1)
    again = Settled("r1-2", "r1-2.a1.x", "COMPLETE", 0.5, at("trajectories"), "g1", True)
    log.requests.append(Request("r1-2", 1, at("requests"), "g1", 3))
    log.lifecycle.append(Lifecycle("r1-2", again.attempt_id, RolloutState.STARTED, at("events")))
    log.rewards.append(Reward("r1-2", again.attempt_id, "OK", 0.5, at("rewards")))
    log.trajectories.append(again)
    late = "late trajectory r1-2: group g1 closed (complete, 4/4 rollouts)"
    log.dead_letters.append(Letter("streams.grouper", late, at("d"), "late", rollout_id="r1-2"))
    assert kinds(log) == [(LOST, "group whole")]
    log.dead_letters[-1] = Letter("streams.grouper", late.replace("complete", "timeout"), at("d"), rollout_id="r1-2")
    report = reconcile(log)
    assert report.clean and "member r1-2 dead-lettered: late" in report.short_groups[0]
    # The same race when every member failed first: the group closed complete with nothing to train, in no batch.
    log.dead_letters[-1] = Letter("streams.grouper", late, at("d"), "late", rollout_id="r1-2")
    log.batches = [e for e in log.batches if e.batch_id != "s-000001"]
    log.versions = [v for v in log.versions if v.batch_id != "s-000001"]
    log.scored = [e for e in log.scored if e.group_id != "g1"]
    assert (LOST, "group whole") in kinds(log)
    assert "r1-2" in next(v.detail for v in reconcile(log).violations if v.rule == "group whole")


def test_every_request_runs_or_is_dead_lettered_for_a_cause() -> None:
    log = clean_run()
    for i, t in enumerate(log.trajectories):
        log.requests.append(Request(t.rollout_id, 0, Where("requests", 0, i)))
    assert reconcile(log).clean  # (these attempt ids name no request number: they count for any request)
    log.requests.append(Request("r9", 0, Where("requests", 0, 100), "g9", 3))  # not read yet
    report = reconcile(log)
    assert report.clean and report.in_flight == {"requests not taken yet": 1}
    replay = "replay: rollout r9 attempt 0 at requests[0]@100 is below its partition's committed position 200"
    log.dead_letters.append(Letter("sandbox_worker", replay, at("d"), "DuplicateRequest", rollout_id="r9"))
    report = reconcile(log)
    assert kinds(log) == [(LOST, "request settled")] and "request r9 attempt 0 (group g9" in report.violations[0].detail
    assert reconcile(log, skip={"request settled"}).clean
    log.dead_letters[-1] = Letter("sandbox_worker", "invalid request: unknown harness 'x'", at("d"), rollout_id="r9")
    report = reconcile(log)
    assert report.clean and "unknown harness" in report.set_aside[0]
    log.dead_letters.pop()
    log.requests.append(Request("r0-0", 0, Where("requests", 0, 101)))  # a later request of the partition, taken
    assert kinds(log) == [(LOST, "request settled")]
    log.lifecycle.append(Lifecycle("r9", "r9.a1.x", RolloutState.STARTED, at("events")))  # a later attempt ran
    log.rewards.append(Reward("r9", "r9.a1.x", "OK", 1.0, at("rewards")))
    log.trajectories.append(Settled("r9", "r9.a1.x", "COMPLETE", 1.0, at("trajectories")))
    assert (LOST, "request settled") not in kinds(log)


def test_skip_names_rules() -> None:
    assert "group whole" in RULES
    try:
        reconcile(clean_run(), skip={"no such rule"})
    except ValueError as exc:
        assert "no such rule" in str(exc)
    else:
        raise AssertionError("an unknown rule name was accepted")
