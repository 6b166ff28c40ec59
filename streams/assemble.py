"""Assembler: a rollout's calls, lifecycle events, reward (and request) → one settled :class:`Trajectory`.

Topics in: ``clawstream.calls``, ``clawstream.rollout.events``, ``clawstream.rewards``, ``clawstream.rollout.requests``
(all keyed by rollout id, co-partitioned) and the app's own tick topic. Out: ``clawstream.trajectories`` (key =
rollout id) and ``clawstream.deadletter`` (rejected and late records). The Faust agent lives in ``streams.app``
(run ``python -m streams.app worker``); this module is the pure core: no Kafka, no Faust.

Settle rule. A rollout is *ready* when it is an infrastructure failure (terminal FAILED, or a reward with status
INFRA_FAILURE) or when its terminal lifecycle event (HARNESS_EXITED / TIMED_OUT with ``calls_served``), exactly
``calls_served`` distinct calls and its reward are all in. A ready rollout settles once no new record of it arrived for
``settle_interval_s`` (docs/method.md#settling: the count stopped changing). A rollout that is not ready settles
INCOMPLETE (with a ``drop_reason`` naming what is missing) ``settle_timeout_s`` after its terminal event, or — when the
terminal event never came — after ``timeout_s`` of its request (``rollout_timeout_s`` if unknown) plus
``settle_timeout_s`` of silence. Times are processing times (persisted in the state, so a restarted worker keeps the
deadlines), and silence only counts from when the worker started listening (its last completed rebalance): after a
restart, records that arrived meanwhile may still wait in Kafka, so no rollout is given up before the worker itself
waited the full interval.

Records. Duplicates (same call id, same lifecycle state, same reward) are ignored. A record of a settled rollout is
*late* and goes to the dead-letter topic with the reason — except the STARTED event of a re-issued attempt after an
infrastructure failure, which reopens the rollout (a STARTED of a newer attempt also supersedes an unsettled attempt,
which then settles as INFRA_FAILURE first). Calls carry their attempt id (from the proxy registration): a call of
another attempt than the one being assembled is held apart — a re-issue's or re-run's calls that arrive before its
STARTED event — and joins when its attempt becomes the assembled one; the superseded attempt's trajectory holds
exactly its own calls. Held calls of an attempt that never starts are forgotten with the rollout. Calls without an
attempt id (older records) count for whichever attempt is assembled. Lifecycle moves that ``schemas.lifecycle``
forbids are rejected (a terminal event without STARTED is accepted: STARTED may be lost).

Trajectory. Status: INFRA_FAILURE (reward null; never trained on, never in statistics), DROPPED (ungraded, leaf cap,
inconsistent calls: not trainable, reward kept when graded), TIMED_OUT (killed at the limit, graded, trainable),
COMPLETE, INCOMPLETE. Only COMPLETE / TIMED_OUT carry tree segments. Task id and step come from the request, else
from the group id ``task|harness|step``; the request's metadata is copied (plus ``suite`` and ``eval``).

State layout (three key → bytes maps, Faust tables in the app, dicts in tests): ``state[rollout_id]`` the JSON
:class:`RolloutAccumulator`, ``calls[rollout_id + NUL + call_id]`` the call's original Avro bytes (so a call is
written once, not re-written with every update), ``index[str(partition)]`` a :class:`streams.state.DueIndex` of the
partition's rollouts → the earliest time each may need attention (a lower bound; a tick re-checks and moves it, see
:class:`streams.state.Deadlines`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    TreeSegment,
)
from schemas.lifecycle import can_transition
from streams.settings import StreamsSettings
from streams.state import TRAINABLE_STATUSES, Deadlines, Outcome, Verdict
from streams.tree import TreeCall, TreeError, build_tree

log = logging.getLogger(__name__)

TERMINAL = frozenset({RolloutState.HARNESS_EXITED, RolloutState.TIMED_OUT, RolloutState.FAILED})


def split_group_id(group_id: str) -> tuple[str, int]:
    """``task|harness|step`` → (task, step); (group_id, -1) when it does not have that shape."""
    parts = group_id.rsplit("|", 2)
    if len(parts) == 3 and parts[2].lstrip("-").isdigit():
        return parts[0], int(parts[2])
    return group_id, -1


@dataclass
class RolloutAccumulator:
    """What is known about one rollout (JSON-serialisable; calls themselves are stored apart, by call id)."""

    rollout_id: str
    first_ms: int
    last_ms: int  # processing time of the last accepted record: the quiet period counts from it
    call_ids: list[str] = field(default_factory=list)
    attempt: int = 0
    attempt_id: str | None = None
    started: dict[str, Any] | None = None
    terminal: dict[str, Any] | None = None  # state, calls_served, reason, exit_code, harness, group_id, ..., at_ms
    reward: dict[str, Any] | None = None
    request: dict[str, Any] | None = None
    settled: dict[str, Any] | None = None  # status, at_ms, attempt_id once the trajectory went out
    call_attempts: dict[str, str] = field(default_factory=dict)  # call id → attempt id, taken before it was known
    held: dict[str, list[str]] = field(default_factory=dict)  # attempt id → its calls, while another is assembled

    # ---- serialisation ----------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        # Fields hold plain JSON values: dump them as they are (dataclasses.asdict deep-copies, half the core time).
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutAccumulator:
        return cls(**json.loads(data))

    # ---- derived ----------------------------------------------------------------------------------------------
    @property
    def state(self) -> RolloutState | None:
        if self.terminal:
            return RolloutState(self.terminal["state"])
        return RolloutState.STARTED if self.started else None

    @property
    def infra(self) -> bool:
        return self.state is RolloutState.FAILED or (
            self.reward is not None and self.reward["status"] == RewardStatus.INFRA_FAILURE
        )

    @property
    def sealed(self) -> bool:
        served = self.terminal.get("calls_served") if self.terminal else None
        return served is not None and len(self.call_ids) == served

    def ready(self) -> bool:
        return self.infra or (self.terminal is not None and self.sealed and self.reward is not None)

    def missing(self) -> str:
        """What keeps a rollout from being ready, for the INCOMPLETE drop_reason."""
        parts = []
        if self.terminal is None:
            parts.append("no terminal lifecycle event")
        else:
            served = self.terminal.get("calls_served")
            if served is None:
                parts.append(f"calls_served unknown ({len(self.call_ids)} calls received)")
            elif len(self.call_ids) != served:
                parts.append(f"{len(self.call_ids)}/{served} calls received")
        if self.reward is None:
            parts.append("no reward")
        return ", ".join(parts) or "nothing"

    def deadline_ms(self, cfg: StreamsSettings, since_ms: int = 0) -> int:
        """When the rollout next needs attention: quiet period end, give-up time, or (settled) forget time.

        ``since_ms``: when this worker started listening (got its partitions, recovered its tables). Silence is
        only counted from then: records that arrived while no worker listened may still be waiting in Kafka.
        """
        if self.settled:
            return int(self.settled["at_ms"] + cfg.late_retention_s * 1000)
        last = max(self.last_ms, since_ms)
        quiet = int(last + cfg.settle_interval_s * 1000)
        if self.ready():
            return quiet
        if self.terminal is not None:
            return max(int(max(self.terminal["at_ms"], since_ms) + cfg.settle_timeout_s * 1000), quiet)
        budget = self.request["timeout_s"] if self.request else cfg.rollout_timeout_s
        return int(last + (budget + cfg.settle_timeout_s) * 1000)

    # ---- records ----------------------------------------------------------------------------------------------
    def _late(self, what: str, now_ms: int) -> Outcome:
        assert self.settled is not None
        return Outcome(
            Verdict.LATE,
            f"late {what}: rollout {self.rollout_id} settled as {self.settled['status']} "
            f"{now_ms - self.settled['at_ms']} ms earlier",
        )

    def _touch(self, now_ms: int) -> Outcome:
        self.last_ms = max(self.last_ms, now_ms)
        return Outcome(Verdict.ACCEPTED)

    @staticmethod
    def _duplicate() -> Outcome:
        return Outcome(Verdict.DUPLICATE)

    def on_call(self, call: CallEvent, now_ms: int) -> Outcome:
        attempt = call.attempt_id
        if self.settled:
            if (
                attempt
                and attempt != self.settled["attempt_id"]
                and self.settled["status"] == TrajectoryStatus.INFRA_FAILURE
            ):
                return self._hold(attempt, call.call_id)  # a re-issue's call before its STARTED reopens the rollout
            known = " (a duplicate of an included call)" if call.call_id in self.call_ids else ""
            return self._late(f"call {call.call_id} seq {call.seq}{known}", now_ms)
        if attempt and self.attempt_id is not None and attempt != self.attempt_id:
            return self._hold(attempt, call.call_id)
        if call.call_id in self.call_ids:
            return self._duplicate()
        self.call_ids.append(call.call_id)
        if attempt and self.attempt_id is None:
            self.call_attempts[call.call_id] = attempt
        return self._touch(now_ms)

    def _hold(self, attempt_id: str, call_id: str) -> Outcome:
        calls = self.held.setdefault(attempt_id, [])
        if call_id in calls:
            return self._duplicate()
        calls.append(call_id)
        return Outcome(Verdict.ACCEPTED)

    def _assemble_attempt(self, attempt_id: str) -> None:
        """``attempt_id`` is now the attempt being assembled: its held calls join, other attempts' calls are held."""
        self.attempt_id = attempt_id
        for cid in [c for c in self.call_ids if self.call_attempts.get(c, attempt_id) != attempt_id]:
            self.call_ids.remove(cid)
            self.held.setdefault(self.call_attempts[cid], []).append(cid)
        self.call_attempts = {}
        self.call_ids += [c for c in self.held.pop(attempt_id, []) if c not in self.call_ids]

    def held_call_ids(self) -> list[str]:
        return [c for calls in self.held.values() for c in calls]

    def on_request(self, req: RolloutRequest, now_ms: int) -> Outcome:
        if self.settled and not (
            self.settled["status"] == TrajectoryStatus.INFRA_FAILURE and req.attempt > self.attempt
        ):
            return self._late(f"request attempt {req.attempt}", now_ms)
        if self.request is not None and self.request["attempt"] >= req.attempt:
            return self._duplicate()
        self.request = {
            "task_id": req.task_id,
            "step": req.step,
            "group_id": req.group_id,
            "harness": req.harness,
            "suite": req.suite,
            "timeout_s": req.timeout_s,
            "eval": req.eval,
            "metadata": dict(req.metadata),
            "attempt": req.attempt,
        }
        return Outcome(Verdict.ACCEPTED) if self.settled else self._touch(now_ms)

    def on_event(self, ev: RolloutEvent, now_ms: int) -> Outcome:
        if self.settled:
            if (
                ev.state is RolloutState.STARTED
                and ev.attempt_id != self.settled["attempt_id"]
                and self.settled["status"] == TrajectoryStatus.INFRA_FAILURE
            ):
                self._reopen(now_ms)
            else:
                return self._late(f"lifecycle {ev.state.value} of attempt {ev.attempt_id}", now_ms)
        if self.attempt_id is not None and ev.attempt_id != self.attempt_id:
            # A re-issue (higher attempt number), or a re-run of the same request after its worker died mid-rollout
            # (same number, new attempt id: Kafka cannot count redeliveries) while the current attempt never ended.
            rerun = ev.attempt == self.attempt and self.terminal is None
            if ev.state is RolloutState.STARTED and (ev.attempt > self.attempt or rerun):
                return Outcome(Verdict.SUPERSEDES, f"attempt {ev.attempt} ({ev.attempt_id}) started")
            return Outcome(
                Verdict.REJECTED,
                f"lifecycle {ev.state.value} of attempt {ev.attempt_id}, but rollout "
                f"{self.rollout_id} is assembling attempt {self.attempt_id}",
            )
        current = self.state
        if ev.state is current or (ev.state is RolloutState.STARTED and self.started):
            return self._duplicate()
        lenient = current is None and ev.state in TERMINAL  # STARTED may be lost; the terminal event says enough
        if not (lenient or can_transition(current, ev.state)):
            return Outcome(
                Verdict.REJECTED,
                f"lifecycle {current.value if current else 'start'} → {ev.state.value} "
                "is not allowed (schemas/lifecycle.py)",
            )
        self.attempt = ev.attempt
        if ev.attempt_id != self.attempt_id:
            self._assemble_attempt(ev.attempt_id)
        info = {
            "attempt_id": ev.attempt_id,
            "harness": ev.harness,
            "group_id": ev.group_id,
            "policy_version": ev.policy_version,
        }
        if ev.state is RolloutState.STARTED:
            self.started = info
        else:
            served = ev.calls_served
            if served is None and self.terminal is not None:  # HARNESS_EXITED → FAILED keeps the sealed count
                served = self.terminal.get("calls_served")
            self.terminal = {
                **info,
                "state": ev.state.value,
                "calls_served": served,
                "reason": ev.reason,
                "exit_code": ev.exit_code,
                "at_ms": now_ms,
            }
        return self._touch(now_ms)

    def on_reward(self, rew: RewardEvent, now_ms: int) -> Outcome:
        if self.settled:
            return self._late(f"reward of attempt {rew.attempt_id}", now_ms)
        if self.reward is not None:
            same = (self.reward["attempt_id"], self.reward["status"], self.reward["reward"])
            if same == (rew.attempt_id, rew.status.value, rew.reward):
                return self._duplicate()
            return Outcome(
                Verdict.REJECTED,
                f"second, different reward for attempt {rew.attempt_id} of rollout "
                f"{self.rollout_id} (first: {self.reward['status']} "
                f"{self.reward['reward']})",
            )
        if self.attempt_id is not None and rew.attempt_id != self.attempt_id:
            return Outcome(
                Verdict.REJECTED,
                f"reward of attempt {rew.attempt_id}, but rollout {self.rollout_id} "
                f"is assembling attempt {self.attempt_id}",
            )
        if rew.attempt_id != self.attempt_id:
            self._assemble_attempt(rew.attempt_id)
        self.reward = {
            "attempt_id": rew.attempt_id,
            "status": rew.status.value,
            "reward": rew.reward,
            "reason": rew.reason,
            "grader": rew.grader,
        }
        return self._touch(now_ms)

    def _reopen(self, now_ms: int) -> None:
        """A re-issued attempt starts after an infrastructure failure: forget the failed attempt (not the request)."""
        log.info("rollout %s reopened for a new attempt after %s", self.rollout_id, self.settled)
        fresh = RolloutAccumulator(self.rollout_id, now_ms, now_ms, request=self.request, held=self.held)
        self.__dict__.update(fresh.__dict__)

    # ---- settling ---------------------------------------------------------------------------------------------
    def due(self, now_ms: int, cfg: StreamsSettings, since_ms: int = 0) -> bool:
        """True when the rollout should settle now (ready and quiet, or given up)."""
        return self.settled is None and now_ms >= self.deadline_ms(cfg, since_ms)

    def mark_settled(self, status: TrajectoryStatus, now_ms: int) -> None:
        self.settled = {"status": status.value, "at_ms": now_ms, "attempt_id": self.attempt_id}


