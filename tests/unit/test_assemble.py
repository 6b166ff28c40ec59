"""Unit tests of streams.assemble: settle rule, duplicates, late records, attempts, statuses, recovery."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from schemas.events import (
    CallEvent,
    Event,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
)
from schemas.topics import CALLS, REWARDS, ROLLOUT_EVENTS
from schemas.topics import ROLLOUT_REQUESTS as REQUESTS
from streams.assemble import Assembler
from streams.rollout import RolloutAccumulator
from streams.settings import StreamsSettings
from streams.state import DueIndex, Verdict, is_tombstone
from streams.trajectory import split_group_id
from tests.support.stream_load import SynthRollout, build

CFG = StreamsSettings(
    settle_interval_s=1.0, settle_timeout_s=10.0, rollout_timeout_s=100.0, late_retention_s=50.0, store="memory://"
)
P = 3  # partition


def rollout(fault: str = "", **kw: object) -> SynthRollout:
    fields = {
        "rollout_id": "r-1",
        "group_id": "suite/t1|claude-code|7",
        "task_id": "suite/t1",
        "harness": "claude-code",
        "step": 7,
        "reward_value": 0.75,
        "fault": fault,
        "n_calls": 3,
    } | kw
    return build(SynthRollout(**fields))  # type: ignore[arg-type]


class Rig:
    """An assembler over dicts, fed at explicit processing times."""

    def __init__(self, cfg: StreamsSettings = CFG) -> None:
        self.state: dict[str, bytes] = {}
        self.calls: dict[str, bytes] = {}
        self.index: dict[str, bytes] = {}
        self.cfg = cfg
        self.out: list[Trajectory] = []
        self.rejected: list[tuple[Verdict, str]] = []

    def core(self) -> Assembler:  # a fresh core over the same maps, like a restarted worker
        return Assembler(self.cfg, self.state, self.calls, self.index)

    def feed(self, records: list[tuple[str, Event]], t0: int, step_ms: int = 10) -> int:
        t = t0
        for _, ev in records:
            res = self.core().on_record(ev, ev.to_bytes(), P, t)
            self.out += res.trajectories
            if res.rejected:
                self.rejected.append((res.rejected.verdict, res.rejected.reason))
            t += step_ms
        return t - step_ms

    def tick(self, now: int) -> list[Trajectory]:
        got = self.core().on_tick(P, now).trajectories
        self.out += got
        return got


def test_complete_rollout_settles_after_the_quiet_period() -> None:
    r, rig = rollout(), Rig()
    last = rig.feed(r.records, 1000)
    assert rig.tick(last + 999) == []  # ready, but not quiet for settle_interval yet
    [t] = rig.tick(last + 1000)
    assert t.status is TrajectoryStatus.COMPLETE and t.reward == 0.75 and t.drop_reason is None
    assert (t.rollout_id, t.attempt_id, t.group_id, t.task_id, t.harness, t.step) == (
        "r-1",
        "r-1-a0",
        "suite/t1|claude-code|7",
        "suite/t1",
        "claude-code",
        7,
    )
    assert t.calls == 3 and t.leaves == 1 and t.segments and t.metadata["group_size"] == "8"
    assert t.metadata["suite"] == "synth" and t.metadata["eval"] == "false" and t.metadata["attempt"] == "0"
    # The single path is prompt + every generation + tool results, i.e. the last call's prompt + generation.
    calls = [ev for topic, ev in r.records if topic == CALLS]
    last_call = calls[-1]
    assert isinstance(last_call, CallEvent)
    leaf, path = len(t.segments) - 1, []
    while leaf >= 0:
        path.insert(0, leaf)
        leaf = t.segments[leaf].parent
    tokens = [tok for i in path for tok in t.segments[i].tokens.tolist()]
    assert path[0] == 0 and tokens[:5] == [1, 2, 3, 4, 5]
    assert tokens[-len(last_call.generated_tokens) :] == last_call.generated_tokens.tolist()
    assert sum(s.trainable * len(s.tokens) for s in t.segments) == sum(len(c.generated_tokens) for c in calls)
    assert rig.calls == {} and rig.tick(last + 5000) == []  # stored calls freed; settles once
    assert Trajectory.from_bytes(t.to_bytes()).rollout_id == "r-1"


def test_any_arrival_order_gives_the_same_trajectory() -> None:
    r = rollout(side_call=True)
    base = Rig()
    base.tick(base.feed(r.records, 0) + 1000)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        shuffled = [r.records[i] for i in rng.permutation(len(r.records))]
        rig = Rig()
        rig.tick(rig.feed(shuffled, 0) + 1000)
        [a], [b] = base.out, rig.out
        assert (a.status, a.reward, a.calls, a.excluded_calls) == (b.status, b.reward, b.calls, b.excluded_calls)
        assert [s.tokens.tolist() for s in a.segments] == [s.tokens.tolist() for s in b.segments]
    assert base.out[0].excluded_calls == {"side": 1}


def test_a_new_record_restarts_the_quiet_period_and_duplicates_do_not() -> None:
    r, rig = rollout(), Rig()
    last = rig.feed(r.records, 0)
    rig.feed([r.records[2]], last + 500)  # duplicate call: ignored, does not count as activity
    assert len(rig.tick(last + 1000)) == 1
    r2, rig2 = rollout(rollout_id="r-2"), Rig()
    records = [rec for rec in r2.records if rec[0] != REWARDS]
    last = rig2.feed(records, 0)
    rig2.feed([rec for rec in r2.records if rec[0] == REWARDS], last + 800)  # the reward makes it ready
    assert rig2.tick(last + 1000) == [] and len(rig2.tick(last + 1800)) == 1


def test_duplicates_are_ignored() -> None:
    r, rig = rollout("dup"), Rig()
    rig.tick(rig.feed(r.records, 0) + 1000)
    [t] = rig.out
    assert t.status is TrajectoryStatus.COMPLETE and t.calls == 3 and rig.rejected == []


@pytest.mark.parametrize(
    ("fault", "missing"), [("missing_call", "2/3 calls received"), ("missing_reward", "no reward")]
)
def test_missing_records_settle_incomplete_at_the_timeout(fault: str, missing: str) -> None:
    r, rig = rollout(fault), Rig()
    last = rig.feed(r.records, 0)
    terminal_at = (
        next(
            i
            for i, (topic, ev) in enumerate(r.records)
            if topic == ROLLOUT_EVENTS and ev.state is not RolloutState.STARTED
        )
        * 10
    )  # type: ignore[attr-defined]
    assert rig.tick(last + 5000) == []
    assert rig.tick(terminal_at + 9999) == []
    [t] = rig.tick(terminal_at + 10_000)
    assert t.status is TrajectoryStatus.INCOMPLETE and t.segments == []
    assert t.drop_reason == f"settle timeout: {missing}"
    assert t.reward == (0.75 if fault == "missing_call" else None)  # a reward that came is kept (it is real)


def test_without_terminal_event_the_request_timeout_bounds_the_wait() -> None:
    r, rig = rollout(), Rig()
    exited = RolloutState.HARNESS_EXITED
    records = [rec for rec in r.records if getattr(rec[1], "state", None) is not exited]
    last = rig.feed(records, 0)
    budget = (600 + 10) * 1000  # the request's timeout_s + settle_timeout_s
    assert rig.tick(last + budget - 1) == []
    [t] = rig.tick(last + budget)
    assert t.status is TrajectoryStatus.INCOMPLETE and "no terminal lifecycle event" in (t.drop_reason or "")
    rig2 = Rig()  # no request: rollout_timeout_s
    last = rig2.feed(records[1:], 0)
    assert rig2.tick(last + 109_999) == [] and len(rig2.tick(last + 110_000)) == 1


def test_a_queued_request_is_not_given_up_before_it_starts() -> None:
    r = rollout()
    (_, request), rest = r.records[0], r.records[1:]
    assert isinstance(request, RolloutRequest) and request.timeout_s == 600
    rig = Rig()
    at = rig.feed([(REQUESTS, request)], 0)
    waited = at + (600 + 10) * 1000  # the request's timeout_s + settle_timeout_s: the give-up time of the old rule
    assert rig.tick(waited) == []  # still queued for a sandbox slot: not given up
    [t] = rig.tick(rig.feed(rest, waited + 1) + 1000)  # it starts late and is assembled whole
    assert t.status is TrajectoryStatus.COMPLETE and t.reward == 0.75 and t.calls == 3 and not rig.rejected

    never = Rig()  # never started: rollout_timeout_s of queueing, then its own budget and the settle timeout
    bound = never.feed([(REQUESTS, request)], 0) + (100 + 600 + 10) * 1000
    assert never.tick(bound - 1) == []
    [t] = never.tick(bound)
    assert t.status is TrajectoryStatus.INCOMPLETE and "no terminal lifecycle event" in (t.drop_reason or "")

    due = Rig()  # a deadline (no worker starts the request after it) bounds the queueing instead
    due.feed([(REQUESTS, replace(request, deadline_ms=5_000))], 0)
    assert due.tick(5_000 + 610_000 - 1) == [] and len(due.tick(5_000 + 610_000)) == 1


@pytest.mark.parametrize("fault", ["infra", "infra_reward"])
def test_infra_failures_settle_without_waiting_for_calls_and_have_no_reward(fault: str) -> None:
    r, rig = rollout(fault), Rig()
    records = [rec for rec in r.records if rec[0] != CALLS or fault == "infra_reward"]  # FAILED: calls lost too
    last = rig.feed(records, 0)
    [t] = rig.tick(last + 1000)
    assert t.status is TrajectoryStatus.INFRA_FAILURE and t.reward is None and t.segments == []
    assert "infrastructure failure: " in (t.drop_reason or "")


def test_grader_crash_after_exit_is_an_infra_failure() -> None:
    r, rig = rollout(), Rig()
    last = rig.feed(r.records, 0)
    failed = RolloutEvent(
        rollout_id="r-1",
        policy_version=1,
        timestamp_ms=0,
        attempt_id="r-1-a0",
        group_id="g",
        state=RolloutState.FAILED,
        harness="claude-code",
        reason="grader crashed",
    )
    rig.feed([(ROLLOUT_EVENTS, failed)], last + 100)
    [t] = rig.tick(last + 1100)
    assert t.status is TrajectoryStatus.INFRA_FAILURE and t.drop_reason == "infrastructure failure: grader crashed"


def test_timed_out_is_graded_and_trainable_ungraded_is_dropped() -> None:
    r, rig = rollout("timed_out"), Rig()
    rig.tick(rig.feed(r.records, 0) + 1000)
    assert rig.out[0].status is TrajectoryStatus.TIMED_OUT and rig.out[0].reward == 0.75 and rig.out[0].segments
    r, rig = rollout("ungraded"), Rig()
    rig.tick(rig.feed(r.records, 0) + 1000)
    assert rig.out[0].status is TrajectoryStatus.DROPPED and rig.out[0].reward is None
    assert rig.out[0].drop_reason == "ungraded: synthetic ungraded"


def test_leaf_cap_drops_the_tree_but_keeps_the_reward() -> None:
    r = rollout(n_calls=3)
    calls = [ev for topic, ev in r.records if topic == CALLS]
    assert isinstance(calls[2], CallEvent)
    calls[2] = replace(calls[2], parent_call_id=None, shared_prefix_len=0, new_tokens=np.array([7, 8, 9], "<i4"))
    records, it = [], iter(calls)
    for topic, ev in r.records:
        records.append((topic, next(it) if topic == CALLS else ev))
    rig = Rig(CFG.model_copy(update={"max_leaves": 1, "prune": "none"}))  # keep the branch: 2 leaves
    rig.tick(rig.feed(records, 0) + 1000)
    [t] = rig.out
    assert t.status is TrajectoryStatus.DROPPED and t.reward == 0.75 and t.segments == []
    assert t.drop_reason == "branch leaf count 2 > cap 1 (2 leaves)"


def test_late_records_are_rejected_with_the_reason() -> None:
    r, rig = rollout("late"), Rig()
    last = rig.feed(r.records, 0)
    rig.tick(last + 1000)
    rig.feed(r.late_records, last + 3000)
    assert [v for v, _ in rig.rejected] == [Verdict.LATE, Verdict.LATE]
    assert rig.rejected[0][1].startswith(
        "late call r-1-c0 seq 0 (a duplicate of an included call): rollout r-1 settled as COMPLETE 2000 ms earlier"
    )
    assert "late reward" in rig.rejected[1][1] and len(rig.out) == 1


def test_contradicting_records_are_rejected() -> None:
    r, rig = rollout(), Rig()
    last = rig.feed(r.records, 0)
    started = next(ev for topic, ev in r.records if topic == ROLLOUT_EVENTS)
    reward = next(ev for topic, ev in r.records if topic == REWARDS)
    assert isinstance(reward, RewardEvent) and isinstance(started, RolloutEvent)
    restart = replace(started, state=RolloutState.TIMED_OUT)  # HARNESS_EXITED → TIMED_OUT is not allowed
    rig.feed([(ROLLOUT_EVENTS, restart), (REWARDS, replace(reward, reward=0.1))], last + 10)
    assert [v for v, _ in rig.rejected] == [Verdict.REJECTED, Verdict.REJECTED]
    assert "HARNESS_EXITED → TIMED_OUT is not allowed" in rig.rejected[0][1]
    assert "second, different reward" in rig.rejected[1][1]
    rig.tick(last + 2000)
    assert rig.out[0].status is TrajectoryStatus.COMPLETE and rig.out[0].reward == 0.75


def _attempt(r: SynthRollout, attempt: int) -> list[tuple[str, Event]]:
    aid = f"r-1-a{attempt}"
    out: list[tuple[str, Event]] = []
    for topic, ev in r.records:
        if isinstance(ev, RolloutEvent | RewardEvent):
            ev = replace(ev, attempt_id=aid, **({"attempt": attempt} if isinstance(ev, RolloutEvent) else {}))
        elif isinstance(ev, CallEvent):
            parent = f"{ev.parent_call_id}-{attempt}" if ev.parent_call_id else None
            ev = replace(ev, call_id=f"{ev.call_id}-{attempt}", parent_call_id=parent, attempt_id=aid)
        out.append((topic, ev))
    return out


def test_a_reissued_attempt_reopens_a_rollout_that_failed() -> None:
    rig = Rig()
    last = rig.feed(_attempt(rollout("infra"), 0), 0)
    rig.tick(last + 1000)
    last = rig.feed(_attempt(rollout(), 1)[1:], last + 5000)  # request re-sent (attempt stays 0): skip it
    rig.tick(last + 1000)
    assert [(t.status, t.attempt_id) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1-a0"),
        (TrajectoryStatus.COMPLETE, "r-1-a1"),
    ]
    assert rig.out[1].calls == 3 and rig.rejected == []


def test_a_reissues_reward_read_while_the_failed_attempt_is_unsettled_is_held_for_it() -> None:
    """The infrastructure failure's reward is in but not settled yet; the re-issue ran at once and its reward is read
    before its STARTED (another topic). It is held, not rejected as a second reward: rejecting it left the re-issue
    without a reward, settled INCOMPLETE at the timeout, and its group a member short (seen in the stack-kills test)."""
    rig = Rig()
    failed = [(t, ev) for t, ev in _attempt(rollout("infra"), 0) if t != CALLS and getattr(ev, "state", None) in (
        None, RolloutState.FAILED)]  # fmt: skip
    infra = RewardEvent(
        rollout_id="r-1",
        policy_version=0,
        timestamp_ms=1,
        attempt_id="r-1-a0",
        status=RewardStatus.INFRA_FAILURE,
        grader="none",
        reason="setup: cannot create sandbox: [Errno 28] No space left on device",
    )
    last = rig.feed([*failed, (REWARDS, infra)], 0)  # set up failed: FAILED and its INFRA_FAILURE reward, no STARTED
    second = _attempt(rollout(), 1)[1:]  # request re-sent (attempt stays 0): skip it
    [reward] = [(t, ev) for t, ev in second if isinstance(ev, RewardEvent)]
    last = rig.feed([reward], last + 10)  # before the failed attempt settles
    rig.tick(last + 1000)
    last = rig.feed([(t, ev) for t, ev in second if not isinstance(ev, RewardEvent)], last + 1100)
    rig.tick(last + 1000)
    assert rig.rejected == []
    assert [(t.status, t.attempt_id, t.reward) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1-a0", None),
        (TrajectoryStatus.COMPLETE, "r-1-a1", 0.75),
    ]


def test_a_newer_attempt_supersedes_an_unfinished_one() -> None:
    rig = Rig()
    first = _attempt(rollout(), 0)
    rig.feed(first[:3], 0)  # request, STARTED, one call; then the worker dies without a word
    last = rig.feed(_attempt(rollout(), 1)[1:], 500)
    assert [(t.status, t.attempt_id) for t in rig.out] == [(TrajectoryStatus.INFRA_FAILURE, "r-1-a0")]
    assert "superseded" in (rig.out[0].drop_reason or "")
    rig.tick(last + 1000)
    assert rig.out[1].status is TrajectoryStatus.COMPLETE and rig.out[1].attempt_id == "r-1-a1"


def _calls_first(records: list[tuple[str, Event]]) -> list[tuple[str, Event]]:
    """The attempt's calls reach the assembler before its lifecycle events (they travel on another topic)."""
    calls = [(t, ev) for t, ev in records if isinstance(ev, CallEvent)]
    return calls + [(t, ev) for t, ev in records if not isinstance(ev, CallEvent)]


