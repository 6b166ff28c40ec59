"""A stand-in for ``streams.tree.Segment`` in packing and loss tests: the fields ``learner.pack`` reads, plus index."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Seg:
    """What packing reads from a segment (``learner.pack.SegmentLike``) and the ``index`` it checks if present."""

    index: int
    parent: int
    tokens: list[int]
    trainable: bool
    logprobs: list[float] = field(default_factory=list)