def _classify(acc: RolloutAccumulator, forced: str | None) -> tuple[TrajectoryStatus, float | None, str | None]:
    """(status, reward, drop_reason) before the tree is built; ``forced`` = why it settles though not ready."""
    reward = acc.reward["reward"] if acc.reward and acc.reward["status"] == RewardStatus.OK else None
    if acc.infra:
        if acc.state is RolloutState.FAILED:
            why = acc.terminal["reason"] if acc.terminal else None
        else:
            why = acc.reward["reason"] if acc.reward else None
        return TrajectoryStatus.INFRA_FAILURE, None, f"infrastructure failure: {why or 'no reason given'}"
    if forced is not None:
        return TrajectoryStatus.INCOMPLETE, reward, forced
    if acc.reward is not None and acc.reward["status"] == RewardStatus.UNGRADED:
        return TrajectoryStatus.DROPPED, None, f"ungraded: {acc.reward['reason'] or acc.reward['grader']}"
    if acc.state is RolloutState.TIMED_OUT:
        return TrajectoryStatus.TIMED_OUT, reward, None
    return TrajectoryStatus.COMPLETE, reward, None


def tree_calls(calls: Sequence[CallEvent]) -> list[TreeCall]:
    return [
        TreeCall(
            call_id=c.call_id,
            seq=c.seq,
            parent_call_id=c.parent_call_id,
            shared_prefix_len=c.shared_prefix_len,
            new_tokens=c.new_tokens.tolist(),
            generated_tokens=c.generated_tokens.tolist(),
            logprobs=c.logprobs.tolist(),
            call_kind=c.call_kind.value,
            policy_version=c.policy_version,
            finish_reason=c.finish_reason,
        )
        for c in calls
    ]


