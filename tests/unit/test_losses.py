"""Learner losses: hand-computed GRPO, TIS, masked IS, PPO and aggregation values; a reference check against verl."""

from __future__ import annotations

import importlib.util
import math
import sys
from types import ModuleType
from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")

from clawbase.errors import ConfigError  # noqa: E402
from learner.aggregation import LossInputError, aggregate  # noqa: E402
from learner.losses import (  # noqa: E402
    LossConfig,
    grpo_loss,
    importance_weights,
    k3_kl,
    policy_loss,
    ppo_loss,
    value_loss,
)
from learner.pack import MicroBatch, pack_tree  # noqa: E402
from tests.support.segments import Seg  # noqa: E402

D = torch.float64  # hand-computed values are checked in fp64 so that 1e-12 tolerances are meaningful


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=D)


def logs(values: list[float]) -> torch.Tensor:
    return torch.log(t(values))


def approx(x: float, tol: float = 1e-12) -> object:
    return pytest.approx(x, abs=tol)


NO_IS = LossConfig(eps_low=0.2, eps_high=0.28, is_mode="none")


# ---------------------------------------------------------------- GRPO clipped surrogate


def test_grpo_clip_low_and_high_by_hand() -> None:
    # Rollout 0 (A = +1): r = 1.5 (clipped high at 1.28), 1.1, 0.5 (A > 0: low side is never clipped).
    # Rollout 1 (A = -1): r = 0.5 (clipped low at 0.8), 1.5 (A < 0: high side never clipped), 0.9.
    ratios = [1.5, 1.1, 0.5, 0.5, 1.5, 0.9]
    logp_new = logs(ratios).requires_grad_()
    logp_old = torch.zeros(6, dtype=D)
    rollout_index = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, dtype=torch.bool)
    loss, stats = grpo_loss(logp_new, logp_old, logp_old, t([1.0, -1.0]), rollout_index, mask, NO_IS)
    per_token = [-1.28, -1.1, -0.5, 0.8, 1.5, 0.9]
    assert loss.item() == approx(sum(per_token) / 6)
    assert stats["clip_frac_low"] == approx(1 / 6)
    assert stats["clip_frac_high"] == approx(1 / 6)
    assert stats["clip_frac"] == approx(2 / 6)
    assert stats["dual_clip_frac"] == 0.0
    assert stats["approx_kl"] == approx(-sum(math.log(r) for r in ratios) / 6)
    # d loss / d logp_new = -A r / 6 where unclipped, 0 where the clipped branch is active.
    loss.backward()
    expected_grad = [0.0, -1.1 / 6, -0.5 / 6, 0.0, 1.5 / 6, 0.9 / 6]
    torch.testing.assert_close(logp_new.grad, t(expected_grad), atol=1e-12, rtol=0)


def test_dual_clip_bounds_negative_advantage_tokens() -> None:
    cfg = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, is_mode="none")
    logp_new = logs([4.0, 2.0])
    logp_old = torch.zeros(2, dtype=D)
    loss, stats = grpo_loss(
        logp_new, logp_old, logp_old, t([-1.0]), torch.tensor([0, 0]), torch.ones(2, dtype=bool), cfg
    )
    # r = 4: max(4, 1.28) = 4 -> bounded to 3; r = 2: 2 < 3 stays.
    assert loss.item() == approx((3.0 + 2.0) / 2)
    assert stats["dual_clip_frac"] == approx(0.5)


def test_logp_old_none_means_one_on_policy_update() -> None:
    # ratio 1 everywhere: the plain policy gradient. Default aggregation (per-rollout token mean, then mean over the
    # R = 2 rollouts): loss = mean_r(-A_r), gradient = -A_r / (|r| R).
    logp_new = t([-1.0, -2.0, -0.5]).requires_grad_()
    loss, stats = grpo_loss(
        logp_new, None, logp_new.detach(), t([2.0, -1.0]), torch.tensor([0, 0, 1]), torch.ones(3, dtype=bool), NO_IS
    )
    assert loss.item() == approx((-2.0 + 1.0) / 2)
    loss.backward()
    torch.testing.assert_close(logp_new.grad, t([-2 / 4, -2 / 4, 1 / 2]), atol=1e-12, rtol=0)
    assert stats["clip_frac"] == 0.0


