"""The longest shared token prefix (policy.token_prefix): lists, tuples, numpy arrays, offsets, many sequences."""

from __future__ import annotations

import random

import numpy as np
import pytest

from policy.token_prefix import common_prefix_len, common_prefix_len_all, leading_run

SYSTEM = [100, 101, 102, 103]  # a system prompt's tokens
TOOLS = [200, 201, 202]


def test_two_sequences() -> None:
    assert common_prefix_len(SYSTEM + TOOLS + [1, 2], SYSTEM + TOOLS + [1, 3]) == 8
    assert common_prefix_len(SYSTEM + [7], SYSTEM + TOOLS) == 4
    assert common_prefix_len(SYSTEM, SYSTEM + TOOLS) == 4  # one is a prefix of the other
    assert common_prefix_len(SYSTEM + TOOLS, SYSTEM) == 4
    assert common_prefix_len([9] + SYSTEM, SYSTEM) == 0
    assert common_prefix_len([], SYSTEM) == common_prefix_len(SYSTEM, []) == 0


def test_long_sequences_at_every_chunk_boundary() -> None:
    a = list(range(5000))
    assert common_prefix_len(a, a) == 5000
    assert common_prefix_len(a, a[:10]) == 10
    for k in (0, 1, 255, 256, 257, 767, 768, 3000, 4999):
        b = a[:k] + [-1] + a[k + 1 :]
        assert common_prefix_len(a, b) == k
        assert common_prefix_len(tuple(a), tuple(b)) == k
        assert common_prefix_len(np.array(a), np.array(b, dtype=np.int32)) == k


def test_offset_into_the_first() -> None:
    prompt = SYSTEM + TOOLS + [1, 2, 3]
    assert common_prefix_len(prompt, TOOLS + [1, 9], start=4) == 4
    assert common_prefix_len(prompt, [1, 2, 3, 4, 5], start=7) == 3  # the rest of the prompt runs out first
    assert common_prefix_len(prompt, [1], start=len(prompt)) == 0
    assert common_prefix_len(np.array(prompt), TOOLS, start=4) == 3


def test_mixed_kinds_compare_by_value() -> None:
    assert common_prefix_len(SYSTEM + TOOLS, tuple(SYSTEM) + (0,)) == 4
    assert common_prefix_len(np.array(SYSTEM + TOOLS), SYSTEM + [0]) == 4
    assert common_prefix_len(SYSTEM, np.array(SYSTEM + TOOLS)) == 4


def test_every_sequence() -> None:
    task_a, task_b = [300, 301], [400]
    rows = [SYSTEM + TOOLS + task_a, SYSTEM + TOOLS + task_b, SYSTEM + TOOLS + task_a + [5]]
    assert common_prefix_len_all(rows) == 7
    assert common_prefix_len_all([SYSTEM + TOOLS, SYSTEM, SYSTEM + [0]]) == 4
    assert common_prefix_len_all([SYSTEM]) == 4
    assert common_prefix_len_all([]) == 0
    assert common_prefix_len_all([np.array(r) for r in rows]) == 7


def test_leading_run() -> None:
    assert leading_run([True, True, False, True]) == 2
    assert leading_run(np.array([True, True, True])) == 3
    assert leading_run(np.array([False, True])) == 0
    assert leading_run([]) == 0


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_a_plain_scan(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        shared = [rng.randrange(3) for _ in range(rng.choice((0, 5, 300, 2000)))]
        a = shared + [rng.randrange(3) for _ in range(rng.randrange(20))]
        b = shared + [rng.randrange(3) for _ in range(rng.randrange(20))]
        start = rng.randrange(min(3, len(a) + 1))
        expect = next((i for i, (x, y) in enumerate(zip(a[start:], b, strict=False)) if x != y), None)
        expect = min(len(a) - start, len(b)) if expect is None else expect
        assert common_prefix_len(a, b, start=start) == expect
        assert common_prefix_len(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64), start=start) == expect
