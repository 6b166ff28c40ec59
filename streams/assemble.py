"""Assembler: a rollout's calls, lifecycle events, reward (and request) → one settled :class:`Trajectory`.

Topics in: ``clawstream.calls``, ``clawstream.rollout.events``, ``clawstream.rewards``, ``clawstream.rollout.requests``
(all keyed by rollout id, co-partitioned) and the app's own tick topic. Out: ``clawstream.trajectories`` (key =
rollout id) and ``clawstream.deadletter`` (rejected and late records). The Faust agent lives in ``streams.app``
(run ``python -m streams.app worker``); this module is the pure core: no Kafka, no Faust.

Parts: ``streams.rollout`` (one rollout's accumulator: the settle rule, what each record does), ``streams.trajectory``
(the settled rollout's Trajectory: status, tree), and here the :class:`Assembler`, which applies records and ticks to
the stored accumulators.

State layout (three key → bytes maps, Faust tables in the app, dicts in tests): ``state[rollout_id]`` the JSON
:class:`RolloutAccumulator` (once a settled one's retention is over, its tombstone: ``streams.rollout``),
``calls[rollout_id + NUL + call_id]`` the call's original Avro bytes (so a call is written once, not re-written with
every update), ``index[str(partition)]`` a :class:`streams.state.DueIndex` of the
partition's rollouts → the earliest time each may need attention (a lower bound; a tick re-checks and moves it, see
:class:`streams.state.Deadlines`).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field

from schemas.events import CallEvent, Event, RewardEvent, RolloutEvent, RolloutRequest, RolloutState, Trajectory
from streams.rollout import RolloutAccumulator
from streams.settings import StreamsSettings
from streams.state import Deadlines, Outcome, Verdict
from streams.trajectory import build_trajectory

log = logging.getLogger(__name__)
CALLS_HOLD_TIMEOUTS = 4  # a rollout short of calls waits for its unread calls partition at most this many more timeouts

Assembled = CallEvent | RolloutEvent | RewardEvent | RolloutRequest  # the records the assembler takes
ASSEMBLED = (CallEvent, RolloutEvent, RewardEvent, RolloutRequest)


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
        return (
            RolloutAccumulator.from_stored(rollout_id, data) if data else RolloutAccumulator(rollout_id, now_ms, now_ms)
        )

    def _save(self, acc: RolloutAccumulator, partition: int) -> None:
        self.state[acc.rollout_id] = acc.to_bytes()
        self.deadlines.schedule(partition, acc.rollout_id, acc.deadline_ms(self.cfg))

    def on_record(self, event: Event, raw: bytes, partition: int, now_ms: int, calls_end: int | None = None) -> Result:
        """Apply one decoded record (call, lifecycle event, reward or request) of ``partition``.

        ``calls_end``: for a lifecycle event, the end offset of the calls partition ``partition`` as the worker knows it
        now (None: unknown); kept with a terminal event, it tells :meth:`on_tick` whether the run's calls may still be
        unread."""
        if not isinstance(event, ASSEMBLED):
            return Result(
                rejected=Outcome(Verdict.REJECTED, f"the assembler does not take {type(event).__name__} records")
            )
        acc = self._load(event.rollout_id, now_ms)
        result = Result()
        outcome = self._apply(acc, event, now_ms)
        if outcome.verdict is Verdict.SUPERSEDES:  # settle the old attempt as an infra failure, then start the new
            result.trajectories.append(self._settle(acc, now_ms, forced=None, superseded=outcome.reason))
            outcome = self._apply(acc, event, now_ms)
        elif outcome.verdict is Verdict.OLDER_RUN:  # the older run ended: settled apart, the newer one goes on
            assert isinstance(event, RolloutEvent)
            older = acc.older_run(event)
            result.trajectories.append(self._settle(older, now_ms, forced=None, superseded=outcome.reason))
            self._save(acc, partition)
            return result
        if outcome.verdict is Verdict.ACCEPTED:
            if isinstance(event, CallEvent):
                self.calls[call_key(acc.rollout_id, event.call_id)] = raw
            elif isinstance(event, RolloutEvent) and acc.terminal is not None:
                acc.calls_end = calls_end
            self._save(acc, partition)
        elif outcome.verdict is Verdict.DUPLICATE:
            log.debug("rollout %s: duplicate %s ignored", acc.rollout_id, type(event).__name__)
        else:
            result.rejected = outcome
            if result.trajectories:
                self._save(acc, partition)
        return result

    @staticmethod
    def _apply(acc: RolloutAccumulator, event: Assembled, now_ms: int) -> Outcome:
        if isinstance(event, CallEvent):
            return acc.on_call(event, now_ms)
        if isinstance(event, RolloutEvent):
            return acc.on_event(event, now_ms)
        if isinstance(event, RewardEvent):
            return acc.on_reward(event, now_ms)
        return acc.on_request(event, now_ms)

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

    def on_tick(self, partition: int, now_ms: int, since_ms: int = 0, calls_read: int | None = None) -> Result:
        """Settle the partition's due rollouts and compact settled ones past ``late_retention_s`` to their tombstones.

        ``since_ms``: when this worker started listening to the partition (see :meth:`RolloutAccumulator.deadline_ms`).
        ``calls_read``: the next offset of the calls partition this worker will read (None: unknown). A rollout short
        of calls is not given up while its calls may still be unread (a worker catching up on a backlog after a
        rebalance reads the small lifecycle records long before the calls): the settle timeout bounds silence, not
        a backlog. Held at most ``CALLS_HOLD_TIMEOUTS`` more settle timeouts, in case the partition never advances.
        """
        result = Result()

        def visit(rollout_id: str, data: bytes) -> int | bytes | None:
            acc = RolloutAccumulator.from_stored(rollout_id, data)
            if acc.settled is not None and now_ms >= acc.deadline_ms(self.cfg):
                for cid in acc.held_call_ids():  # calls of an attempt that never started
                    self.calls.pop(call_key(rollout_id, cid), None)
                return acc.tombstone()  # kept for good: a replay at any later time is late, never a new rollout
            if acc.due(now_ms, self.cfg, since_ms):
                unread = 0 if acc.ready() else acc.calls_unread(calls_read)
                hold_ms = CALLS_HOLD_TIMEOUTS * self.cfg.settle_timeout_s * 1000
                hold_until = acc.deadline_ms(self.cfg, since_ms) + hold_ms
                if unread and now_ms < hold_until:
                    return now_ms + int(self.cfg.tick_interval_s * 1000)  # look again next tick
                behind = f" (its calls partition still {unread} offsets behind)" if unread else ""
                forced = None if acc.ready() else f"settle timeout: {acc.missing()}{behind}"
                result.trajectories.append(self._settle(acc, now_ms, forced=forced))
                self.state[rollout_id] = acc.to_bytes()
            return acc.deadline_ms(self.cfg, since_ms)

        self.deadlines.tick(partition, now_ms, visit)
        return result