# ---------------------------------------------------------------- off-policy correction


def test_tis_truncates_at_cap() -> None:
    # exp(logp_old - logp_rollout) = 0.5, 1.0, 3.0 -> w = 0.5, 1.0, 2.0 (c = 2); ratio 1, A = 1: loss_t = -w_t.
    logp_old = t([-1.0, -1.0, -1.0])
    logp_rollout = logp_old - logs([0.5, 1.0, 3.0])
    logp_new = logp_old.clone().requires_grad_()
    cfg = LossConfig(is_mode="tis", is_cap=2.0)
    loss, stats = grpo_loss(
        logp_new, logp_old, logp_rollout, t([1.0]), torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=bool), cfg
    )
    assert loss.item() == approx(-(0.5 + 1.0 + 2.0) / 3)
    assert stats["is_truncated_frac"] == approx(1 / 3)
    assert stats["is_weight_max"] == approx(2.0)
    assert stats["is_weight_mean"] == approx(3.5 / 3)
    assert stats["is_raw_ratio_max"] == approx(3.0)
    assert stats["is_masked_frac"] == 0.0
    # The weight is a constant: d loss / d logp_new = -A w r / T.
    loss.backward()
    torch.testing.assert_close(logp_new.grad, t([-0.5 / 3, -1 / 3, -2 / 3]), atol=1e-12, rtol=0)


def test_masked_is_drops_tokens_outside_band_but_keeps_normaliser() -> None:
    # Band [1/2, 2]: ratios 0.4 and 3.0 are dropped (weight 0); 0.51 / 1.0 / 1.99 keep their ratio as weight.
    raw = [0.4, 1.0, 3.0, 0.51, 1.99]
    logp_old = torch.zeros(5, dtype=D)
    logp_rollout = -logs(raw)
    mask = torch.ones(5, dtype=bool)
    cfg = LossConfig(is_mode="masked", is_cap=2.0)
    loss, stats = grpo_loss(
        logp_old.clone(), logp_old, logp_rollout, t([1.0]), torch.zeros(5, dtype=torch.long), mask, cfg
    )
    assert loss.item() == approx(-(1.0 + 0.51 + 1.99) / 5)  # three kept tokens, normaliser still 5
    assert stats["is_masked_frac"] == approx(2 / 5)
    assert stats["is_truncated_frac"] == 0.0
    w, _ = importance_weights(logp_old, logp_rollout, mask, "masked", 2.0)
    torch.testing.assert_close(w, t([0.0, 1.0, 0.0, 0.51, 1.99]), atol=1e-12, rtol=0)


def test_importance_weights_ignore_non_trainable_placeholders() -> None:
    # Non-trainable tokens may carry any placeholder logprob: no inf / NaN may leak out of them.
    mask = torch.tensor([False, True, False])
    w, stats = importance_weights(t([0.0, -1.0, 500.0]), t([-900.0, -1.0, 0.0]), mask, "tis", 2.0)
    assert w.tolist() == [0.0, 1.0, 0.0]
    assert stats["is_truncated_frac"] == 0.0
    loss, _ = grpo_loss(
        t([800.0, -1.0, -900.0]),
        t([0.0, -1.0, 500.0]),
        t([-900.0, -1.0, 0.0]),
        t([1.0]),
        torch.zeros(3, dtype=torch.long),
        mask,
        LossConfig(),
    )
    assert loss.item() == approx(-1.0)


# ---------------------------------------------------------------- PPO


