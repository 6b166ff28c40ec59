"""Trees over the token budget are trained path by path (learner.tree_split): each trainable token once, the same
gradient as the packed tree, no dense mask."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from learner.hparams import Hyperparams  # noqa: E402
from learner.pack import pack_trees  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from learner.tree_split import is_chain, split_into_paths  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402


def retry_tree(base: int) -> list[Seg]:
    """prompt [b..b+3] -> gen [b+10 b+11] -> tool [b+20] -> gen [b+30 b+31 b+32]; a retry gen [b+40 b+41] at the
    prompt; a second answer [b+50] after the tool output (three paths, the first generated turn shared by two)."""
    lp = [-0.3, -0.7, -1.1]
    return [
        Seg(0, -1, [base, base + 1, base + 2, base + 3], False),
        Seg(1, 0, [base + 10, base + 11], True, lp[:2]),
        Seg(2, 1, [base + 20], False),
        Seg(3, 2, [base + 30, base + 31, base + 32], True, lp),
        Seg(4, 0, [base + 40, base + 41], True, lp[:2]),
        Seg(5, 2, [base + 50], True, lp[:1]),
    ]


def test_each_path_is_a_chain_and_each_trainable_segment_is_trained_in_exactly_one() -> None:
    rows = split_into_paths(retry_tree(0))
    as_ids = [[(list(s.tokens), s.trainable) for s in row] for row in rows]
    assert as_ids == [
        [([0, 1, 2, 3], False), ([10, 11], True), ([20], False), ([30, 31, 32], True)],
        [([0, 1, 2, 3], False), ([40, 41], True)],
        [([0, 1, 2, 3], False), ([10, 11], False), ([20], False), ([50], True)],  # the shared turn: context here
    ]
    assert all(is_chain(row) for row in rows) and not is_chain(retry_tree(0))
    assert [s.logprobs for s in rows[2]] == [[], [], [], [-0.3]]


def test_training_path_by_path_gives_the_packed_trees_gradient_and_loss() -> None:
    """Catches a shared turn trained twice, or a rollout's token mean taken per row instead of over its rows."""
    trees = [
        ScoredTree(retry_tree(3), 1.0, 1.0, "a"),
        ScoredTree(retry_tree(7), -0.5, 0.0, "b"),
        ScoredTree(retry_tree(11)[:2], 0.25, 0.5, "c"),
    ]
    results = {}
    for budget in (64, 10):  # all three trees in one row with the tree mask / the big two split into path rows
        rows = pack_trees([t.segments for t in trees], budget)
        model = tiny_model(0, "sdpa")
        metrics = train_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            trees,
            Hyperparams(max_grad_norm=0.0, token_budget=budget),
        )
        results[budget] = (len(rows), metrics, [p.grad.clone() for p in model.parameters()])
    (one, packed, g_packed), (many, split, g_split) = results[64], results[10]
    assert one == 1 and many == 7  # 3 + 3 paths, and the small tree
    assert split["trainable_tokens"] == packed["trainable_tokens"] == 2 * 8 + 2
    assert split["loss"] == pytest.approx(packed["loss"], abs=1e-6) and packed["loss"] != 0
    for a, b in zip(g_packed, g_split, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
