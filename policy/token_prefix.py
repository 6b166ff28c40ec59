"""The longest prefix token sequences share, and the leading run of a mask: one implementation for every stage.

The proxy finds the earlier call a prompt extends (``producers.proxy.render``), the tree builder where a prompt leaves
the tree (``streams.tree``), the analytics how much each call reused (``consumers.analytics.health``), the learner
what rows and rollouts hold in common (``learner.prefix_share``, ``learner.kv_share``), the warm start what its rows
share (``warmstart.sft``). Sequences are lists or tuples of ints (compared slice by slice in C: a match of k tokens
costs O(k), not a Python loop over them) or numpy arrays (compared in one vectorised pass). Pure: numpy and the
standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["common_prefix_len", "common_prefix_len_all", "leading_run"]

Tokens = Sequence[int] | np.ndarray

# The first slice compared; each next one is twice as long, so a long match takes O(log n) comparisons and a short
# one never copies more than about twice its length.
_FIRST_CHUNK = 256


def common_prefix_len(a: Tokens, b: Tokens, *, start: int = 0) -> int:
    """Length of the longest common prefix of ``a[start:]`` and ``b``."""
    return _common(a, b, start, min(len(a) - start, len(b)))


def common_prefix_len_all(seqs: Sequence[Tokens]) -> int:
    """Length of the longest prefix every sequence starts with (0 for none)."""
    if not seqs:
        return 0
    first = seqs[0]
    n = len(first)
    for seq in seqs[1:]:
        n = _common(first, seq, 0, min(n, len(seq)))
    return n


def leading_run(mask: Sequence[bool] | np.ndarray) -> int:
    """How many leading entries of a 1-D mask are true."""
    falses = np.flatnonzero(~np.asarray(mask, dtype=bool))
    return int(falses[0]) if len(falses) else len(mask)


def _common(a: Tokens, b: Tokens, start: int, n: int) -> int:
    """Length of the common prefix of ``a[start:start + n]`` and ``b[:n]`` (n ≤ both lengths)."""
    if n <= 0:
        return 0
    if not (isinstance(a, list | tuple) and isinstance(b, list | tuple)):  # arrays (CPU tensors too): vectorised
        differ = np.flatnonzero(np.asarray(a[start : start + n]) != np.asarray(b[:n]))
        return int(differ[0]) if len(differ) else n
    x: Any = a
    y: Any = b
    if type(x) is not type(y):  # a list slice never equals a tuple slice: compare like with like
        x, y, start = list(x[start : start + n]), list(y[:n]), 0
    # Gallop: compare growing chunks until one differs; x[start:start + lo] == y[:lo] throughout.
    lo, step = 0, _FIRST_CHUNK
    while lo < n:
        hi = min(lo + step, n)
        if x[start + lo : start + hi] != y[lo:hi]:
            # The first difference lies in [lo, hi): halve the range, comparing only its untested part.
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if x[start + lo : start + mid] == y[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return n