def test_ppo_advantage_is_return_minus_value() -> None:
    # R = 1 for rollout 0, 0 for rollout 1; V = 0.25, 0.5 | 0.75; ratio 1, no IS: A_t = R - V.
    values = t([0.25, 0.5, 0.75]).requires_grad_()
    logp_new = t([-1.0, -1.0, -1.0]).requires_grad_()
    rollout_index = torch.tensor([0, 0, 1])
    mask = torch.ones(3, dtype=bool)
    cfg = LossConfig(is_mode="none", vf_coef=0.5)
    loss, stats = ppo_loss(logp_new, None, logp_new.detach(), values, t([1.0, 0.0]), rollout_index, mask, cfg)
    adv = [0.75, 0.5, -0.75]
    # Default aggregation: mean over rollouts (R = 2) of each rollout's token mean (rollout 0 has 2 tokens, 1 has 1).
    pg = (-(0.75 + 0.5) / 2 + 0.75) / 2
    vl = 0.5 * ((0.75**2 + 0.5**2) / 2 + 0.75**2) / 2
    assert stats["policy_loss"] == approx(pg)
    assert stats["value_loss"] == approx(vl)
    assert loss.item() == approx(pg + 0.5 * vl)
    assert stats["advantage_mean"] == approx(sum(adv) / 3)
    loss.backward()
    # Policy gradient uses A = R - V with V detached; the value gradient is vf_coef * (V - R) / (|r| R) only.
    torch.testing.assert_close(logp_new.grad, t([-0.75 / 4, -0.5 / 4, 0.75 / 2]), atol=1e-12, rtol=0)
    torch.testing.assert_close(values.grad, t([0.5 * -0.75 / 4, 0.5 * -0.5 / 4, 0.5 * 0.75 / 2]), atol=1e-12, rtol=0)


def test_ppo_old_values_and_clipped_value_loss() -> None:
    # V_old = 0.5, V = 0.9 (moved +0.4), R = 1, clip 0.2: clipped V = 0.7 -> max((0.1)^2, (0.3)^2) = 0.09.
    # Second token: V_old = 0.5, V = 0.6, R = 0: max(0.36, 0.36) -> 0.36 (clip inactive: |0.1| < 0.2).
    values = t([0.9, 0.6]).requires_grad_()
    old = t([0.5, 0.5])
    vl, stats = value_loss(
        values, t([1.0, 0.0]), torch.ones(2, dtype=bool), torch.tensor([0, 1]), old_values=old, value_clip=0.2
    )
    assert vl.item() == approx(0.5 * (0.09 + 0.36) / 2)
    assert stats["value_clip_frac"] == approx(0.5)
    cfg = LossConfig(is_mode="none", value_clip=0.2, vf_coef=1.0)
    logp = t([-1.0, -1.0])
    loss, pstats = ppo_loss(
        logp, None, logp, values, t([1.0, 0.0]), torch.tensor([0, 1]), torch.ones(2, dtype=bool), cfg, old_values=old
    )
    # Advantages come from the OLD values: 1 - 0.5 and 0 - 0.5 -> policy loss -(0.5 - 0.5) / 2 = 0.
    assert pstats["policy_loss"] == approx(0.0)
    assert loss.item() == approx(vl.item())
    with pytest.raises(LossInputError, match="old_values"):
        value_loss(values, t([1.0, 0.0]), torch.ones(2, dtype=bool), torch.tensor([0, 1]), value_clip=0.2)


# ---------------------------------------------------------------- KL


def test_k3_kl_to_reference() -> None:
    logp_new = t([0.0, -1.0]).requires_grad_()
    logp_ref = t([math.log(0.5), -1.0])
    kl = k3_kl(logp_new, logp_ref, torch.ones(2, dtype=bool))
    assert kl.tolist() == [approx(0.5 + math.log(2) - 1), approx(0.0)]
    cfg = LossConfig(is_mode="none", kl_coef=0.1)
    loss, stats = grpo_loss(
        logp_new,
        None,
        logp_new.detach(),
        t([0.0]),
        torch.tensor([0, 0]),
        torch.ones(2, dtype=bool),
        cfg,
        logp_ref=logp_ref,
    )
    assert stats["ref_kl"] == approx((0.5 + math.log(2) - 1) / 2)
    assert loss.item() == approx(0.1 * stats["ref_kl"])
    with pytest.raises(LossInputError, match="logp_ref"):
        grpo_loss(logp_new, None, logp_new.detach(), t([0.0]), torch.tensor([0, 0]), torch.ones(2, dtype=bool), cfg)


# ---------------------------------------------------------------- aggregation on a packed tree


