"""One rollout's accumulator: what its calls, lifecycle events, reward and request say, and when it settles.

Settle rule. A rollout is *ready* when it is an infrastructure failure (terminal FAILED, or a reward with status
INFRA_FAILURE) or when its terminal lifecycle event (HARNESS_EXITED / TIMED_OUT with ``calls_served``), exactly
``calls_served`` distinct calls and its reward are all in. A ready rollout settles once no new record of it arrived for
``settle_interval_s`` (docs/method.md#settling). A rollout that is not ready settles INCOMPLETE (``drop_reason``: what
is missing) ``settle_timeout_s`` after its terminal event, or — when the terminal event never came — after
``timeout_s`` of its request (``rollout_timeout_s`` if unknown) plus ``settle_timeout_s`` of silence; one seen only by
its request (still queued) first waits until the request's ``deadline_ms``, else ``rollout_timeout_s``. Times are
processing times (persisted in the state, so a restarted worker keeps the deadlines), and silence only counts from
when the worker started listening (its last completed rebalance): records that arrived meanwhile may still wait in
Kafka, so no rollout is given up before the worker itself waited the full interval.

Records. Duplicates (same call id, same lifecycle state, same reward) are ignored. A record of a settled rollout is
*late* (dead-lettered with the reason) — except the STARTED event of a re-issued attempt after an infrastructure
failure, which reopens the rollout (a STARTED of a newer attempt also supersedes an unsettled attempt, which then
settles as INFRA_FAILURE first). Calls and rewards carry their attempt id: one of another attempt than the one being
assembled is held apart (a re-issue's or re-run's records that arrive before its STARTED event: topics are not ordered
with each other) and joins when its attempt becomes the assembled one, so a superseded attempt's trajectory holds
exactly its own calls (an older run's STARTED read after the newer run's records settles apart, superseded). Held
records of an attempt that never starts are dropped. Calls without an attempt id (older records) count for whichever
attempt is assembled. Lifecycle moves that ``schemas.lifecycle`` forbids are rejected (a terminal event without
STARTED is accepted: STARTED may be lost). Replays: ``late_retention_s`` after it settled, a rollout is compacted to
a tombstone (:meth:`RolloutAccumulator.tombstone`) that is kept, so a record replayed at any later time is late, and
an attempt that settled never reopens it. Pure: no Kafka, no Faust; used by ``streams.assemble``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from schemas.events import (
    CallEvent,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    TrajectoryStatus,
)
from schemas.lifecycle import can_transition
from streams.settings import StreamsSettings
from streams.state import TOMBSTONE, Outcome, Verdict, is_tombstone

log = logging.getLogger(__name__)

TERMINAL = frozenset({RolloutState.HARNESS_EXITED, RolloutState.TIMED_OUT, RolloutState.FAILED})


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
    held_rewards: dict[str, dict[str, Any]] = field(default_factory=dict)  # attempt id → its reward, the same way
    held_reward_ms: dict[str, int] = field(default_factory=dict)  # attempt id → its held reward's timestamp_ms
    attempt_first_ms: int | None = None  # earliest event time (timestamp_ms) of the assembled attempt's records
    # Attempts of the request settled apart (an older run, OLDER_RUN) or settled before a re-issue reopened the rollout:
    # a replay of their STARTED is a duplicate and never reopens or supersedes.
    older_runs: list[str] = field(default_factory=list)
    # The calls partition's end offset when the terminal event was read: every call of the run is below it (the proxy
    # publishes a call before it answers, the worker its terminal event after the harness ended).
    calls_end: int | None = None

    # ---- serialisation ----------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        # Fields hold plain JSON values: dump them as they are (dataclasses.asdict deep-copies, half the core time).
        return json.dumps(self.__dict__, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutAccumulator:
        return cls(**json.loads(data))

    @classmethod
    def from_stored(cls, rollout_id: str, data: bytes) -> RolloutAccumulator:
        """The accumulator from its stored bytes: its JSON, or a tombstone expanded into a settled accumulator."""
        if not is_tombstone(data):
            return cls.from_bytes(data)
        status, at_ms, *infra = json.loads(data[1:])
        acc = cls(rollout_id, at_ms, at_ms, settled={"status": status, "at_ms": at_ms, "attempt_id": None})
        if infra:
            acc.attempt_id, acc.attempt, acc.older_runs, acc.request = infra
            acc.settled["attempt_id"] = acc.attempt_id  # type: ignore[index]
        return acc

    def tombstone(self) -> bytes:
        """The settled rollout compacted to what a replay needs: its status and settle time (~30 bytes); after an
        infrastructure failure, which a re-issue may reopen, also its attempt, the settled attempts and the request."""
        assert self.settled is not None
        keep: list[Any] = [self.settled["status"], self.settled["at_ms"]]
        if self.settled["status"] == TrajectoryStatus.INFRA_FAILURE:
            keep += [self.settled["attempt_id"], self.attempt, self.older_runs, self.request]
        return TOMBSTONE + json.dumps(keep, separators=(",", ":")).encode()

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
        if self.settled:  # compacted to its tombstone then; a held re-issue record keeps it whole a while longer
            return int(max(self.settled["at_ms"], self.last_ms) + cfg.late_retention_s * 1000)
        last = max(self.last_ms, since_ms)
        quiet = int(last + cfg.settle_interval_s * 1000)
        if self.ready():
            return quiet
        if self.terminal is not None:
            return max(int(max(self.terminal["at_ms"], since_ms) + cfg.settle_timeout_s * 1000), quiet)
        budget = self.request["timeout_s"] if self.request else cfg.rollout_timeout_s
        if self.request is not None and self.started is None and not (self.call_ids or self.held or self.reward):
            # Only its request: it may wait in the requests topic for a free sandbox slot, and its own timeout
            # starts at STARTED. Giving up from the request's arrival sealed queued rollouts INCOMPLETE before they
            # ran (13 of 36 solved demonstrations of a 64-request recording, at 2 at a time) and dead-lettered their
            # calls and reward as late. The wait is bounded by the request's deadline (no worker starts it after),
            # else by rollout_timeout_s.
            queued = self.request.get("deadline_ms") or int(last + cfg.rollout_timeout_s * 1000)
            return int(max(queued, last) + (budget + cfg.settle_timeout_s) * 1000)
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
                self.last_ms = max(self.last_ms, now_ms)  # kept whole (not a tombstone) while it holds records
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
        self.attempt_first_ms = None
        if attempt_id in self.held_rewards and self.reward is None:
            self.reward = self.held_rewards.pop(attempt_id)
            self._saw(self.held_reward_ms.pop(attempt_id, None))

    def _saw(self, timestamp_ms: int | None) -> None:
        if timestamp_ms is not None and (self.attempt_first_ms is None or timestamp_ms < self.attempt_first_ms):
            self.attempt_first_ms = timestamp_ms

    def held_call_ids(self) -> list[str]:
        return [c for calls in self.held.values() for c in calls]

    def on_request(self, req: RolloutRequest, now_ms: int) -> Outcome:
        if self.settled and not (
            self.settled["status"] == TrajectoryStatus.INFRA_FAILURE and req.attempt > self.attempt
        ):
            return self._late(f"request attempt {req.attempt}", now_ms)
        if self.settled:
            self.last_ms = max(self.last_ms, now_ms)
        if self.request is not None and self.request["attempt"] >= req.attempt:
            return self._duplicate()
        self.request = {
            "task_id": req.task_id,
            "step": req.step,
            "group_id": req.group_id,
            "harness": req.harness,
            "suite": req.suite,
            "timeout_s": req.timeout_s,
            "deadline_ms": req.deadline_ms,
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
                and ev.attempt_id not in self.older_runs
                and self.settled["status"] == TrajectoryStatus.INFRA_FAILURE
            ):
                self._reopen(now_ms)
            else:
                return self._late(f"lifecycle {ev.state.value} of attempt {ev.attempt_id}", now_ms)
        if self.attempt_id is not None and ev.attempt_id != self.attempt_id:
            if ev.attempt_id in self.older_runs:
                return self._duplicate()
            if ev.state is RolloutState.STARTED and ev.attempt == self.attempt and self.attempt_first_ms is not None:
                if ev.timestamp_ms < self.attempt_first_ms:  # the assembled run began after this one (topics are
                    # not ordered with each other: its reward was read first): this older run ended, settled apart
                    return Outcome(Verdict.OLDER_RUN, f"attempt {self.attempt_id} of the same request ran after it")
            # A re-issue (higher attempt number), or a re-run of the same request after its worker died mid-rollout
            # (same number, new attempt id: Kafka cannot count redeliveries) while the current attempt has no reward
            # yet: it never ended, or its worker died grading it (HARNESS_EXITED out, the reward never sent). Were
            # that reward sent and only unread, superseding still trains exactly one of the two runs (rule 2 of
            # consumers.analytics.reconcile); waiting for it would hold the group until its timeout instead.
            rerun = ev.attempt == self.attempt and (self.terminal is None or self.reward is None)
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
        self._saw(ev.timestamp_ms)
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
            reissue = rew.attempt_id != self.settled["attempt_id"]
            if reissue and self.settled["status"] == TrajectoryStatus.INFRA_FAILURE:
                self.last_ms = max(self.last_ms, now_ms)
                return self._hold_reward(rew, now_ms)  # a re-issue's reward before its STARTED reopens the rollout
            return self._late(f"reward of attempt {rew.attempt_id}", now_ms)
        if self.attempt_id is not None and rew.attempt_id != self.attempt_id:
            # Topics are not ordered with each other: a re-run's or re-issue's reward may come before the STARTED
            # that makes its attempt the assembled one (seen after a streams restart caught up on a backlog), also
            # while the assembled attempt holds a reward of its own (an infrastructure failure not settled yet: its
            # re-issue ran at once). Held like its calls; it joins if that attempt is assembled, and is forgotten with
            # the rollout otherwise.
            return self._hold_reward(rew, now_ms)
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
        if rew.attempt_id != self.attempt_id:
            self._assemble_attempt(rew.attempt_id)
        self.reward = self._reward_fields(rew)
        self._saw(rew.timestamp_ms)
        return self._touch(now_ms)

    def older_run(self, ev: RolloutEvent) -> RolloutAccumulator:
        """The accumulator of ``ev``'s run, older than the assembled one (verdict OLDER_RUN): its STARTED and its
        held calls, to be settled apart as superseded; remembered, so a replay of ``ev`` is a duplicate."""
        self.older_runs.append(ev.attempt_id)
        info = {"attempt_id": ev.attempt_id, "harness": ev.harness, "group_id": ev.group_id}
        return RolloutAccumulator(
            self.rollout_id,
            self.first_ms,
            self.last_ms,
            call_ids=self.held.pop(ev.attempt_id, []),
            attempt=ev.attempt,
            attempt_id=ev.attempt_id,
            started={**info, "policy_version": ev.policy_version},
            request=self.request,
        )

    @staticmethod
    def _reward_fields(rew: RewardEvent) -> dict[str, Any]:
        return {
            "attempt_id": rew.attempt_id,
            "status": rew.status.value,
            "reward": rew.reward,
            "reason": rew.reason,
            "grader": rew.grader,
        }

    def _hold_reward(self, rew: RewardEvent, now_ms: int) -> Outcome:
        fields = self._reward_fields(rew)
        known = self.held_rewards.get(rew.attempt_id)
        if known is not None:
            if known == fields:
                return self._duplicate()
            return Outcome(
                Verdict.REJECTED,
                f"second, different reward for attempt {rew.attempt_id} of rollout {self.rollout_id} (first: "
                f"{known['status']} {known['reward']})",
            )
        self.held_rewards[rew.attempt_id] = fields
        self.held_reward_ms[rew.attempt_id] = rew.timestamp_ms
        return Outcome(Verdict.ACCEPTED) if self.settled else self._touch(now_ms)

    def _reopen(self, now_ms: int) -> None:
        """A re-issued attempt starts after an infrastructure failure: forget the failed attempt (not the request)."""
        assert self.settled is not None
        log.info("rollout %s reopened for a new attempt after %s", self.rollout_id, self.settled)
        fresh = RolloutAccumulator(
            self.rollout_id,
            now_ms,
            now_ms,
            request=self.request,
            held=self.held,
            held_rewards=self.held_rewards,
            held_reward_ms=self.held_reward_ms,
            older_runs=[*self.older_runs, *([self.settled["attempt_id"]] if self.settled["attempt_id"] else [])],
        )
        self.__dict__.update(fresh.__dict__)

    # ---- settling ---------------------------------------------------------------------------------------------
    def calls_unread(self, calls_read: int | None) -> int:
        """How many offsets of its calls partition the worker has yet to read before all of this run's calls are in
        (0 when unknown: ``calls_read`` is None after a rebalance until the partition's next call is read)."""
        if self.calls_end is None or calls_read is None or self.sealed:
            return 0
        return max(0, self.calls_end - calls_read)

    def due(self, now_ms: int, cfg: StreamsSettings, since_ms: int = 0) -> bool:
        """True when the rollout should settle now (ready and quiet, or given up)."""
        return self.settled is None and now_ms >= self.deadline_ms(cfg, since_ms)

    def mark_settled(self, status: TrajectoryStatus, now_ms: int) -> None:
        self.settled = {"status": status.value, "at_ms": now_ms, "attempt_id": self.attempt_id}