def test_a_reissues_calls_before_its_start_are_held_for_it() -> None:
    rig = Rig()
    last = rig.feed(_attempt(rollout("infra"), 0), 0)
    rig.tick(last + 1000)
    last = rig.feed(_calls_first(_attempt(rollout(), 1)[1:]), last + 5000)
    rig.tick(last + 1000)
    assert rig.rejected == []  # before attempt ids on calls, these calls were dead-lettered as late
    assert [(t.status, t.attempt_id, t.calls) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1-a0", 3),
        (TrajectoryStatus.COMPLETE, "r-1-a1", 3),
    ]


def test_a_superseded_attempt_keeps_exactly_its_own_calls() -> None:
    rig = Rig()
    first = _attempt(rollout(), 0)
    rig.feed(first[:3], 0)  # request, STARTED, one call; then the worker dies without a word
    last = rig.feed(_calls_first(_attempt(rollout(), 1)[1:]), 500)  # the re-run's calls arrive before its STARTED
    rig.tick(last + 1000)
    assert [(t.status, t.attempt_id, t.calls) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1-a0", 1),
        (TrajectoryStatus.COMPLETE, "r-1-a1", 3),
    ]
    assert rig.rejected == [] and rig.calls == {}  # every stored call went into its own attempt's trajectory


