"""The CPU's row budget (learner.step.row_budget): rows packed only as long as the batch's largest tree, never
splitting a tree that fitted token_budget, and a step whose update is the one rows of the full budget give."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from learner import step as step_module  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.step import ScoredTree, row_budget, train_step  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402


def _tree(base: int, prompt: int, gen: int) -> list[Seg]:
    tokens = [(base + i) % 60 + 1 for i in range(prompt + gen)]
    return [Seg(0, -1, tokens[:prompt], False), Seg(1, 0, tokens[prompt:], True, [-1.0] * gen)]


def _scored(n: int) -> list[ScoredTree]:
    return [ScoredTree(_tree(7 * i, 6 + i, 4 + i % 3), (-1.0) ** i * (0.5 + i / 10), None, "h") for i in range(n)]


def test_the_cpu_packs_to_the_largest_tree_within_the_token_budget() -> None:
    trees = _scored(6)  # the largest has 6 + 5 + 4 + 2 = 17 tokens
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert row_budget(cpu, Hyperparams(token_budget=4096), trees) == step_module.CPU_ROW_TOKENS
    assert row_budget(gpu, Hyperparams(token_budget=4096), trees) == 4096
    assert row_budget(cpu, Hyperparams(token_budget=12), trees) == 12  # a tree over it is split as before
    big = [ScoredTree(_tree(0, 900, 20), 1.0, None, "h"), *trees]
    assert row_budget(cpu, Hyperparams(token_budget=4096), big) == 920


def test_a_step_in_short_rows_is_the_step_in_long_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails if the short rows dropped or double-counted a tree, or changed the loss's normalisers."""
    model = tiny_model(3, "sdpa")
    trees = _scored(8)
    config = Hyperparams(token_budget=4096, max_grad_norm=0.0)
    results = {}
    for floor in (16, 4096):  # rows of ≤ 17 tokens (8 rows) vs one row of every tree
        monkeypatch.setattr(step_module, "CPU_ROW_TOKENS", floor)
        m = copy.deepcopy(model)
        metrics = train_step(m, torch.optim.SGD(m.parameters(), lr=0.5), trees, config)
        results[floor] = (metrics, [p.detach().clone() for p in m.parameters()])
    (short, short_w), (long, long_w) = results[16], results[4096]
    assert short["micro_batches"] == 8 and long["micro_batches"] == 1
    assert short["loss"] == pytest.approx(long["loss"], abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(short_w, long_w, strict=True)) < 1e-5
    moved = [a - b.detach() for a, b in zip(short_w, model.parameters(), strict=True)]
    assert max(float(d.abs().max()) for d in moved) > 1e-4  # the step did move the weights
