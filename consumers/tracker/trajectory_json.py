"""A sampled trajectory as a JSON document a person browses in MLflow's artifact view (pure: no Kafka, no MLflow).

What it holds: the rollout (task, harness, step, policy version, status, reward, the batch's GRPO advantage), each
root-to-leaf path of its prefix tree decoded to text (one per conversation the harness held with the policy; special
tokens kept, they show the chat structure) and the tree itself: per segment its parent, whether it is trained on,
its call, version, token count and text. Without a tokenizer (no ``--model``) the text fields are left out and
the token ids are given instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from schemas.events import Trajectory
from schemas.tree_paths import path_tokens, paths

Decode = Callable[[Sequence[int]], str]


def trajectory_document(
    trajectory: Trajectory, *, batch_id: str, advantage: float, decode: Decode | None = None
) -> dict[str, Any]:
    """The JSON-ready document of one trajectory (see the module docstring)."""
    segments = trajectory.segments
    return {
        "rollout_id": trajectory.rollout_id,
        "task_id": trajectory.task_id,
        "harness": trajectory.harness,
        "step": trajectory.step,
        "policy_version": trajectory.policy_version,
        "status": trajectory.status.value,
        "reward": trajectory.reward,
        "advantage": advantage,
        "batch_id": batch_id,
        "group_id": trajectory.group_id,
        "calls": trajectory.calls,
        "leaves": trajectory.leaves,
        "unique_tokens": trajectory.unique_tokens,
        "path_tokens": trajectory.path_tokens,
        "prefix_reuse_ratio": trajectory.prefix_reuse_ratio,
        "conversations": [_text(path_tokens(segments, path), decode) for path in paths(segments)],
        "tree": [
            {
                "index": i,
                "parent": seg.parent,
                "trainable": seg.trainable,
                "call_id": seg.call_id,
                "policy_version": seg.policy_version,
                "tokens": len(seg.tokens),
                **_text([int(t) for t in seg.tokens], decode),
            }
            for i, seg in enumerate(segments)
        ],
        "metadata": dict(trajectory.metadata),
    }


def _text(ids: Sequence[int], decode: Decode | None) -> dict[str, Any]:
    ids = [int(i) for i in ids]
    return {"text": decode(ids)} if decode is not None else {"token_ids": ids}