def test_held_calls_of_an_attempt_that_never_starts_are_forgotten() -> None:
    rig = Rig()
    last = rig.feed(_attempt(rollout("infra"), 0), 0)
    rig.tick(last + 1000)
    stray = [(t, ev) for t, ev in _attempt(rollout(), 1) if isinstance(ev, CallEvent)]
    rig.feed(stray, last + 2000)
    assert len(rig.calls) == 3 and rig.rejected == []
    rig.tick(last + 3000 + 50_000)  # 50 s after the last held call: only the failed attempt's tombstone is left
    assert is_tombstone(rig.state["r-1"]) and rig.calls == {}


def test_settled_rollouts_are_compacted_to_a_tombstone_after_the_retention() -> None:
    r, rig = rollout(), Rig()
    last = rig.feed(r.records, 0)
    rig.tick(last + 1000)
    assert "r-1" in rig.state
    rig.tick(last + 1000 + 49_999)
    assert "r-1" in rig.state
    rig.tick(last + 1000 + 50_000)
    assert list(rig.state) == ["r-1"] and is_tombstone(rig.state["r-1"]) and len(rig.state["r-1"]) < 40
    assert DueIndex.load(rig.index[str(P)]).entries == {}


def test_state_survives_a_restart_mid_rollout() -> None:
    r, rig = rollout(), Rig()
    half = len(r.records) // 2
    rig.feed(r.records[:half], 0)
    # A restarted worker has only what the changelog restored: copies of the three maps.
    restarted = Rig()
    restarted.state, restarted.calls, restarted.index = dict(rig.state), dict(rig.calls), dict(rig.index)
    last = restarted.feed(r.records[half:], 1000)
    restarted.tick(last + 1000)
    [t] = restarted.out
    assert t.status is TrajectoryStatus.COMPLETE and t.calls == 3
    acc = RolloutAccumulator.from_bytes(restarted.state["r-1"])
    assert RolloutAccumulator.from_bytes(acc.to_bytes()) == acc and acc.settled is not None