def _sampling_of(call: CallEvent | None) -> dict[str, Any]:
    """A trainable segment (one call's generation) carries its call's sampling settings, for the learner."""
    if call is None:
        return {}
    return {"temperature": call.temperature, "top_p": call.top_p, "top_k": call.top_k}


def build_trajectory(
    acc: RolloutAccumulator, calls: Sequence[CallEvent], now_ms: int, cfg: StreamsSettings, *, forced: str | None = None
) -> Trajectory:
    """The rollout's Trajectory (pure). ``forced``: the reason it settles although not ready (→ INCOMPLETE)."""
    status, reward, drop_reason = _classify(acc, forced)
    info = acc.terminal or acc.started or {}
    req = acc.request or {}
    group_id = req.get("group_id") or info.get("group_id") or ""
    task_id, step = (req["task_id"], req["step"]) if req else split_group_id(group_id)
    metadata = dict(req.get("metadata", {}))
    if req:
        metadata.setdefault("suite", req["suite"])
        metadata.setdefault("eval", "true" if req["eval"] else "false")
        metadata.setdefault("attempt", str(req.get("attempt", 0)))
    segments: list[TreeSegment] = []
    stats = {"leaves": 0, "unique_tokens": 0, "path_tokens": 0, "prefix_reuse_ratio": 1.0}
    excluded: dict[str, int] = {}
    versions = [c.policy_version for c in calls] or [info.get("policy_version", 0)]
    policy_version = min(versions)
    if status in TRAINABLE_STATUSES:
        try:
            tree = build_tree(tree_calls(calls), max_leaves=cfg.max_leaves, prune=cfg.prune)
        except TreeError as exc:
            status, drop_reason = TrajectoryStatus.DROPPED, f"inconsistent calls: {exc}"
        else:
            excluded = dict(tree.excluded_calls)
            st = tree.stats
            stats = {
                "leaves": st.leaves,
                "unique_tokens": st.unique_tokens,
                "path_tokens": st.path_tokens,
                "prefix_reuse_ratio": st.prefix_reuse_ratio,
            }
            if st.min_policy_version is not None:
                policy_version = st.min_policy_version
            if tree.dropped_reason is not None:
                status, drop_reason = TrajectoryStatus.DROPPED, tree.dropped_reason
            else:
                by_call = {c.call_id: c for c in calls}
                segments = [
                    TreeSegment(
                        parent=s.parent,
                        tokens=np.asarray(s.tokens, dtype="<i4"),
                        trainable=s.trainable,
                        logprobs=np.asarray(s.logprobs, dtype="<f4"),
                        policy_version=s.policy_version,
                        call_id=s.call_id,
                        **(_sampling_of(by_call.get(s.call_id)) if s.trainable else {}),
                    )
                    for s in tree.segments
                ]
    return Trajectory(
        rollout_id=acc.rollout_id,
        policy_version=policy_version,
        timestamp_ms=now_ms,
        attempt_id=acc.attempt_id or "",
        group_id=group_id,
        task_id=task_id,
        harness=req.get("harness") or info.get("harness") or "",
        step=step,
        status=status,
        segments=segments,
        calls=len(calls),
        reward=reward,
        drop_reason=drop_reason,
        excluded_calls=excluded,
        metadata=metadata,
        **stats,
    )


