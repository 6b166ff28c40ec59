"""Capture health over many rollouts: rows per (harness, template), the streaming aggregator, and the text table.

``HealthAggregator`` takes events in any order (calls, rollout events, requests, trajectories, rewards), keeps each
rollout's calls (without logprobs) and recomputes a rollout's counts (``consumers.analytics.health.rollout_health``)
only after one of its records arrived; ``health_rows`` sums rollouts into one ``HealthRow`` per (harness, template)
plus an ``(all)`` row; ``format_rows`` prints the table of ``clawstream health``. The template is the rollout request's
``metadata["chat_template"]`` when the scheduler set one, else the API dialect the harness spoke. Definitions of every
figure: docs/dashboard.md#capture-health. Pure: no Kafka client; used by ``consumers.analytics.dashboard``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from consumers.analytics.health import UNKNOWN, RolloutHealth, TrajectoryFacts, rollout_health
from schemas.events import (
    CallEvent,
    CallKind,
    Event,
    RewardEvent,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
)

ALL = "(all)"
_NO_LOGPROBS = np.zeros(0, dtype="<f4")


@dataclass
class HealthRow:
    """Capture health of every rollout of one (harness, template); rates are None when nothing was measured."""

    harness: str
    template: str
    rollouts: int = 0
    calls: int = 0
    main_calls: int = 0
    follow_ups: int = 0
    extends: int = 0
    forks: int = 0
    answer_forks: int = 0
    roots: int = 0
    restarts: int = 0
    full_renders: int = 0
    retry_orphans: int = 0
    stale_attempt_calls: int = 0
    unresolved_calls: int = 0
    tampered_rollouts: int = 0  # rollouts with a tampered call (never trained: the streams drop them)
    tampered_calls: int = 0
    grader_error_rollouts: int = 0  # rollouts graded 0 because the grader failed on what they left in the workspace
    generated_tokens: int = 0
    trajectories: int = 0  # rollouts whose trajectory carries a tree (the masked fraction's rollouts)
    tree_generated_tokens: int = 0
    masked_tokens: int = 0
    cache_prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, r: RolloutHealth) -> None:
        self.rollouts += 1
        self.tampered_rollouts += r.tampered_calls > 0
        self.grader_error_rollouts += r.grader_error_by_rollout
        for name in (
            "calls",
            "main_calls",
            "follow_ups",
            "extends",
            "forks",
            "answer_forks",
            "roots",
            "restarts",
            "full_renders",
            "retry_orphans",
            "stale_attempt_calls",
            "unresolved_calls",
            "tampered_calls",
            "generated_tokens",
            "cache_prompt_tokens",
            "cached_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(r, name))
        if r.masked_tokens is not None:
            self.trajectories += 1
            self.tree_generated_tokens += r.generated_tokens
            self.masked_tokens += r.masked_tokens

    @property
    def extends_share(self) -> float | None:
        return self.extends / self.follow_ups if self.follow_ups else None

    @property
    def full_renders_per_rollout(self) -> float | None:
        return self.full_renders / self.rollouts if self.rollouts else None

    @property
    def forks_per_rollout(self) -> float | None:
        return self.forks / self.rollouts if self.rollouts else None

    @property
    def masked_token_fraction(self) -> float | None:
        return self.masked_tokens / self.tree_generated_tokens if self.tree_generated_tokens else None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.cached_tokens / self.cache_prompt_tokens if self.cache_prompt_tokens else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in (
            "extends_share",
            "full_renders_per_rollout",
            "forks_per_rollout",
            "masked_token_fraction",
            "prefix_cache_hit_rate",
        ):
            out[name] = getattr(self, name)
        return out


def health_rows(rollouts: Iterable[RolloutHealth], *, total: bool = True) -> list[HealthRow]:
    """One row per (harness, template), sorted, plus an ``(all)`` row when there are several."""
    rows: dict[tuple[str, str], HealthRow] = {}
    everything = HealthRow(ALL, ALL)
    for r in rollouts:
        rows.setdefault((r.harness, r.template), HealthRow(r.harness, r.template)).add(r)
        everything.add(r)
    out = [rows[k] for k in sorted(rows)]
    if total and len(out) > 1:
        out.append(everything)
    return out


@dataclass
class _Rollout:
    calls: dict[str, CallEvent] = field(default_factory=dict)
    harness: str | None = None
    chat_template: str | None = None  # from the request's metadata
    started: list[tuple[int, int, str]] = field(default_factory=list)  # (attempt, timestamp, attempt id)
    trajectory: TrajectoryFacts | None = None
    grader_error: bool = False  # a reward of any attempt flagged grader_error_by_rollout
    result: RolloutHealth | None = None  # cached; None when something changed since


class HealthAggregator:
    """Capture health over a stream of events in any order: feed :meth:`add`, read :meth:`rows`.

    Results are cached per rollout and recomputed only after one of its records arrived. ``max_rollouts`` bounds the
    memory of a long-running reader (the dashboard): beyond it the rollouts heard of longest ago are forgotten.
    """

    def __init__(self, max_rollouts: int | None = None) -> None:
        self._rollouts: OrderedDict[str, _Rollout] = OrderedDict()
        self.max_rollouts = max_rollouts

    def _get(self, rollout_id: str) -> _Rollout:
        state = self._rollouts.get(rollout_id)
        if state is None:
            state = self._rollouts[rollout_id] = _Rollout()
            if self.max_rollouts is not None and len(self._rollouts) > self.max_rollouts:
                self._rollouts.popitem(last=False)
        else:
            self._rollouts.move_to_end(rollout_id)
        state.result = None
        return state

    def add(self, event: Event) -> None:
        """Take one event; types other than calls, rollout events, requests, trajectories and rewards are ignored."""
        if isinstance(event, CallEvent):
            # Logprobs are never needed here: drop them (a long rollout's calls are kept until it is forgotten).
            calls = self._get(event.rollout_id).calls
            if event.call_id not in calls:
                calls[event.call_id] = dataclasses.replace(event, logprobs=_NO_LOGPROBS)
        elif isinstance(event, RolloutEvent):
            state = self._get(event.rollout_id)
            state.harness = state.harness or event.harness or None
            if event.state == RolloutState.STARTED:
                state.started.append((event.attempt, event.timestamp_ms, event.attempt_id))
        elif isinstance(event, RolloutRequest):
            state = self._get(event.rollout_id)
            state.harness = event.harness or state.harness
            state.chat_template = event.metadata.get("chat_template") or state.chat_template
        elif isinstance(event, Trajectory):
            state = self._get(event.rollout_id)
            state.harness = state.harness or event.harness or None
            if state.trajectory is None or event.timestamp_ms >= state.trajectory.timestamp_ms:
                state.trajectory = TrajectoryFacts.of(event)
        elif isinstance(event, RewardEvent) and event.grader_error_by_rollout:
            # only flagged rewards: every other one would make a live reader remember each rewarded rollout
            self._get(event.rollout_id).grader_error = True

    def __len__(self) -> int:
        return len(self._rollouts)

    def rollout(self, rollout_id: str) -> RolloutHealth:
        state = self._rollouts[rollout_id]
        if state.result is None:
            state.result = self._compute(rollout_id, state)
        return state.result

    def rollouts(self, *, with_calls_only: bool = True) -> list[RolloutHealth]:
        """Every rollout's counts (by default only rollouts with at least one recorded call)."""
        return [self.rollout(rid) for rid, s in self._rollouts.items() if s.calls or not with_calls_only]

    def rows(self, *, total: bool = True) -> list[HealthRow]:
        return health_rows(self.rollouts(), total=total)

    @staticmethod
    def _compute(rollout_id: str, state: _Rollout) -> RolloutHealth:
        final = state.trajectory.attempt_id if state.trajectory is not None else None
        if final is None and state.started:
            final = max(state.started)[2]
        trajectory = (
            state.trajectory
            if state.trajectory is not None and (final is None or state.trajectory.attempt_id == final)
            else None
        )
        out = rollout_health(rollout_id, state.calls.values(), final_attempt=final, trajectory=trajectory)
        out.harness = state.harness or UNKNOWN
        out.grader_error_by_rollout = state.grader_error
        dialects = Counter(c.dialect.value.lower() for c in state.calls.values() if c.call_kind == CallKind.MAIN)
        dialect = dialects.most_common(1)[0][0] if dialects else UNKNOWN
        out.template = state.chat_template or dialect
        return out


