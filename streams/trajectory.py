"""A settled rollout → its :class:`Trajectory`: status, reward, task and step, metadata and the prefix tree.

Status: INFRA_FAILURE (reward null; never trained on, never in statistics), DROPPED (ungraded, a tampered call, leaf
cap, inconsistent calls: not trainable, reward kept when graded), TIMED_OUT (killed at the limit, graded, trainable),
COMPLETE, INCOMPLETE. Only COMPLETE / TIMED_OUT carry tree segments (``streams.tree``), each trainable segment with
its call's sampling settings. Task id and step come from the request, else from the group id ``task|harness|step``; the
request's metadata is copied (plus ``suite``, ``eval`` and ``attempt``). Pure: no Kafka, no Faust; used by
``streams.assemble``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from schemas.events import CallEvent, RewardStatus, RolloutState, Trajectory, TrajectoryStatus, TreeSegment
from streams.rollout import RolloutAccumulator
from streams.settings import StreamsSettings
from streams.state import TRAINABLE_STATUSES
from streams.tree import TreeCall, TreeError, build_tree


def split_group_id(group_id: str) -> tuple[str, int]:
    """``task|harness|step`` → (task, step); (group_id, -1) when it does not have that shape."""
    parts = group_id.rsplit("|", 2)
    if len(parts) == 3 and parts[2].lstrip("-").isdigit():
        return parts[0], int(parts[2])
    return group_id, -1


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
            tampered=c.tampered,
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
        # The settled attempt's own number, not the latest request's: a re-issue's request may be read before the
        # attempt it replaces settles, and the grouper waits for a re-issue by this number (group.awaits_reissue).
        metadata.setdefault("attempt", str(acc.attempt if acc.started is not None else req.get("attempt", 0)))
    segments: list[TreeSegment] = []
    leaves, unique_tokens, path_tokens, prefix_reuse_ratio = 0, 0, 0, 1.0
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
            leaves, unique_tokens, path_tokens = st.leaves, st.unique_tokens, st.path_tokens
            prefix_reuse_ratio = st.prefix_reuse_ratio
            if st.min_policy_version is not None:
                policy_version = st.min_policy_version
            if tree.dropped_reason is not None:
                status, drop_reason = TrajectoryStatus.DROPPED, tree.dropped_reason
            else:
                by_call: dict[str | None, CallEvent] = {c.call_id: c for c in calls}  # a segment may have no call
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
        leaves=leaves,
        unique_tokens=unique_tokens,
        path_tokens=path_tokens,
        prefix_reuse_ratio=prefix_reuse_ratio,
    )