def test_task_and_step_fall_back_to_the_group_id() -> None:
    r, rig = rollout(), Rig()
    rig.tick(rig.feed(r.records[1:], 0) + 1000)  # no request
    [t] = rig.out
    assert (t.task_id, t.step, t.harness, t.metadata) == ("suite/t1", 7, "claude-code", {})
    assert split_group_id("a|b|c") == ("a|b|c", -1) and split_group_id("x/t|h|-1") == ("x/t", -1)


def test_reward_status_enum_round_trips_through_the_state() -> None:
    acc = RolloutAccumulator("r", 0, 0)
    rew = RewardEvent(
        rollout_id="r", policy_version=1, timestamp_ms=0, attempt_id="a", status=RewardStatus.OK, grader="g", reward=1.0
    )
    assert acc.on_reward(rew, 5).verdict is Verdict.ACCEPTED
    again = RolloutAccumulator.from_bytes(acc.to_bytes())
    assert again.on_reward(rew, 6).verdict is Verdict.DUPLICATE and again.last_ms == 5


def test_silence_counts_only_while_the_worker_listens() -> None:
    r, rig = rollout("missing_reward"), Rig()
    last = rig.feed(r.records, 0)
    # The worker restarts long after the give-up time: it must first listen for settle_timeout_s itself.
    since = last + 60_000
    assert rig.core().on_tick(P, since + 1000, since).trajectories == []
    assert rig.core().on_tick(P, since + 9_999, since).trajectories == []
    [t] = rig.core().on_tick(P, since + 10_000, since).trajectories
    assert t.status is TrajectoryStatus.INCOMPLETE
    r2, rig2 = rollout(rollout_id="r-2"), Rig()  # a complete rollout only needs a quiet period after the restart
    last = rig2.feed(r2.records, 0)
    assert rig2.core().on_tick(P, last + 5000, last + 4500).trajectories == []
    assert len(rig2.core().on_tick(P, last + 5500, last + 4500).trajectories) == 1