def shared_prefix_batch() -> MicroBatch:
    # Rollout 0: prompt -> generated A (2 tokens) -> { generated B (1) | tool output (1) -> generated C (3) }.
    # Paths: prompt+A+B and prompt+A+tool+C; A is shared. Rollout 1: prompt (2) -> generated (2).
    tree0 = [
        Seg(0, -1, [1, 2, 3], False),
        Seg(1, 0, [4, 5], True, [-0.1, -0.1]),
        Seg(2, 1, [6], True, [-0.1]),
        Seg(3, 1, [7], False),
        Seg(4, 3, [8, 9, 10], True, [-0.1, -0.1, -0.1]),
    ]
    tree1 = [Seg(0, -1, [1, 2], False), Seg(1, 0, [3, 4], True, [-0.1, -0.1])]
    return MicroBatch.from_trees([pack_tree(tree0), pack_tree(tree1)], [0, 1])


def test_shared_prefix_counts_once_per_rollout_by_hand() -> None:
    mb = shared_prefix_batch()
    # Trainable tokens in packed order: A(2) B(1) C(3) of rollout 0, then 2 of rollout 1 — A appears once.
    assert mb.loss_mask.tolist() == [False] * 3 + [True] * 3 + [False] + [True] * 3 + [False] * 2 + [True] * 2
    ratios = {3: 1.1, 4: 1.2, 5: 0.9, 7: 1.0, 8: 1.05, 9: 0.95, 12: 1.0, 13: 1.1}
    logp_old = torch.zeros(mb.num_tokens, dtype=D)
    logp_new = torch.full((mb.num_tokens,), 123.0, dtype=D)  # junk on non-trainable tokens must not matter
    for i, r in ratios.items():
        logp_new[i] = math.log(r)
    adv = t([1.0, -1.0])
    wide = {"eps_low": 0.5, "eps_high": 0.5, "is_mode": "none"}  # no clipping: loss_t = -A r_t

    # Rollout 0: -(1.1 + 1.2 + 0.9 + 1.0 + 1.05 + 0.95) = -6.2 over 6 unique tokens; rollout 1: 1.0 + 1.1 = 2.1 over 2.
    tm, _ = grpo_loss(
        logp_new, logp_old, logp_old, adv, mb.rollout_index, mb.loss_mask, LossConfig(aggregation="token_mean", **wide)
    )
    assert tm.item() == approx((-6.2 + 2.1) / 8)
    sm, _ = grpo_loss(
        logp_new,
        logp_old,
        logp_old,
        adv,
        mb.rollout_index,
        mb.loss_mask,
        LossConfig(aggregation="seq_mean_token_mean", **wide),
    )
    assert sm.item() == approx((-6.2 / 6 + 2.1 / 2) / 2)
    # Counting per root-to-leaf path instead would count A twice: paths A+B (-3.2, 3 tokens) and A+tool+C (-5.3,
    # 5 tokens) give (-8.5 + 2.1) / 10 — not what the packed tree gives.
    assert tm.item() != approx((-3.2 - 5.3 + 2.1) / 10)


def test_global_denominators_make_micro_batches_add_up() -> None:
    per_token = t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    idx = torch.tensor([0, 0, 0, 1, 2, 2])
    mask = torch.tensor([True, True, False, True, True, True])
    full_tm = aggregate(per_token, mask, idx, "token_mean")
    full_sm = aggregate(per_token, mask, idx, "seq_mean_token_mean")
    assert full_tm.item() == approx((1 + 2 + 4 + 5 + 6) / 5)
    assert full_sm.item() == approx((1.5 + 4.0 + 5.5) / 3)
    halves = (slice(0, 3), slice(3, 6))  # a rollout never straddles micro-batches
    assert sum(aggregate(per_token[h], mask[h], idx[h], "token_mean", num_tokens=5).item() for h in halves) == approx(
        full_tm.item()
    )
    assert sum(
        aggregate(per_token[h], mask[h], idx[h], "seq_mean_token_mean", num_rollouts=3).item() for h in halves
    ) == approx(full_sm.item())
    # A rollout with no trainable token is not counted as a rollout.
    assert aggregate(
        per_token, torch.tensor([True, True, True, False, False, False]), idx, "seq_mean_token_mean"
    ).item() == approx(2.0)


