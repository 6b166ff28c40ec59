"""Rows of their own that begin with the same context compute it once (learner.kv_share): the shared prefix's keys
and values, with gradient, attended by every row — the same loss, statistics and gradients as per-path training."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from learner.hparams import Hyperparams  # noqa: E402
from learner.kv_share import plan_groups, suffix_row  # noqa: E402
from learner.pack import pack_trees  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402

SYSTEM = list(range(40, 80))  # a harness's system prompt and tools: 40 tokens every rollout begins with
LP = [-0.3, -0.7, -1.1, -0.2]


def chain(task: list[int], gen: list[int], tool: list[int], gen2: list[int]) -> list[Seg]:
    """system + task prompt → answer → tool result → answer: an append-only rollout (one path)."""
    return [
        Seg(0, -1, SYSTEM + task, False),
        Seg(1, 0, gen, True, LP[: len(gen)]),
        Seg(2, 1, tool, False),
        Seg(3, 2, gen2, True, LP[: len(gen2)]),
    ]


def retry(task: list[int]) -> list[Seg]:
    """A tree: two answers to the same prompt (two paths sharing system + task prompt)."""
    return [Seg(0, -1, SYSTEM + task, False), Seg(1, 0, [85, 86, 87], True, LP[:3]), Seg(2, 0, [90, 91], True, LP[:2])]


def trees() -> list[ScoredTree]:
    return [
        # Two rollouts of one task (a GRPO group): the same whole prompt, so the first generated token follows the
        # shared run at once — the prefix must stop one token short for its predictor.
        ScoredTree(chain([5, 6, 7], [10, 11], [20, 21, 22], [30, 31, 32]), 1.0, 1.0, "claude-code"),
        ScoredTree(chain([5, 6, 7], [12, 13, 14], [23], [33]), -1.0, 0.0, "claude-code"),
        ScoredTree(chain([8, 9], [15], [24, 25], [34, 35, 36, 37]), 0.5, 0.5, "claude-code"),
        ScoredTree(retry([4]), -0.5, 0.25, "claude-code"),
        ScoredTree([Seg(0, -1, [1, 2, 3, 4, 5], False), Seg(1, 0, [9, 9], True, LP[:2])], 0.25, 0.5, "agentloop"),
    ]


def _step(
    kv_share_min: int, batch: list[ScoredTree] | None = None, **hp: object
) -> tuple[dict[str, float], list[torch.Tensor]]:
    model = tiny_model(0, "sdpa")
    config = Hyperparams(max_grad_norm=0.0, token_budget=24, kv_share_min=kv_share_min, **hp)
    ref = tiny_model(1, "sdpa") if config.kl_coef > 0 else None
    batch = trees() if batch is None else batch
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.05), batch, config, ref_model=ref)
    return metrics, [p.grad.clone() for p in model.parameters()]


def test_rows_sharing_a_system_prompt_form_one_group_that_stops_one_token_short() -> None:
    rows = pack_trees([t.segments for t in trees()], 24)
    assert len(rows) == 6 and all(r.is_chain for r in rows)  # every tree over the budget: a row per path
    [(members, m)] = plan_groups(rows, 16)
    assert sorted(members) == [0, 1, 2, 3, 4] and m == len(SYSTEM) - 1  # rollouts 1 and 3 differ right after it
    pair = [i for i, r in enumerate(rows) if r.input_ids[len(SYSTEM) : len(SYSTEM) + 3].tolist() == [5, 6, 7]]
    [(_, m2)] = plan_groups([rows[i] for i in pair], 16)
    assert m2 == len(SYSTEM) + 3 - 1  # same task: the whole prompt but its last token (the answer's predictor)
    tail = suffix_row(rows[0], m)
    assert tail.input_ids.tolist() == rows[0].input_ids[m:].tolist() and tail.position_ids[0] == m
    assert tail.loss_mask.sum() == rows[0].loss_mask.sum() and tail.predictor[0] == -1
    assert plan_groups(rows, 0) == [] and plan_groups(rows, 41) == [(pair, m2)] and plan_groups(rows, 43) == []


def dated(day: int, task: list[int], gen: list[int]) -> list[Seg]:
    """A rollout whose system prompt carries the date (opencode's does) in the middle of its 80 tokens."""
    return [Seg(0, -1, SYSTEM + [day] + SYSTEM[1:] + task, False), Seg(1, 0, gen, True, LP[: len(gen)])]


def test_a_batch_spanning_midnight_shares_each_day_s_whole_prefix() -> None:
    """Rows whose context differs early (the date) but agrees long after form one group per day, each sharing its
    whole prefix, instead of one group sharing only the part before the date."""
    days = [dated(7, [5, 6], [10, 11]), dated(7, [5, 6], [12]), dated(8, [5, 6], [13, 14]), dated(8, [5, 6], [15])]
    rows = pack_trees(days, 24)
    assert all(r.is_chain for r in rows)
    groups = plan_groups(rows, 16)
    whole = len(SYSTEM) + 1 + 39 + 2 - 1  # system, date, more of the system prompt, task; one short
    assert sorted(m for _, m in groups) == [whole, whole]
    assert sorted({int(rows[i].input_ids[len(SYSTEM)]) for i in g} for g, _ in groups) == [{7}, {8}]
    # Where splitting saves less than sharing the early part once, one group stays (the test above: 39 x 4 > 42 + 40).
    assert plan_groups(pack_trees([t.segments for t in trees()], 24), 16)[0][1] == len(SYSTEM) - 1
    batch = [ScoredTree(t, a, a, "opencode") for t, a in zip(days, (1.0, -1.0, 0.5, -0.5), strict=True)]
    (off, g_off), (on, g_on) = _step(0, batch), _step(16, batch)
    assert on["kv_shared_tokens"] == 2 * whole and on["loss"] == pytest.approx(off["loss"], abs=1e-6)
    for a, b in zip(g_off, g_on, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("share_min", "hp"),
    [(16, {}), (16, {"mini_batches": 2}), (16, {"kl_coef": 0.1}), (41, {})],  # 41: only the same-task pair shares
)
def test_sharing_the_prefix_gives_per_path_trainings_loss_statistics_and_gradients(share_min: int, hp: dict) -> None:
    """Catches a prefix whose gradient never flows back, an off-by-one at its end, or a shifted position."""
    (off, g_off), (on, g_on) = _step(0, **hp), _step(share_min, **hp)
    assert on["kv_shared_tokens"] > 0 and "kv_shared_tokens" not in off
    assert on["loss"] == pytest.approx(off["loss"], abs=1e-6) and off["loss"] != 0
    assert off["update_kl"] != 0  # the step moved the policy: the statistics after it are not trivially equal
    for key in ("trainable_tokens", "is_weight_mean", "entropy", "ref_kl", "update_kl", "update_adv_dot"):
        if key in off:
            assert on[key] == pytest.approx(off[key], rel=1e-5, abs=1e-6), key  # update stats: differences of logprobs
    for a, b in zip(g_off, g_on, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
