"""Capture health per harness and chat template: did the proxy record each rollout the way training needs it?

The failures users of other RL-through-harness systems report most are silent: token ids lost when streaming,
false forks when a harness re-templates its history, response masks zeroed after retokenisation. Each leaves a
trace in the recorded events; ``rollout_health`` turns one rollout's traces into counts, computed over the calls of
its *final attempt* (the attempt its trajectory names, else its latest STARTED event, else its latest call), over its
MAIN calls in ``seq`` order grouped into compaction segments, each main call's prompt rebuilt from the delta
encoding. The figures (follow-up, tree parent, extends its parent exactly, fork, answer fork, root, full re-render,
retry orphan, masked-token fraction, prefix-cache hit rate, stale-attempt and unresolved calls) are defined in
docs/dashboard.md#capture-health, in the same words as the code. Tampered calls (the proxy's ``tampered`` flag: the
request held an assistant turn it never generated) count over every attempt: a forged turn is never a re-run's to hide.
So does a grader error by the rollout (``RewardEvent.grader_error_by_rollout``: the grader failed on what the rollout
left in its workspace, a graded 0), which health reads from the rollout's rewards.

Rows per (harness, template), the streaming aggregator and the text table: ``consumers.analytics.health_table``.

Input: typed events (``schemas.events``) from ``clawstream.calls``, ``clawstream.rollout.events``,
``clawstream.rollout.requests``, ``clawstream.trajectories`` and ``clawstream.rewards``, in any order. Pure: no Kafka
client; the readers are ``consumers.analytics.dashboard`` (live) and ``clawstream health`` (a topic range).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from policy.token_prefix import common_prefix_len
from schemas.events import (
    CallEvent,
    CallKind,
    Trajectory,
    TrajectoryStatus,
)

# The proxy's flag on a call whose conversation it laid out again (producers.proxy.render.FULL_RENDER; this layer
# may not import the proxy, and the flag's text is part of the call_event.avsc contract).
FULL_RENDER = "full_render"
UNKNOWN = "?"
TREE_STATUSES = frozenset({TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT})
_ITEM = np.dtype("<i4").itemsize


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
    """Capture-health counts of one rollout (its final attempt); definitions: docs/dashboard.md#capture-health."""

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
    tampered_calls: int = 0  # calls of any attempt whose request held an assistant turn the proxy never generated
    grader_error_by_rollout: bool = False  # a reward (any attempt) graded 0: the grader failed on the rollout's output
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
    out.tampered_calls = sum(c.tampered for c in unique.values())
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
            shared = common_prefix_len(prompt, fulls[earlier.call_id])
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
