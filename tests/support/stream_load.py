"""Synthetic rollouts for the stream processors: requests, lifecycle events, calls and rewards, with faults.

Each :class:`SynthRollout` knows the records it produces (in the order a real proxy / sandbox worker would publish
them), the fault injected into them and what the assembler must make of it (status, reward). Used by the unit tests
of ``streams.assemble`` / ``streams.group``, the integration tests and ``bench/streams.py``. Pure: no Kafka import.

Calls form an append-only chain (Claude-Code-like): call i's prompt is call i-1's prompt + generation + a tool
result; some rollouts add a SIDE call (a title request) which the tree leaves out.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from schemas.events import (
    CallEvent,
    CallKind,
    Dialect,
    Event,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    TrajectoryStatus,
)
from schemas.topics import CALLS, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS

T0 = 1_790_000_000_000
REWARDS_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)
# Faults: what goes wrong with a rollout's records, and what the assembler must conclude.
FAULTS = ("", "dup", "timed_out", "infra", "infra_reward", "missing_call", "missing_reward", "ungraded", "late")


@dataclass
class SynthRollout:
    rollout_id: str
    group_id: str
    task_id: str
    harness: str
    step: int
    reward_value: float | None
    fault: str = ""
    n_calls: int = 3
    side_call: bool = False
    policy_version: int = 1
    group_size: int | None = 8  # announced in the request metadata (None: not announced)
    seed: int = 0
    token_scale: int = 1  # multiplies prompt, tool-result and generation lengths (the bench uses bigger calls)
    records: list[tuple[str, Event]] = field(default_factory=list)  # (catalog topic, event), publishing order
    late_records: list[tuple[str, Event]] = field(default_factory=list)  # to send once the rollout has settled

    @property
    def attempt_id(self) -> str:
        return f"{self.rollout_id}-a0"

    @property
    def expected_status(self) -> TrajectoryStatus:
        return {
            "infra": TrajectoryStatus.INFRA_FAILURE,
            "infra_reward": TrajectoryStatus.INFRA_FAILURE,
            "missing_call": TrajectoryStatus.INCOMPLETE,
            "missing_reward": TrajectoryStatus.INCOMPLETE,
            "ungraded": TrajectoryStatus.DROPPED,
            "timed_out": TrajectoryStatus.TIMED_OUT,
        }.get(self.fault, TrajectoryStatus.COMPLETE)

    @property
    def expected_reward(self) -> float | None:
        if self.fault in ("infra", "infra_reward", "ungraded", "missing_reward"):
            return None
        return self.reward_value

    @property
    def trainable(self) -> bool:
        return self.expected_status in (TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT)


def _calls(r: SynthRollout, rng: random.Random) -> list[CallEvent]:
    calls: list[CallEvent] = []
    k = r.token_scale
    prompt = [1, 2, 3, 4, 5] + [10 + rng.randrange(50) for _ in range(8 * k)]
    seq = 0
    parent: CallEvent | None = None
    parent_full: list[int] = []
    for i in range(r.n_calls):
        if i == 1 and r.side_call:  # a title request: its own short prompt, left out of the tree
            gen = [400 + rng.randrange(50) for _ in range(4)]
            calls.append(_call(r, f"{r.rollout_id}-c{seq}", seq, CallKind.SIDE, [50, 51, 52], gen, None, 0))
            seq += 1
        gen = [100 + rng.randrange(200) for _ in range(rng.randrange(3, 9) * k)]
        if parent is None:
            new, spl = prompt, 0
        else:
            tool = [200 + rng.randrange(100) for _ in range(rng.randrange(2, 6) * k)]
            prompt = parent_full + tool
            new, spl = tool, len(parent_full)
        call = _call(
            r,
            f"{r.rollout_id}-c{seq}",
            seq,
            CallKind.MAIN,
            new,
            gen,
            parent.call_id if parent else None,
            spl,
            prompt_len=len(prompt),
        )
        calls.append(call)
        parent, parent_full = call, prompt + gen
        seq += 1
    return calls


def _call(
    r: SynthRollout,
    cid: str,
    seq: int,
    kind: CallKind,
    new: list[int],
    gen: list[int],
    parent: str | None,
    spl: int,
    prompt_len: int | None = None,
) -> CallEvent:
    return CallEvent(
        rollout_id=r.rollout_id,
        policy_version=r.policy_version,
        timestamp_ms=T0 + seq,
        call_id=cid,
        seq=seq,
        dialect=Dialect.ANTHROPIC_MESSAGES,
        requested_model="policy",
        call_kind=kind,
        new_tokens=np.array(new, dtype="<i4"),
        prompt_len=prompt_len if prompt_len is not None else len(new),
        generated_tokens=np.array(gen, dtype="<i4"),
        logprobs=np.array([-t / 1000 for t in gen], dtype="<f4"),
        finish_reason="stop",
        parent_call_id=parent,
        shared_prefix_len=spl,
        attempt_id=r.attempt_id,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )


def build(r: SynthRollout) -> SynthRollout:
    """Fill ``r.records`` / ``r.late_records`` from its fields (deterministic in ``r.seed``)."""
    rng = random.Random(f"{r.seed}:{r.rollout_id}")
    meta = {"exp": "synthetic"} | ({"group_size": str(r.group_size)} if r.group_size else {})
    req = RolloutRequest(
        rollout_id=r.rollout_id,
        policy_version=r.policy_version,
        timestamp_ms=T0,
        suite="synth",
        task_id=r.task_id,
        harness=r.harness,
        group_id=r.group_id,
        step=r.step,
        timeout_s=600.0,
        metadata=meta,
    )
    head = {
        "rollout_id": r.rollout_id,
        "policy_version": r.policy_version,
        "attempt_id": r.attempt_id,
        "group_id": r.group_id,
        "harness": r.harness,
    }
    started = RolloutEvent(timestamp_ms=T0, state=RolloutState.STARTED, **head)
    calls = _calls(r, rng)
    served = len(calls)
    ends = {"timed_out": RolloutState.TIMED_OUT, "infra": RolloutState.FAILED}
    state = ends.get(r.fault, RolloutState.HARNESS_EXITED)
    end = RolloutEvent(
        timestamp_ms=T0 + 100,
        state=state,
        calls_served=served,
        reason="sandbox lost" if r.fault == "infra" else None,
        **head,
    )
    statuses = {"infra_reward": RewardStatus.INFRA_FAILURE, "ungraded": RewardStatus.UNGRADED}
    status = statuses.get(r.fault, RewardStatus.OK)
    reward = RewardEvent(
        rollout_id=r.rollout_id,
        policy_version=r.policy_version,
        timestamp_ms=T0 + 200,
        attempt_id=r.attempt_id,
        status=status,
        grader="synth",
        reward=r.reward_value if status is RewardStatus.OK else None,
        reason=None if status is RewardStatus.OK else f"synthetic {r.fault}",
    )
    sent_calls = calls[:-1] if r.fault == "missing_call" else calls
    recs: list[tuple[str, Event]] = [(ROLLOUT_REQUESTS, req), (ROLLOUT_EVENTS, started)]
    recs += [(CALLS, c) for c in sent_calls]
    recs.append((ROLLOUT_EVENTS, end))
    if r.fault not in ("infra", "missing_reward"):
        recs.append((REWARDS, reward))
    if r.fault == "dup":  # at-least-once producers: a call, the terminal event and the reward delivered twice
        recs += [(CALLS, calls[rng.randrange(len(calls))]), (ROLLOUT_EVENTS, end), (REWARDS, reward)]
    if r.fault == "late":  # a straggler duplicate call and reward that only show up after the rollout settled
        r.late_records = [(CALLS, calls[0]), (REWARDS, reward)]
    r.records = recs
    return r


def make_groups(
    n_groups: int,
    harnesses: tuple[str, ...] = ("claude-code", "openclaw"),
    *,
    group_size: int = 8,
    seed: int = 0,
    faults: bool = True,
    announce_size: bool = True,
    calls: tuple[int, int] = (1, 5),
    token_scale: int = 1,
) -> list[list[SynthRollout]]:
    """``n_groups`` groups (task × harness × step), harnesses alternating, with a seeded sprinkle of faults.

    Faults, when on: group 0 has equal rewards (zero variance); other groups get on average ~2 faulty rollouts.
    """
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        harness = harnesses[g % len(harnesses)]
        task, step = f"t{g // len(harnesses):03d}", 1 + g % 3
        gid = f"synth/{task}|{harness}|{step}"
        members = []
        for k in range(group_size):
            fault = ""
            if faults and g > 0 and rng.random() < 0.25:
                fault = rng.choice(FAULTS[1:])
            reward = 0.5 if faults and g == 0 else rng.choice(REWARDS_GRID)
            members.append(
                build(
                    SynthRollout(
                        rollout_id=f"r{seed}-{g:03d}-{k}",
                        group_id=gid,
                        task_id=f"synth/{task}",
                        harness=harness,
                        step=step,
                        reward_value=reward,
                        fault=fault,
                        n_calls=rng.randrange(*calls),
                        side_call=rng.random() < 0.2,
                        group_size=group_size if announce_size else None,
                        seed=seed,
                        token_scale=token_scale,
                    )
                )
            )
        groups.append(members)
    return groups


def interleave(rollouts: list[SynthRollout], seed: int = 0, window: int | None = None) -> list[tuple[str, Event]]:
    """All records of ``rollouts`` merged at random, each rollout's own records keeping their order.

    ``window``: at most this many rollouts in flight at once (the next starts when one has published everything),
    like a fleet of that many sandboxes; None: all at once.
    """
    rng = random.Random(seed)
    waiting = [list(r.records) for r in rollouts if r.records]
    waiting.reverse()
    active: list[list[tuple[str, Event]]] = []
    out: list[tuple[str, Event]] = []
    while waiting or active:
        while waiting and (window is None or len(active) < window):
            active.append(waiting.pop())
        q = active[rng.randrange(len(active))]
        out.append(q.pop(0))
        if not q:
            active.remove(q)
    return out