@dataclass
class Result:
    """What one record or tick produced: trajectories to emit and, for a rejected record, why."""

    trajectories: list[Trajectory] = field(default_factory=list)
    rejected: Outcome | None = None


def call_key(rollout_id: str, call_id: str) -> str:
    return f"{rollout_id}\x00{call_id}"


class Assembler:
    """The assembler over three key → bytes maps (Faust tables in the app, dicts in tests); pure."""

    def __init__(
        self,
        cfg: StreamsSettings,
        state: MutableMapping[str, bytes],
        calls: MutableMapping[str, bytes],
        index: MutableMapping[str, bytes],
    ) -> None:
        self.cfg, self.state, self.calls, self.index = cfg, state, calls, index
        self.deadlines = Deadlines(state, index)

    def _load(self, rollout_id: str, now_ms: int) -> RolloutAccumulator:
        data = self.state.get(rollout_id)
        return RolloutAccumulator.from_bytes(data) if data else RolloutAccumulator(rollout_id, now_ms, now_ms)

    def _save(self, acc: RolloutAccumulator, partition: int) -> None:
        self.state[acc.rollout_id] = acc.to_bytes()
        self.deadlines.schedule(partition, acc.rollout_id, acc.deadline_ms(self.cfg))

    def on_record(self, event: Event, raw: bytes, partition: int, now_ms: int) -> Result:
        """Apply one decoded record (call, lifecycle event, reward or request) of ``partition``."""
        acc = self._load(event.rollout_id, now_ms)  # type: ignore[arg-type]
        result = Result()
        outcome = self._apply(acc, event, now_ms)
        if outcome.verdict is Verdict.SUPERSEDES:  # settle the old attempt as an infra failure, then start the new
            result.trajectories.append(self._settle(acc, now_ms, forced=None, superseded=outcome.reason))
            outcome = self._apply(acc, event, now_ms)
        if outcome.verdict is Verdict.ACCEPTED:
            if isinstance(event, CallEvent):
                self.calls[call_key(acc.rollout_id, event.call_id)] = raw
            self._save(acc, partition)
        elif outcome.verdict is Verdict.DUPLICATE:
            log.debug("rollout %s: duplicate %s ignored", acc.rollout_id, type(event).__name__)
        else:
            result.rejected = outcome
            if result.trajectories:
                self._save(acc, partition)
        return result

    @staticmethod
    def _apply(acc: RolloutAccumulator, event: Event, now_ms: int) -> Outcome:
        if isinstance(event, CallEvent):
            return acc.on_call(event, now_ms)
        if isinstance(event, RolloutEvent):
            return acc.on_event(event, now_ms)
        if isinstance(event, RewardEvent):
            return acc.on_reward(event, now_ms)
        if isinstance(event, RolloutRequest):
            return acc.on_request(event, now_ms)
        return Outcome(Verdict.REJECTED, f"the assembler does not take {type(event).__name__} records")

    def _settle(
        self, acc: RolloutAccumulator, now_ms: int, *, forced: str | None, superseded: str | None = None
    ) -> Trajectory:
        calls = []
        for cid in acc.call_ids:
            data = self.calls.pop(call_key(acc.rollout_id, cid), None)
            if data is not None:
                calls.append(CallEvent.from_bytes(data))
        if superseded is not None:  # a newer attempt started: whatever this one was, it did not finish properly
            acc.terminal = {
                **(acc.terminal or acc.started or {}),
                "state": RolloutState.FAILED.value,
                "reason": f"superseded: {superseded}",
                "at_ms": now_ms,
            }
        trajectory = build_trajectory(acc, calls, now_ms, self.cfg, forced=forced)
        acc.mark_settled(trajectory.status, now_ms)
        return trajectory

    def on_tick(self, partition: int, now_ms: int, since_ms: int = 0) -> Result:
        """Settle the partition's due rollouts and forget settled ones past ``late_retention_s``.

        ``since_ms``: when this worker started listening to the partition (see :meth:`RolloutAccumulator.deadline_ms`).
        """
        result = Result()

        def visit(rollout_id: str, data: bytes) -> int | None:
            acc = RolloutAccumulator.from_bytes(data)
            if acc.settled is not None and now_ms >= acc.deadline_ms(self.cfg):
                for cid in acc.held_call_ids():  # calls of an attempt that never started
                    self.calls.pop(call_key(rollout_id, cid), None)
                return None  # settled long enough ago that no late record is expected: forget it
            if acc.due(now_ms, self.cfg, since_ms):
                forced = None if acc.ready() else f"settle timeout: {acc.missing()}"
                result.trajectories.append(self._settle(acc, now_ms, forced=forced))
                self.state[rollout_id] = acc.to_bytes()
            return acc.deadline_ms(self.cfg, since_ms)

        self.deadlines.tick(partition, now_ms, visit)
        return result
