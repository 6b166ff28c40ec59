"""Trajectories → SFT rows (pure, no Kafka): the token ids the proxy recorded, loss on the model's tokens only.

A row is one root-to-leaf path of a trajectory's tree (``schemas.tree_paths``): ``ids`` are the path's tokens
exactly as recorded, ``mask`` is 1 on the tokens the model generated in a kept main call (the segment's
``trainable``) and 0 on every prompt token (system prompt, tools, user turn, tool results, side calls). Only
complete trajectories with a reward of at least ``min_reward`` become rows. ``warmstart.sft_topics`` reads the
trajectories from Kafka and trains on these rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from schemas.tree_paths import path_tokens, path_trainable_mask, paths


@dataclass(frozen=True)
class Row:
    """One training row: ``ids`` (L,) and ``mask`` (L,) = 1 where the token is a target; where it came from."""

    rollout_id: str
    harness: str
    task_id: str
    reward: float
    ids: list[int]
    mask: list[int]


def keep(trajectory: Any, min_reward: float) -> str | None:
    """None when the trajectory is used, else why not (a short reason for the summary's counts)."""
    if str(trajectory.status) != "COMPLETE":
        return f"status {trajectory.status}"
    if trajectory.reward is None:
        return "no reward"
    if trajectory.reward < min_reward:
        return "reward below min_reward"
    return None


def rows_of(trajectory: Any) -> list[Row]:
    """Every root-to-leaf path of ``trajectory`` with at least one target token, as a row."""
    segments = trajectory.segments
    out: list[Row] = []
    for path in paths(segments):
        mask = [int(m) for m in path_trainable_mask(segments, path)]
        if not any(mask):
            continue
        ids = [int(t) for t in path_tokens(segments, path)]
        out.append(
            Row(trajectory.rollout_id, trajectory.harness, trajectory.task_id, float(trajectory.reward), ids, mask)
        )
    return out


def build_rows(trajectories: Iterable[Any], min_reward: float) -> tuple[list[Row], dict[str, int]]:
    """Rows of the kept trajectories (the last record of each rollout id wins), and counts of what was skipped."""
    latest: dict[str, Any] = {}
    for trajectory in trajectories:
        latest[trajectory.rollout_id] = trajectory
    rows: list[Row] = []
    skipped: dict[str, int] = {}
    for trajectory in latest.values():
        why = keep(trajectory, min_reward)
        if why is None:
            rows.extend(rows_of(trajectory))
        else:
            skipped[why] = skipped.get(why, 0) + 1
    return rows, skipped


def target_tokens(rows: Sequence[Row]) -> int:
    return sum(sum(r.mask) for r in rows)