def test_default_aggregation_is_the_papers_per_rollout_mean() -> None:
    # ClawGym II Eq. 6: (1/G) sum_i (1/|y_i|) sum_t (...), a mean per trajectory (here: per rollout tree), then over
    # trajectories. Every way the learner gets its loss config must default to it.
    from learner.hparams import Hyperparams

    assert LossConfig().aggregation == "seq_mean_token_mean"
    assert Hyperparams().aggregation == "seq_mean_token_mean"
    assert Hyperparams().loss_config().aggregation == "seq_mean_token_mean"


def test_default_loss_is_mean_of_per_rollout_token_means_by_hand() -> None:
    # Rollout 0: a long tree, prompt -> generated A (4) -> { generated B (2) | tool (1) -> generated C (4) }: 10 unique
    # trainable tokens (A is shared by both paths and stored once; per path it would be 6 + 8 = 14).
    # Rollout 1: prompt -> 1 generated token. Token counts differ 10:1, so the two aggregations differ a lot.
    tree0 = [
        Seg(0, -1, [1, 2], False),
        Seg(1, 0, [3, 4, 5, 6], True, [-0.1] * 4),
        Seg(2, 1, [7, 8], True, [-0.1] * 2),
        Seg(3, 1, [9], False),
        Seg(4, 3, [10, 11, 12, 13], True, [-0.1] * 4),
    ]
    tree1 = [Seg(0, -1, [1], False), Seg(1, 0, [2], True, [-0.1])]
    mb = MicroBatch.from_trees([pack_tree(tree0), pack_tree(tree1)], [0, 1])
    assert mb.loss_mask.tolist() == [False] * 2 + [True] * 6 + [False] + [True] * 4 + [False] + [True]
    r0 = {2: 1.1, 3: 1.2, 4: 0.9, 5: 1.0, 6: 1.05, 7: 0.95, 9: 1.25, 10: 0.85, 11: 1.15, 12: 0.8}  # A = +1
    r1 = {14: 1.2}  # A = -1
    logp_old = torch.zeros(mb.num_tokens, dtype=D)
    logp_new = torch.zeros(mb.num_tokens, dtype=D)
    for i, r in {**r0, **r1}.items():
        logp_new[i] = math.log(r)
    # Default config: ratios lie inside [1 - 0.2, 1 + 0.28], and logp_rollout = logp_old makes the TIS weight 1, so
    # the per-token loss is -A r_t: rollout 0 gives -r_t over 10 tokens, rollout 1 gives +1.2 over 1 token.
    loss, _ = grpo_loss(logp_new, logp_old, logp_old, t([1.0, -1.0]), mb.rollout_index, mb.loss_mask)
    sum0, sum1 = -sum(r0.values()), 1.2  # -10.25, 1.2
    per_rollout_means = (sum0 / 10 + sum1 / 1) / 2  # (-1.025 + 1.2) / 2 = 0.0875
    token_mean = (sum0 + sum1) / 11  # -0.8227...
    assert loss.item() == approx(per_rollout_means)
    assert abs(loss.item() - token_mean) > 0.5
    # Counting A once per path (14 tokens in rollout 0) would give another value: the tree's shared prefix counts once.
    per_path_sum0 = sum0 - (1.1 + 1.2 + 0.9 + 1.0)
    assert loss.item() != approx((per_path_sum0 / 14 + sum1) / 2)
    # The same default on the bare aggregate and on the value loss.
    per_token = torch.where(mb.loss_mask, -torch.exp(logp_new) * t([1.0, -1.0])[mb.rollout_index], 0.0)
    assert aggregate(per_token, mb.loss_mask, mb.rollout_index).item() == approx(per_rollout_means)
    values = torch.sqrt(2.0 * per_token.abs())  # 0.5 (V - 0)^2 = |per_token|
    vloss, _ = value_loss(values, torch.zeros_like(per_token), mb.loss_mask, mb.rollout_index)
    assert vloss.item() == approx((-sum0 / 10 + sum1) / 2)