def event(attempt_id: str, state: RolloutState = RolloutState.STARTED, ts: int = 0) -> RolloutEvent:
    """A lifecycle event of request attempt 0 of rollout ``r`` (runs of one request differ by attempt id)."""
    return RolloutEvent(
        rollout_id="r",
        policy_version=0,
        timestamp_ms=ts,
        attempt_id=attempt_id,
        state=state,
        group_id="t|h|0",
        harness="h",
        attempt=0,
        calls_served=0 if state is RolloutState.HARNESS_EXITED else None,
    )


def test_a_rerun_after_a_worker_crash_supersedes_the_unfinished_attempt() -> None:
    """Same request attempt number, new attempt id (the request was redelivered after the worker died mid-rollout):
    the unfinished attempt is settled as an infrastructure failure and the re-run is assembled."""

    acc = RolloutAccumulator("r", 0, 0)
    assert acc.on_event(event("r.a0.first"), 0).verdict is not Verdict.SUPERSEDES
    assert acc.on_event(event("r.a0.second"), 10).verdict is Verdict.SUPERSEDES


def test_a_rerun_supersedes_an_attempt_whose_worker_died_while_grading() -> None:
    """The worker published HARNESS_EXITED, then died grading (no reward); the request is redelivered and re-run under
    the same attempt number. The re-run is assembled at once (the dead attempt settles as an infrastructure failure),
    not rejected: rejecting it left the group a member short until its timeout (seen in the stack-kills test)."""

    def run(aid: str, tag: str) -> list[tuple[str, Event]]:
        out: list[tuple[str, Event]] = []
        for topic, ev in rollout().records:
            if isinstance(ev, CallEvent):
                parent = f"{ev.parent_call_id}-{tag}" if ev.parent_call_id else None
                ev = replace(ev, call_id=f"{ev.call_id}-{tag}", parent_call_id=parent)
            out.append((topic, replace(ev, attempt_id=aid) if hasattr(ev, "attempt_id") else ev))
        return out

    rig = Rig()
    dead = [(t, ev) for t, ev in run("r-1.a0.dead", "d") if not isinstance(ev, RewardEvent)]
    last = rig.feed(dead, 0)
    last = rig.feed(run("r-1.a0.rerun", "r")[1:], last + 500)  # the redelivered request is a duplicate: skipped
    rig.tick(last + 1000)
    assert rig.rejected == []
    assert [(t.status, t.attempt_id) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1.a0.dead"),
        (TrajectoryStatus.COMPLETE, "r-1.a0.rerun"),
    ]
    assert "superseded" in (rig.out[0].drop_reason or "") and rig.out[1].reward == 0.75 and rig.out[1].calls == 3


