"""Paths through a rollout's tree: root-to-leaf segment indices, their tokens and trainable masks.

Works on any segment list whose items have ``parent``, ``tokens`` and ``trainable`` (``streams.tree.Segment``, the
decoded Avro ``TreeSegment``): positions are list indices, parents come first. Pure: no Kafka. Used by the learner's
benchmarks and tests to read trees the way a per-path trainer would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def paths(segments: Sequence[Any]) -> list[list[int]]:
    """Every root-to-leaf path as segment indices (root first), one per leaf, in leaf index order.

    Works on any segment list with ``parent`` (the decoded Avro ``TreeSegment`` too): positions are list indices."""
    has_child = [False] * len(segments)
    for seg in segments:
        if seg.parent >= 0:
            has_child[seg.parent] = True
    result: list[list[int]] = []
    for position in range(len(segments)):
        if has_child[position]:
            continue
        path, cursor = [], position
        while cursor >= 0:
            path.append(cursor)
            cursor = segments[cursor].parent
        result.append(path[::-1])
    return result


def path_to(segments: Sequence[Any], index: int) -> list[int]:
    """Segment indices from the root down to (and including) segment ``index``."""
    path: list[int] = []
    while index >= 0:
        path.append(index)
        index = segments[index].parent
    return path[::-1]


def path_tokens(segments: Sequence[Any], path: Sequence[int]) -> list[int]:
    """The token ids along a path (as returned by :func:`paths`)."""
    return [tok for i in path for tok in segments[i].tokens]


def path_trainable_mask(segments: Sequence[Any], path: Sequence[int]) -> list[bool]:
    """Per token along a path: True where the token is trained on (a generated token of a kept main call)."""
    return [segments[i].trainable for i in path for _ in segments[i].tokens]
