"""Trees longer than a micro-batch: one row per root-to-leaf path, each trainable token trained in exactly one row.

Why. A packed tree needs a dense (T, T) attention mask, so ``token_budget`` bounds a row (4096 tokens: 64 MiB of
fp32 mask). A real harness's rollout is one tree of 1–40k tokens (measured by tests/e2e/test_mixed_batch.py with
the tiny model's tokenizer on a three-call task: Claude Code 38k, Qwen Code 29k, Codex and OpenClaw 18k, opencode
14k, the built-in loop 1k); refusing such trees made every real-harness batch untrainable, and a 38k-token dense
mask would need 5.8 GiB. A *chain* needs no mask at all: it is a plain causal sequence
(``learner.forward.packed_forward`` then passes none and SDPA runs its causal kernel in O(T) memory). So a tree over
the budget is split **along the tree** into its root-to-leaf paths, each a chain row of any length:

- a path holds the path's segments in root-to-leaf order, context and generated alike, so every token is predicted
  from exactly the context it had in the tree (same depths, same predictor);
- a trainable segment is trained in the FIRST path (leaf order) that contains it and is context in the others, so
  a shared prefix still counts once per rollout in the loss, as in the packed tree (``learner.losses``
  aggregates per rollout across rows with the rollout's token count over the whole part);
- a path whose trainable segments were all trained earlier adds nothing and is left out.

A prefix the paths share is computed once by ``learner.kv_share`` (its keys and values attended by every path);
gradients equal the packed tree's (tests/unit/test_tree_split.py). A tree that is already a chain is one path: its
own row, as is.

Pure: no Kafka. Used by ``learner.pack.pack_trees``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from learner.segment_sampling import PLAIN_SAMPLING, segment_sampling
from schemas.tree_paths import paths

__all__ = ["PathSegment", "is_chain", "split_into_paths"]


@dataclass(frozen=True)
class PathSegment:
    """A segment of one path row: the tree segment's tokens with this row's parent and trainable flag."""

    parent: int
    tokens: Sequence[int]
    trainable: bool
    logprobs: Sequence[float]
    temperature: float
    top_p: float
    top_k: int
    call_id: str | None = None


def is_chain(segments: Sequence[Any]) -> bool:
    """True when every segment's parent is the one before it (one root, one leaf): a plain causal sequence."""
    return all(int(seg.parent) == i - 1 for i, seg in enumerate(segments))


def split_into_paths(segments: Sequence[Any]) -> list[list[PathSegment]]:
    """The tree as chain rows, one per root-to-leaf path that trains something (see the module docstring)."""
    sampling = [segment_sampling(s, i) if s.trainable else PLAIN_SAMPLING for i, s in enumerate(segments)]
    trained: set[int] = set()
    rows: list[list[PathSegment]] = []
    for path in paths(segments):
        owned = [i for i in path if segments[i].trainable and i not in trained]
        if not owned:
            continue
        trained.update(owned)
        row: list[PathSegment] = []
        for position, i in enumerate(path):
            seg = segments[i]
            train = i in owned
            row.append(
                PathSegment(
                    parent=position - 1,
                    tokens=list(seg.tokens),
                    trainable=train,
                    logprobs=list(seg.logprobs) if train else [],
                    temperature=sampling[i][0],
                    top_p=sampling[i][1],
                    top_k=sampling[i][2],
                    call_id=getattr(seg, "call_id", None),
                )
            )
        rows.append(row)
    return rows