def test_a_rerun_of_an_attempt_that_was_graded_is_set_aside() -> None:
    """The worker died after the reward, before releasing the request: the graded attempt is trained, the re-run is
    set aside (consumers.analytics.reconcile counts it as a re-run set aside)."""
    rig = Rig()
    first = [
        (t, replace(ev, attempt_id="r-1.a0.done") if hasattr(ev, "attempt_id") else ev) for t, ev in rollout().records
    ]
    last = rig.feed(first, 0)
    again = [
        (t, replace(ev, attempt_id="r-1.a0.again")) for t, ev in rollout().records[1:] if not isinstance(ev, CallEvent)
    ]
    last = rig.feed(again, last + 100)
    rig.tick(last + 1000)
    assert [(t.status, t.attempt_id) for t in rig.out] == [(TrajectoryStatus.COMPLETE, "r-1.a0.done")]
    # Its STARTED and HARNESS_EXITED are rejected with the reason; its reward is held, forgotten with the rollout.
    assert [v for v, _ in rig.rejected] == [Verdict.REJECTED] * 2


def test_a_reruns_reward_read_before_its_started_event_joins_it() -> None:
    """The re-run's reward (rewards topic) is read before its STARTED (rollout events topic): the topics are not
    ordered with each other. It is held, not rejected, and joins when the re-run supersedes the unfinished attempt,
    also through the assembler's settle-and-reopen, and also from a restarted worker's state."""
    rig = Rig()

    reward = RewardEvent(
        rollout_id="r",
        policy_version=0,
        timestamp_ms=0,
        attempt_id="r.a0.second",
        status=RewardStatus.OK,
        grader="g",
        reward=0.5,
    )
    core = rig.core()
    assert core.on_record(event("r.a0.first"), b"", 0, 0).rejected is None
    assert core.on_record(reward, b"", 0, 5).rejected is None  # held: its attempt is not the assembled one yet
    assert core.on_record(reward, b"", 0, 6).rejected is None  # the same reward again: a duplicate
    result = rig.core().on_record(event("r.a0.second"), b"", 0, 10)  # a restarted worker reads the rest
    assert result.rejected is None
    [superseded] = result.trajectories
    assert superseded.attempt_id == "r.a0.first" and superseded.status is TrajectoryStatus.INFRA_FAILURE
    acc = rig.core()._load("r", 10)
    assert acc.attempt_id == "r.a0.second" and acc.reward is not None and acc.reward["reward"] == 0.5
    assert acc.held_rewards == {}


