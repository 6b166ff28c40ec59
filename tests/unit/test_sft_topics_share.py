"""SFT from the event log with a harness's shared prefix computed once: the same loss and gradients as row by row.

Rows of two harnesses, readable token ids in the tiny model's 96: 10-29 the shared system prompt + tools, 30s/40s
the tasks, 50s/70s/80s the model's tokens (the targets), 60s tool results. ``rows_loss`` with sharing equals the
unshared loss, target count and every parameter gradient to 1e-5 (a prefix 4 tokens too long fails it); the prefix
is what every row of a harness starts with, one token short, never a target."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="SFT tests need torch (the 'ml' extra)")

from tests.support.tiny_model import tiny_model  # noqa: E402
from warmstart.sft import Sequence, _common_prefix  # noqa: E402
from warmstart.sft_rows import Row  # noqa: E402
from warmstart.sft_topics import TopicSFTConfig, rows_loss, score  # noqa: E402

SYSTEM = list(range(10, 30))  # 20 tokens every rollout of a harness starts with


def row(harness: str, task: list[int], gen: list[int], tool: list[int], gen2: list[int]) -> Row:
    ids = SYSTEM + task + gen + tool + gen2
    mask = [0] * (len(SYSTEM) + len(task)) + [1] * len(gen) + [0] * len(tool) + [1] * len(gen2)
    return Row(f"r{task[0]}", harness, f"t{task[0]}", 1.0, ids, mask)


ROWS = [
    row("opencode", [30, 31, 32], [50, 51, 52], [60, 61], [53, 54]),
    row("opencode", [32, 33], [53, 54], [60], [55, 56, 57]),
    row("opencode", [30, 31, 33, 34], [56], [60, 61, 62], [57, 58]),
    row("codex", [40, 41], [70, 71, 72], [60], [73]),
    row("codex", [40, 41, 42, 43, 44], [80, 81], [60, 61], [82, 83, 84, 85]),
]


def _loss_and_grads(shared: bool) -> tuple[float, int, list[torch.Tensor]]:
    model = tiny_model(seed=3)
    model.train()
    loss, n = rows_loss(model, ROWS, pad_id=0, shared_prefix=shared)
    (loss / n).backward()
    return float(loss.detach()), n, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_shared_prefix_gives_the_row_by_row_loss_and_gradients() -> None:
    shared_loss, shared_n, shared_grads = _loss_and_grads(True)
    loss, n, grads = _loss_and_grads(False)
    assert shared_n == n == sum(sum(r.mask) for r in ROWS)
    assert shared_loss == pytest.approx(loss, rel=1e-5)
    assert len(shared_grads) == len(grads) > 0
    for a, b in zip(shared_grads, grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model = tiny_model(seed=3)
    assert score(model, ROWS, 0, True)["loss"] == pytest.approx(score(model, ROWS, 0, False)["loss"], rel=1e-5)


def test_the_prefix_is_what_every_row_of_a_harness_starts_with_and_never_a_target() -> None:
    opencode = [Sequence(r.harness, r.ids, r.mask) for r in ROWS[:3]]
    # rows 0 and 2 share their first two task tokens past the system prompt; row 1 does not: the system prompt, less one
    # token, so its last position (which predicts the first task token) is computed per row
    assert _common_prefix(opencode) == len(SYSTEM) - 1
    assert _common_prefix([opencode[0], opencode[2]]) == len(SYSTEM) + 2 - 1


def test_scoring_is_bounded_by_rows_and_a_bad_bound_names_the_flag() -> None:
    assert TopicSFTConfig(prefix="p").score_rows == 16  # 64 real-harness rows scored twice cost several steps
    with pytest.raises(ValueError, match="--score-rows N, 0 for all"):
        TopicSFTConfig(prefix="p", score_rows=-1)


def test_builtin_rows_mix_the_agent_loops_own_data_in_both_dialects() -> None:
    from tests.support.proxy_helpers import tiny_tokenizer
    from warmstart.sft_topics import builtin_rows

    tok = tiny_tokenizer()
    rows = builtin_rows(tok, 3)
    assert [r.harness for r in rows] == ["agentloop", "agentloop-anthropic", "agentloop"]
    assert rows[0].task_id == rows[1].task_id != rows[2].task_id and len({r.rollout_id for r in rows}) == 3
    for r in rows:
        assert len(r.ids) == len(r.mask) and 0 < sum(r.mask) < len(r.ids)
        targets = tok.decode([t for t, m in zip(r.ids, r.mask, strict=True) if m])
        # the scripted solution's tool calls, each ended by the end-of-turn token (the agent loop's own tools)
        assert targets.startswith('<tool_call>\n{"name": ') and targets.endswith("</tool_call><|im_end|>"), targets
        assert r.mask[0] == 0  # the system prompt is never a target
    assert '"write_file"' in tok.decode(rows[0].ids) and '"Write"' in tok.decode(rows[1].ids)
    with pytest.raises(ValueError, match="--mix-builtin N, 0 for none"):
        TopicSFTConfig(prefix="p", mix_builtin=-1)