# ---- text ------------------------------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _per(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


COLUMNS = (
    "harness",
    "template",
    "rollouts",
    "main calls",
    "extend exactly",
    "re-renders/rollout",
    "forks/rollout",
    "answer forks",
    "masked tokens",
    "retry orphans",
    "stale attempt",
    "cache hit",
    "tampered",
    "grader error",
)


def format_rows(rows: list[HealthRow]) -> str:
    """A fixed-width table of the rows (what ``clawstream health`` prints)."""
    lines = [list(COLUMNS)]
    for r in rows:
        lines.append(
            [
                r.harness,
                r.template,
                str(r.rollouts),
                str(r.main_calls),
                f"{_pct(r.extends_share)} ({r.extends}/{r.follow_ups})",
                f"{_per(r.full_renders_per_rollout)} ({r.full_renders})",
                f"{_per(r.forks_per_rollout)} ({r.forks})",
                str(r.answer_forks),
                _pct(r.masked_token_fraction),
                str(r.retry_orphans),
                str(r.stale_attempt_calls),
                _pct(r.prefix_cache_hit_rate),
                f"{r.tampered_rollouts} ({r.tampered_calls})",
                str(r.grader_error_rollouts),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    text = [
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    ]
    return "\n".join([text[0], "  ".join("-" * w for w in widths), *text[1:]])