def test_trainable_segments_carry_their_calls_sampling_settings() -> None:
    """Each generated segment gets its own call's (temperature, top_p, top_k); context segments none."""
    r, rig = rollout(), Rig()
    settings = [(0.5, 1.0, 0), (0.75, 0.875, 0), (1.0, 1.0, 16)]  # exact in float32
    records, k = [], 0
    for topic, ev in r.records:
        if topic == CALLS:
            temperature, top_p, top_k = settings[k]
            ev, k = replace(ev, temperature=temperature, top_p=top_p, top_k=top_k), k + 1
        records.append((topic, ev))
    assert k == 3
    [t] = [*rig.tick(rig.feed(records, 1000) + 1000)]
    by_call = {ev.call_id: settings[i] for i, ev in enumerate(ev for topic, ev in records if topic == CALLS)}
    decoded = Trajectory.from_bytes(t.to_bytes())  # what the learner reads
    trainable = [s for s in decoded.segments if s.trainable]
    assert len(trainable) == 3
    assert [(s.temperature, s.top_p, s.top_k) for s in trainable] == [by_call[s.call_id] for s in trainable]
    assert all((s.temperature, s.top_p, s.top_k) == (None, None, None) for s in decoded.segments if not s.trainable)


def test_a_long_lived_core_sees_index_changes_made_behind_its_back() -> None:
    """The due index is decoded once per stored version (streams.state.Deadlines keeps it by its bytes): a core that
    keeps running reads it again when the table changed under it (another worker owned the partition meanwhile, or
    the table was restored), and settles exactly what a fresh core would."""
    a, b = rollout(rollout_id="r-a"), rollout(rollout_id="r-b")
    rig = Rig()
    core = rig.core()  # one core for the whole test, like a running worker
    t = 0
    for _, ev in a.records:
        core.on_record(ev, ev.to_bytes(), P, t)
        t += 10
    assert core.on_tick(P, t).trajectories == []  # r-a's quiet period has not passed: decoded and cached
    last = rig.feed(b.records, t)  # fresh cores (another worker) add r-b to the same partition's index
    settled = core.on_tick(P, last + 1000).trajectories
    assert sorted(x.rollout_id for x in settled) == ["r-a", "r-b"]
    assert all(x.status is TrajectoryStatus.COMPLETE for x in settled)
    rig.index[str(P)] = DueIndex({"r-a": 0}).to_bytes()  # a restored, older index: r-a due now, r-b unknown
    rig.state["r-a"] = RolloutAccumulator("r-a", 0, 0).to_bytes()  # ... and r-a not ready
    assert core.on_tick(P, last + 2000).trajectories == []
    assert DueIndex.load(rig.index[str(P)]).entries == {"r-a": 100_000 + 10_000}  # visited and rescheduled


def test_earliest_due_tells_the_timer_whether_a_tick_would_visit_anything() -> None:
    r, rig = rollout(), Rig()
    core = rig.core()
    assert core.deadlines.earliest(P) is None  # nothing scheduled: the timer sends no tick
    last = rig.feed(r.records, 0)
    due = core.deadlines.earliest(P)
    assert due == min(DueIndex.load(rig.index[str(P)]).entries.values()) and due <= last + 1000
    assert core.on_tick(P, due - 1).trajectories == []
    assert [t.rollout_id for t in core.on_tick(P, last + 1000).trajectories] == ["r-1"]
    assert core.deadlines.earliest(P) == last + 1000 + 50_000  # now only the forget time of the settled rollout


def test_an_older_runs_started_read_after_the_newer_runs_reward_is_settled_apart() -> None:
    """Two runs of one request (the first one's worker died): the newer run's reward is read before the older run's
    STARTED (topics are not ordered with each other). The older run is settled apart as superseded, the newer one
    goes on and completes with its reward; replaying the older STARTED changes nothing."""
    rig = Rig()

    newer = RewardEvent(
        rollout_id="r",
        policy_version=0,
        timestamp_ms=300,
        attempt_id="r.a0.newer",
        status=RewardStatus.OK,
        grader="g",
        reward=0.5,
    )
    assert rig.core().on_record(newer, b"", P, 0).rejected is None
    result = rig.core().on_record(event("r.a0.older", RolloutState.STARTED, 100), b"", P, 10)
    assert result.rejected is None
    [older] = result.trajectories
    assert older.attempt_id == "r.a0.older" and older.status is TrajectoryStatus.INFRA_FAILURE
    again = rig.core().on_record(event("r.a0.older", RolloutState.STARTED, 100), b"", P, 15)  # a replay
    assert again.rejected is None and again.trajectories == []
    for state, ts in ((RolloutState.STARTED, 200), (RolloutState.HARNESS_EXITED, 250)):
        assert rig.core().on_record(event("r.a0.newer", state, ts), b"", P, 20).rejected is None
    [done] = rig.tick(10_000_000)
    assert done.attempt_id == "r.a0.newer" and done.reward == 0.5  # (DROPPED here: a run without calls)
    assert done.status is not TrajectoryStatus.INFRA_FAILURE


