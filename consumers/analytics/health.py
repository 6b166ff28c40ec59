"""Capture health per harness and chat template: did the proxy record each rollout the way training needs it?

The failures users of other RL-through-harness systems report most are silent: token ids lost when streaming,
false forks when a harness re-templates its history, response masks zeroed after retokenisation. Each leaves a
trace in the recorded events; this module turns the traces into figures (definitions in docs/dashboard.md, the
same words as here). All figures are computed per rollout over the calls of its *final attempt* (the attempt its
trajectory names, else its latest STARTED event, else its latest call); calls without an attempt id count for it.

Per rollout, over its MAIN calls (the only ones trained on) in ``seq`` order, grouped into compaction segments
(a COMPACTION call closes one) — a main call's prompt is rebuilt from the delta encoding
(``parent prompt + parent generated`` cut at ``shared_prefix_len``, then ``new_tokens``):

* **follow-up**: a main call with an earlier main call in its compaction segment. The first main call of the
  rollout is its root; the first after a compaction call is a **restart** (a new, summarised prompt by design).
* Its **tree parent** is the earlier main call whose prompt + generated tokens share the longest token prefix with
  its prompt (ties: one it extends entirely, then the later call) — where the streams' prefix tree attaches it,
  which need not be the ``parent_call_id`` the proxy declared (that one is only a delta base).
* **extends its parent exactly**: the prompt starts with the tree parent's whole prompt + generated tokens (the
  append-only case; TITO held). Share = extends / follow-ups.
* **fork**: the prompt departs strictly inside the tree parent's prompt + generated tokens, so the tree branches.
  An **answer fork** departs inside the parent's *generated* tokens: the model's own answer came back as other
  token ids (lost when streaming, re-encoded after a re-template) — the direct sign of broken TITO.
* **root**: a follow-up sharing no token with any earlier main call (a new tree root).
* **full re-render**: a follow-up the proxy flagged ``full_render`` (its conversation extended none of the recent
  calls' conversations, so it laid the whole conversation out again; OpenClaw re-orders a message every call).
* **retry orphan**: a main call with generated tokens, not the last main call of its compaction segment, whose
  generated tokens appear verbatim in no later main call's prompt of that segment: the harness retried or went on
  without that answer (its tokens become a dead end of the tree).
* **masked-token fraction**: of the generated tokens of the final attempt's main calls, the share the settled
  trajectory does *not* train (1 − trainable tokens / generated tokens; only rollouts whose trajectory carries a
  tree). Dead ends, retries and answers whose ids were lost all count.
* **prefix-cache hit rate**: Σ ``cached_prompt_tokens`` / Σ ``prompt_len`` over the calls (any kind) whose engine
  reported a cached count.
* **stale-attempt calls**: calls recorded under another attempt id than the final one (a re-run superseded them).
* **unresolved calls**: calls whose declared parent is not among the records read (the range cut it off, or it
  belongs to another attempt): their prompt cannot be rebuilt, so they enter no other figure.

Rows are keyed by (harness, template). The template is the rollout request's ``metadata["chat_template"]`` when
the scheduler set one, else the API dialect the harness spoke (``openai_chat``, ``anthropic_messages``,
``openai_responses``): the policy renders every dialect through its one chat template, and the dialect decides
how the harness's history maps onto it.

Input: typed events (``schemas.events``) from ``clawstream.calls``, ``clawstream.rollout.events``,
``clawstream.rollout.requests`` and ``clawstream.trajectories``, in any order. Pure: no Kafka client; the readers
are ``consumers.analytics.dashboard`` (live) and ``clawstream health`` (a topic range).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from schemas.events import (
    CallEvent,
    CallKind,
    Event,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
)

# The proxy's flag on a call whose conversation it laid out again (producers.proxy.render.FULL_RENDER; this layer
# may not import the proxy, and the flag's text is part of the call_event.avsc contract).
FULL_RENDER = "full_render"
UNKNOWN = "?"
ALL = "(all)"
TREE_STATUSES = frozenset({TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT})
_ITEM = np.dtype("<i4").itemsize
_NO_LOGPROBS = np.zeros(0, dtype="<f4")


@dataclass(frozen=True)
class TrajectoryFacts:
    """What capture health needs of a settled trajectory (kept instead of its tree, which can be megabytes)."""

    attempt_id: str
    status: TrajectoryStatus
    trained_tokens: int | None  # trainable tokens of its tree; None when it carries none
    timestamp_ms: int

    @classmethod
    def of(cls, t: Trajectory) -> TrajectoryFacts:
        trained = sum(len(s.tokens) for s in t.segments if s.trainable) if t.segments else None
        return cls(t.attempt_id, t.status, trained if t.status in TREE_STATUSES else None, t.timestamp_ms)


@dataclass
class RolloutHealth:
    """Capture-health counts of one rollout (its final attempt); see the module docstring for each definition."""

    rollout_id: str
    harness: str = UNKNOWN
    template: str = UNKNOWN
    attempt_id: str | None = None
    calls: int = 0  # calls of the final attempt, every kind
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
    generated_tokens: int = 0  # main calls of the final attempt
    trained_tokens: int | None = None  # trainable tokens of the settled trajectory; None: no tree (yet)
    cache_calls: int = 0  # calls whose engine reported cached prompt tokens
    cache_prompt_tokens: int = 0
    cached_tokens: int = 0
    excluded: dict[str, int] = field(default_factory=dict)  # non-main kinds of the final attempt → count
    trajectory_status: str | None = None

    @property
    def masked_tokens(self) -> int | None:
        if self.trained_tokens is None:
            return None
        return max(0, self.generated_tokens - self.trained_tokens)


def _full_sequences(calls: list[CallEvent]) -> tuple[dict[str, np.ndarray], set[str]]:
    """Prompt ids of every call whose delta chain resolves (``seq`` order), and the ids of those that do not."""
    prompts: dict[str, np.ndarray] = {}
    by_id = {c.call_id: c for c in calls}
    unresolved: set[str] = set()
    for call in calls:
        new = np.asarray(call.new_tokens, dtype=np.int32)
        if call.parent_call_id is None:
            prompts[call.call_id] = new
            continue
        parent = by_id.get(call.parent_call_id)
        if parent is None or parent.call_id not in prompts:
            unresolved.add(call.call_id)
            continue
        full = np.concatenate([prompts[parent.call_id], np.asarray(parent.generated_tokens, dtype=np.int32)])
        if not 0 <= call.shared_prefix_len <= len(full):
            unresolved.add(call.call_id)
            continue
        prompts[call.call_id] = np.concatenate([full[: call.shared_prefix_len], new])
    return prompts, unresolved


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _contains(haystack: bytes, needle: bytes) -> bool:
    """Whether ``needle`` occurs in ``haystack`` at a whole-token offset (both packed int32)."""
    i = haystack.find(needle)
    while i != -1:
        if i % _ITEM == 0:
            return True
        i = haystack.find(needle, i + 1)
    return False


def rollout_health(
    rollout_id: str,
    calls: Iterable[CallEvent],
    *,
    final_attempt: str | None = None,
    trajectory: Trajectory | TrajectoryFacts | None = None,
) -> RolloutHealth:
    """The capture-health counts of one rollout from its recorded calls (duplicates by ``call_id`` ignored).

    ``final_attempt``: the attempt to measure (default: the trajectory's, else the latest call's). ``trajectory``:
    the settled trajectory of that attempt, for the masked-token fraction.
    """
    if isinstance(trajectory, Trajectory):
        trajectory = TrajectoryFacts.of(trajectory)
    unique: dict[str, CallEvent] = {}
    for call in calls:
        unique.setdefault(call.call_id, call)
    if final_attempt is None and trajectory is not None:
        final_attempt = trajectory.attempt_id
    if final_attempt is None:
        dated = [c for c in unique.values() if c.attempt_id is not None]
        final_attempt = max(dated, key=lambda c: (c.timestamp_ms, c.seq)).attempt_id if dated else None
    out = RolloutHealth(rollout_id, attempt_id=final_attempt)
    mine = sorted((c for c in unique.values() if c.attempt_id in (None, final_attempt)), key=lambda c: c.seq)
    out.stale_attempt_calls = len(unique) - len(mine)
    out.calls = len(mine)
    for call in mine:
        if call.cached_prompt_tokens is not None:
            out.cache_calls += 1
            out.cache_prompt_tokens += call.prompt_len
            out.cached_tokens += min(call.cached_prompt_tokens, call.prompt_len)
    excluded = Counter(c.call_kind.value for c in mine if c.call_kind != CallKind.MAIN)
    out.excluded = dict(sorted(excluded.items()))
    prompts, unresolved = _full_sequences(mine)
    out.unresolved_calls = len(unresolved)
    compactions = [c.seq for c in mine if c.call_kind == CallKind.COMPACTION]
    main = [c for c in mine if c.call_kind == CallKind.MAIN and c.call_id in prompts]
    out.main_calls = sum(1 for c in mine if c.call_kind == CallKind.MAIN)
    out.generated_tokens = sum(len(c.generated_tokens) for c in mine if c.call_kind == CallKind.MAIN)
    segment_of = {c.call_id: bisect_left(compactions, c.seq) for c in main}
    fulls = {c.call_id: np.concatenate([prompts[c.call_id], np.asarray(c.generated_tokens, np.int32)]) for c in main}
    seen_segments: set[int] = set()
    for i, call in enumerate(main):
        segment = segment_of[call.call_id]
        if segment not in seen_segments:
            seen_segments.add(segment)
            out.restarts += i > 0
            continue
        out.follow_ups += 1
        out.full_renders += FULL_RENDER in call.flags
        prompt = prompts[call.call_id]
        best: tuple[int, bool, int] | None = None  # (shared tokens, extends entirely, seq)
        best_call: CallEvent | None = None
        for earlier in main[:i]:
            shared = _lcp(prompt, fulls[earlier.call_id])
            key = (shared, shared == len(fulls[earlier.call_id]), earlier.seq)
            if best is None or key > best:
                best, best_call = key, earlier
        assert best is not None and best_call is not None
        shared, extends, _ = best
        if shared == 0:
            out.roots += 1
        elif extends:
            out.extends += 1
        else:
            out.forks += 1
            out.answer_forks += shared > len(prompts[best_call.call_id])
    out.retry_orphans = _retry_orphans(main, prompts, segment_of)
    if trajectory is not None:
        out.trajectory_status = trajectory.status.value
        out.trained_tokens = trajectory.trained_tokens
    return out


def _retry_orphans(main: list[CallEvent], prompts: dict[str, np.ndarray], segment_of: dict[str, int]) -> int:
    """Main calls (not the last of their segment) whose generated tokens no later prompt of the segment holds."""
    orphans = 0
    packed: dict[str, bytes] = {}
    for i, call in enumerate(main):
        later = [c for c in main[i + 1 :] if segment_of[c.call_id] == segment_of[call.call_id]]
        if not later or len(call.generated_tokens) == 0:
            continue
        needle = np.asarray(call.generated_tokens, dtype="<i4").tobytes()
        found = False
        for nxt in later:  # the next call almost always holds it: stop at the first
            if nxt.call_id not in packed:
                packed[nxt.call_id] = prompts[nxt.call_id].astype("<i4").tobytes()
            if _contains(packed[nxt.call_id], needle):
                found = True
                break
        orphans += not found
    return orphans


# ---- many rollouts ---------------------------------------------------------------------------------------------------
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
    generated_tokens: int = 0
    trajectories: int = 0  # rollouts whose trajectory carries a tree (the masked fraction's rollouts)
    tree_generated_tokens: int = 0
    masked_tokens: int = 0
    cache_prompt_tokens: int = 0
    cached_tokens: int = 0

    def add(self, r: RolloutHealth) -> None:
        self.rollouts += 1
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
        """Take one event; types other than calls, rollout events, requests and trajectories are ignored."""
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