def test_config_and_input_validation() -> None:
    with pytest.raises(ConfigError, match="eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ConfigError, match="aggregation"):
        LossConfig(aggregation="seq_sum")  # type: ignore[arg-type]
    x = torch.zeros(3, dtype=D)
    with pytest.raises(LossInputError, match="loss_mask"):
        grpo_loss(x, x, x, t([1.0]), torch.zeros(3, dtype=torch.long), torch.ones(2, dtype=bool))
    with pytest.raises(LossInputError, match="rollouts"):
        grpo_loss(x, x, x, t([1.0]), torch.tensor([0, 1, 1]), torch.ones(3, dtype=bool))
    with pytest.raises(LossInputError, match="bool"):
        policy_loss(x, x, x, x, torch.zeros(3, dtype=torch.long), torch.ones(3), LossConfig())


# ---------------------------------------------------------------- reference: verl's core_algos


def _stub_modules(names: tuple[str, ...]) -> list[str]:
    """Put a stand-in module into sys.modules for each name whose top-level package is not installed."""
    tops = {name.split(".")[0] for name in names}
    absent = {top for top in tops if top not in sys.modules and importlib.util.find_spec(top) is None}
    added = []
    for name in names:
        if name.split(".")[0] in absent and name not in sys.modules:
            stub = mock.MagicMock(name=name)
            stub.__path__ = []
            stub.__spec__ = None
            sys.modules[name] = stub
            added.append(name)
    return added


@pytest.fixture(scope="module")
def verl() -> tuple[ModuleType, ModuleType, type]:
    """verl's pure loss functions (verl==0.9.1, installed with --no-deps; see the report in the dev extras).

    verl's package __init__ imports ``ray`` and ``tensordict`` (for DataProto and distributed helpers) that the loss
    functions never touch; they are heavy, so where absent they are stubbed for the import only and removed again.
    """
    if importlib.util.find_spec("verl") is None:
        pytest.skip(
            "reference library verl is not installed: pip install --no-deps verl==0.9.1 omegaconf codetiming orjson"
        )
    added = _stub_modules(("ray", "tensordict", "tensordict.tensorclass"))
    try:
        import verl.trainer.ppo.core_algos as core_algos
        import verl.trainer.ppo.rollout_corr_helper as rollout_corr
        from verl.workers.config import ActorConfig
    finally:
        for name in added:
            del sys.modules[name]
    return core_algos, rollout_corr, ActorConfig


def random_padded(seed: int) -> dict[str, torch.Tensor]:
    """(B, L) padded tensors as verl takes them, with per-row lengths, and their flat (T,) packed equivalents."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 9, 2, 7]
    b, width = len(lengths), max(lengths)
    mask2d = torch.zeros(b, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask2d[i, :n] = True
    old = -torch.rand(b, width, generator=g, dtype=D) * 3  # (B, L)
    new = old + torch.randn(b, width, generator=g, dtype=D) * 0.7  # ratios outside [0.8, 1.28], some beyond 3
    rollout = old + torch.randn(b, width, generator=g, dtype=D) * 0.8  # IS ratios beyond [1/2, 2] both sides
    ref = old + torch.randn(b, width, generator=g, dtype=D) * 0.3
    adv = torch.randn(b, generator=g, dtype=D)  # (B,)
    values = torch.randn(b, width, generator=g, dtype=D) * 0.5
    old_values = values + torch.randn(b, width, generator=g, dtype=D) * 0.3
    returns = torch.rand(b, generator=g, dtype=D)
    return {
        "mask2d": mask2d,
        "old": old,
        "new": new,
        "rollout": rollout,
        "ref": ref,
        "adv": adv,
        "values": values,
        "old_values": old_values,
        "returns": returns,
        "rollout_index": torch.arange(b)[:, None].expand(b, width)[mask2d],
    }


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("is_mode", ["tis", "masked", "none"])
def test_policy_loss_matches_verl(verl: tuple[ModuleType, ModuleType, type], aggregation: str, is_mode: str) -> None:
    core_algos, rollout_corr, actor_config = verl
    d = random_padded(3)  # a seed whose tensors hit every branch (checked at the end)
    m = d["mask2d"]
    verl_mode = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}[aggregation]
    cfg_verl = actor_config(
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        strategy="fsdp",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
    )
    weights = None
    if is_mode != "none":
        threshold = 2.0 if is_mode == "tis" else "0.5_2.0"
        weights, _ = rollout_corr.compute_rollout_correction_weights(
            d["old"] - d["rollout"], m.to(D), rollout_is="token", rollout_is_threshold=threshold
        )
    new2d = d["new"].clone().requires_grad_()
    adv2d = d["adv"][:, None].expand_as(new2d)
    ref_loss, ref_metrics = core_algos.compute_policy_loss_vanilla(
        d["old"], new2d, adv2d, m.to(D), loss_agg_mode=verl_mode, config=cfg_verl, rollout_is_weights=weights
    )
    ref_loss.backward()

    ours_cfg = LossConfig(
        eps_low=0.2, eps_high=0.28, dual_clip_c=3.0, is_mode=is_mode, is_cap=2.0, aggregation=aggregation
    )
    new_flat = d["new"][m].clone().requires_grad_()
    loss, stats = grpo_loss(
        new_flat,
        d["old"][m],
        d["rollout"][m],
        d["adv"],
        d["rollout_index"],
        torch.ones_like(new_flat, dtype=torch.bool),
        ours_cfg,
    )
    loss.backward()

    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    torch.testing.assert_close(new_flat.grad, new2d.grad[m], atol=1e-6, rtol=0)
    assert stats["clip_frac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert stats["dual_clip_frac"] == pytest.approx(ref_metrics["actor/pg_clipfrac_lower"], abs=1e-6)
    assert stats["approx_kl"] == pytest.approx(ref_metrics["actor/ppo_kl"], abs=1e-6)
    # The test has teeth: these tensors do exercise clipping and, where on, the IS correction.
    assert stats["clip_frac_low"] > 0 and stats["clip_frac_high"] > 0 and stats["dual_clip_frac"] > 0
    if is_mode == "tis":
        assert 0 < stats["is_truncated_frac"] < 1
        torch.testing.assert_close(
            importance_weights(d["old"][m], d["rollout"][m], torch.ones_like(m[m]), "tis", 2.0)[0],
            weights[m],
            atol=1e-12,
            rtol=0,
        )
    if is_mode == "masked":
        assert 0 < stats["is_masked_frac"] < 1


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("value_clip", [None, 0.2])
def test_value_loss_matches_verl(
    verl: tuple[ModuleType, ModuleType, type], value_clip: float | None, aggregation: str
) -> None:
    core_algos, _, _ = verl
    d = random_padded(11)
    m = d["mask2d"]
    v2d = d["values"].clone().requires_grad_()
    ret2d = d["returns"][:, None].expand_as(v2d)
    verl_mode = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean"}[aggregation]
    # verl always clips; a huge clip range is its plain MSE.
    ref, ref_clipfrac = core_algos.compute_value_loss(
        v2d,
        ret2d,
        d["old_values"],
        m.to(D),
        cliprange_value=1e9 if value_clip is None else value_clip,
        loss_agg_mode=verl_mode,
    )
    ref.backward()
    v = d["values"][m].clone().requires_grad_()
    ours, stats = value_loss(
        v,
        d["returns"][d["rollout_index"]],
        torch.ones_like(v, dtype=torch.bool),
        d["rollout_index"],
        old_values=d["old_values"][m],
        value_clip=value_clip,
        aggregation=aggregation,
    )
    ours.backward()
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(v.grad, v2d.grad[m], atol=1e-6, rtol=0)
    assert stats["value_clip_frac"] == pytest.approx(float(ref_clipfrac), abs=1e-6)
    if value_clip is not None:
        assert stats["value_clip_frac"] > 0


def test_k3_matches_verl_low_var_kl(verl: tuple[ModuleType, ModuleType, type]) -> None:
    core_algos, _, _ = verl
    d = random_padded(3)
    m = d["mask2d"]
    ref = core_algos.kl_penalty(d["new"], d["ref"], "low_var_kl")[m]
    ours = k3_kl(d["new"][m], d["ref"][m], torch.ones_like(m[m]))
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    expected = core_algos.agg_loss(core_algos.kl_penalty(d["new"], d["ref"], "low_var_kl"), m.to(D), "token-mean")
    ours_agg = aggregate(ours, torch.ones_like(m[m]), d["rollout_index"], "token_mean")
    assert ours_agg.item() == pytest.approx(expected.item(), abs=1e-6)