def _feed_without_calls(rig: Rig, r: SynthRollout, calls_end: int | None) -> tuple[int, list[Event]]:
    """Feed ``r``'s lifecycle events and reward (the worker reads them first); return the last time and its calls."""
    t, calls = 0, []
    for _, ev in r.records:
        if isinstance(ev, CallEvent):
            calls.append(ev)
            continue
        rig.out += rig.core().on_record(ev, ev.to_bytes(), P, t, calls_end).trajectories
        t += 10
    return t, calls


def test_a_rollout_short_of_calls_waits_while_its_calls_partition_is_unread() -> None:
    # A worker catching up after a rebalance reads the small lifecycle records long before a backlog of calls: the
    # settle timeout must not give the rollout up while its calls are still in Kafka, unread (#28).
    r, rig = rollout(rollout_id="r-b"), Rig()
    last, calls = _feed_without_calls(rig, r, calls_end=100)
    late = last + 30_000  # far past the settle timeout (10 s), within the hold (4 more timeouts)
    assert rig.core().on_tick(P, late, 0, calls_read=40).trajectories == []  # 60 offsets still unread: held
    for ev in calls:  # the backlog arrives
        rig.core().on_record(ev, ev.to_bytes(), P, late + 10)
    [t] = rig.core().on_tick(P, late + 2_000, 0, calls_read=100).trajectories
    assert t.status is TrajectoryStatus.COMPLETE and len(t.segments) > 0


def test_without_a_known_read_position_the_settle_timeout_still_applies() -> None:
    r, rig = rollout(rollout_id="r-u"), Rig()
    last, _ = _feed_without_calls(rig, r, calls_end=100)
    [t] = rig.core().on_tick(P, last + 60_000, 0, calls_read=None).trajectories
    assert t.status is TrajectoryStatus.INCOMPLETE and "calls received" in t.drop_reason
    r2, rig2 = rollout(rollout_id="r-r"), Rig()  # read past the end: the calls really are missing
    last, _ = _feed_without_calls(rig2, r2, calls_end=100)
    [t2] = rig2.core().on_tick(P, last + 60_000, 0, calls_read=100).trajectories
    assert t2.status is TrajectoryStatus.INCOMPLETE and "behind" not in t2.drop_reason


def test_a_calls_partition_that_never_advances_is_waited_for_a_bounded_time() -> None:
    r, rig = rollout(rollout_id="r-s"), Rig()
    last, _ = _feed_without_calls(rig, r, calls_end=100)
    cap = RolloutAccumulator.from_bytes(rig.state["r-s"]).deadline_ms(CFG) + 4 * 10_000
    assert rig.core().on_tick(P, cap - 1, 0, calls_read=40).trajectories == []
    [t] = rig.core().on_tick(P, cap + int(CFG.tick_interval_s * 1000), 0, calls_read=40).trajectories  # next tick
    assert t.status is TrajectoryStatus.INCOMPLETE and "60 offsets behind" in t.drop_reason


def test_a_settled_attempt_carries_its_own_number_when_its_reissue_was_read_first() -> None:
    """The grouper waits for a re-issue while ``metadata["attempt"]`` + 1 < ``max_attempts``: an attempt settled after
    its re-issue's request was read must still say its own number, or the grouper takes a failed attempt with attempts
    left for the last one, closes the group without the re-issue and dead-letters it late."""
    rig = Rig()
    first = _attempt(rollout(), 0)
    rig.feed(first[:3], 0)  # request, STARTED, one call; then the worker dies without a word
    request = first[0][1]
    assert isinstance(request, RolloutRequest)
    last = rig.feed([(REQUESTS, replace(request, attempt=1))], 100)  # the re-issue's request is read first
    last = rig.feed(_attempt(rollout(), 1)[1:], last + 100)  # then its run: STARTED supersedes attempt 0
    rig.tick(last + 1000)
    assert [(t.status, t.attempt_id, t.metadata["attempt"]) for t in rig.out] == [
        (TrajectoryStatus.INFRA_FAILURE, "r-1-a0", "0"),
        (TrajectoryStatus.COMPLETE, "r-1-a1", "1"),
    ]
