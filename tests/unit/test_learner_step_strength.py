"""Strong checks of one training step (issue 17 part 7): each test fails on a specific, plausible bug.

- π_old is computed once, with the weights at the START of the step, for every mini-batch;
- the TIS weight min(exp(logp_old - logp_rollout), c) really multiplies each token's loss (and is capped at c);
- the model is fed exactly the trees' unique tokens (shared prefixes once) at their root-path depths;
- a PPO step moves V towards R and the policy in the direction of R - V.

All on a tiny random Qwen3 (tests/support/tiny_model.py) in fp32 on the CPU, with readable token ids. Segments carry
no sampling attributes, so logprobs are at temperature 1.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from learner.forward import packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.losses import grpo_loss  # noqa: E402
from learner.pack import MicroBatch, pack_tree, pack_trees  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from learner.value import ValueHead, policy_and_values  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402

SEED = 7
ATTN = "sdpa"
# AdamW eps above the default 1e-8: a parameter with a ~0 gradient then moves by ~lr g / eps, not by ~±lr on round-off.
EPS = 1e-6


def _model() -> torch.nn.Module:
    return tiny_model(SEED, ATTN)


def _branching_tree(base: int) -> list[Seg]:
    """prompt [b b+1 b+2] -> gen [b+3 b+4 b+5] -> tool [b+6] -> gen [b+7 b+8]; retry gen [b+9 b+10] off the prompt."""
    return [
        Seg(0, -1, [base, base + 1, base + 2], False),
        Seg(1, 0, [base + 3, base + 4, base + 5], True, [0.0] * 3),
        Seg(2, 1, [base + 6], False),
        Seg(3, 2, [base + 7, base + 8], True, [0.0] * 2),
        Seg(4, 0, [base + 9, base + 10], True, [0.0] * 2),
    ]


def _set_rollout_logprobs(model: torch.nn.Module, tree: list[Seg], offsets: list[float]) -> None:
    """Rollout logprob of each trainable token := the model's own logprob + the next offset (cycled)."""
    row = MicroBatch.from_trees([pack_tree(tree)], [0])
    with torch.no_grad():
        lp = packed_logprobs(model, row, only_trainable=True).tolist()
    start, k = 0, 0
    for s in tree:
        n = len(s.tokens)
        if s.trainable:
            s.logprobs = []
            for t in range(n):
                s.logprobs.append(lp[start + t] + offsets[k % len(offsets)])
                k += 1
        start += n


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _relative_update_error(got: torch.nn.Module, want: torch.nn.Module, start: torch.Tensor) -> float:
    """||θ_got - θ_want|| / ||θ_want - θ_start||: how far apart two updates from ``start`` end, relative to their size.

    (Not an element-wise max: AdamW divides by sqrt(v), so a parameter whose gradient is ~0 moves by ~±lr on
    round-off alone, and that noise would swamp an element-wise comparison of two exact implementations.)"""
    want_flat = _flat(want)
    return float((_flat(got) - want_flat).norm() / (want_flat - start).norm())


# ------------------------------------------------------------------------------------------- 1. π_old once


def _reference_grpo_step(
    trees: list[ScoredTree], config: Hyperparams, *, recompute_old: bool
) -> tuple[torch.nn.Module, float]:
    """A hand-written mini-batched GRPO step: parts trees[0::2], trees[1::2], each packed into ONE row (no gradient
    accumulation), π_old from the initial weights (or, ``recompute_old``, from the weights before each part — the
    bug), clipped AdamW steps. Returns the trained model and the mean over parts of the ratio mean."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, eps=EPS)
    parts = [trees[0::2], trees[1::2]]
    rows = [pack_trees([t.segments for t in part], 10_000)[0] for part in parts]
    with torch.no_grad():
        old = [packed_logprobs(model, row, only_trainable=True) for row in rows]
    ratio_means = []
    for k, (part, row) in enumerate(zip(parts, rows, strict=True)):
        if recompute_old:
            with torch.no_grad():
                old[k] = packed_logprobs(model, row, only_trainable=True)
        optimizer.zero_grad(set_to_none=True)
        new = packed_logprobs(model, row, only_trainable=True)
        advantages = torch.tensor([t.advantage for t in part])
        loss, stats = grpo_loss(
            new, old[k], row.rollout_logprobs, advantages, row.rollout_index, row.loss_mask, config.loss_config()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], config.max_grad_norm)
        optimizer.step()
        ratio_means.append(stats["ratio_mean"])
    return model, sum(ratio_means) / len(ratio_means)


def test_pi_old_is_computed_once_with_the_initial_weights_for_every_mini_batch() -> None:
    """Catches π_old being recomputed (after the first optimizer step) before the second mini-batch's update."""
    config = Hyperparams(lr=1e-2, mini_batches=2, token_budget=16)  # 11-token trees: one tree per row
    model = _model()
    start = _flat(model)
    advantages = [1.0, -1.0, -0.5, 0.7]
    trees = []
    for i, adv in enumerate(advantages):
        tree = _branching_tree(10 + 11 * i)
        _set_rollout_logprobs(model, tree, [0.3, -0.2, 0.0, 0.1])
        trees.append(ScoredTree(tree, adv, None, "h"))

    metrics = train_step(model, torch.optim.AdamW(model.parameters(), lr=config.lr, eps=EPS), trees, config)
    assert metrics["optimizer_steps"] == 2 and metrics["micro_batches"] == 4  # two rows accumulated per part

    once, ratio_once = _reference_grpo_step(trees, config, recompute_old=False)
    recomputed, ratio_recomputed = _reference_grpo_step(trees, config, recompute_old=True)
    err = _relative_update_error(model, once, start)
    power = _relative_update_error(recomputed, once, start)
    print(f"relative update error: train_step {err:.1e}, the recomputed-π_old reference {power:.1e}")
    assert err < 1e-3
    assert power > 0.1  # the bug's update is far outside the tolerance: the comparison discriminates
    # Part 2 is trained against the initial weights' logprobs, so its ratio π_new/π_old is not 1; recomputing π_old
    # would make it exactly 1 for both parts.
    assert ratio_recomputed == pytest.approx(1.0, abs=1e-6)
    assert abs(ratio_once - 1.0) > 1e-2
    assert metrics["ratio_mean"] == pytest.approx(ratio_once, abs=1e-4)


# ------------------------------------------------------------------------------------------- 2. TIS applied


class _GradRecorder(torch.optim.SGD):
    """An optimizer that leaves the weights alone (lr 0) and keeps a copy of the gradients of every step."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=0.0)
        self.grads: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self._params()])
        return super().step(closure)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]


def _chain(segments: list[tuple[list[int], bool]]) -> list[Seg]:
    return [
        Seg(i, i - 1, toks, trainable, [0.0] * len(toks) if trainable else [])
        for i, (toks, trainable) in enumerate(segments)
    ]


def _plain_trainable_logprobs(model: torch.nn.Module, tree: list[Seg]) -> torch.Tensor:
    """(K,) logprobs of a chain's trainable tokens from one plain causal forward (no packing, no tree mask)."""
    ids = torch.tensor([t for s in tree for t in s.tokens])  # (L,)
    trainable = torch.tensor([s.trainable for s in tree for _ in s.tokens])  # (L,)
    trainable[0] = False
    logits = model(input_ids=ids[None]).logits[0].float()  # (L, V)
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]  # (L - 1,): token k from logits[k-1]
    return lp[trainable[1:]]


def test_tis_weight_min_ratio_cap_multiplies_each_tokens_loss() -> None:
    """Catches TIS weights left at 1 (rollout logprobs ignored) or applied without the cap c (or at the wrong place)."""
    model = _model()
    trees = [
        _chain([([10, 11, 12], False), ([13, 14, 15, 16], True), ([17], False), ([18, 19], True)]),
        _chain([([30, 31], False), ([32, 33, 34], True)]),
    ]
    advantages = [1.0, -0.6]
    # log(π_old / π_rollout) per trainable token; exp(d) = 1.65, 4.5, 0.37, 20, 1, 0.74 | 12, 1.2, 0.14 (cap c = 2).
    log_ratios = [[0.5, 1.5, -1.0, 3.0, 0.0, -0.3], [2.5, 0.2, -2.0]]
    with torch.no_grad():
        model_lp = [_plain_trainable_logprobs(model, tree) for tree in trees]
    for tree, lp, d in zip(trees, model_lp, log_ratios, strict=True):
        rollout = iter((lp - torch.tensor(d)).tolist())
        for s in tree:
            if s.trainable:
                s.logprobs = [next(rollout) for _ in s.tokens]

    config = Hyperparams(max_grad_norm=0.0)  # no clipping: the recorded gradient is the loss's own
    recorder = _GradRecorder(list(model.parameters()))
    scored = [ScoredTree(tree, adv, None, "h") for tree, adv in zip(trees, advantages, strict=True)]
    metrics = train_step(model, recorder, scored, config)
    assert metrics["micro_batches"] == 1 and len(recorder.grads) == 1

    def hand(weight) -> tuple[float, list[torch.Tensor]]:  # noqa: ANN001
        """seq_mean_token_mean of -A w_t r_t at r_t = 1 (one update: π_new = π_old), and its gradient."""
        model.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for tree, adv, d in zip(trees, advantages, log_ratios, strict=True):
            w = weight(torch.tensor(d).exp())  # (K,)
            lp = _plain_trainable_logprobs(model, tree)  # (K,), with grad
            ratio = torch.exp(lp - lp.detach())  # 1, with the gradient of logp
            total = total + (-adv * w * ratio).mean() / len(trees)
        total.backward()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return float(total.detach()), grads

    loss, grads = hand(lambda rho: rho.clamp(max=config.is_cap))
    loss_no_is, grads_no_is = hand(torch.ones_like)
    loss_no_cap, grads_no_cap = hand(lambda rho: rho)
    assert metrics["loss"] == pytest.approx(loss, abs=1e-5)
    assert metrics["policy_loss"] == pytest.approx(loss, abs=1e-5)
    for got, want in zip(recorder.grads[0], grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    norm = float(torch.cat([g.reshape(-1) for g in grads]).norm())
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    # The statistics say the same: 3 of 9 tokens truncated, the largest weight is the cap.
    assert metrics["is_truncated_frac"] == pytest.approx(3 / 9) and metrics["is_weight_max"] == pytest.approx(2.0)
    # Power: weights of 1, or uncapped weights, give a loss and a gradient far outside the tolerances above.
    for wrong_loss, wrong_grads in ((loss_no_is, grads_no_is), (loss_no_cap, grads_no_cap)):
        assert abs(wrong_loss - loss) > 0.05
        assert max(float((a - b).abs().max()) for a, b in zip(wrong_grads, grads, strict=True)) > 1e-2


# ------------------------------------------------------------------------------------------- 3. tokens fed


def _record_inputs(model: torch.nn.Module) -> tuple[list[dict[str, torch.Tensor]], torch.utils.hooks.RemovableHandle]:
    """Record the input_ids / position_ids / attention_mask of every forward call of ``model``'s body (a pre-hook on
    ``get_decoder()``: the learner runs the body, then only the wanted positions through the LM head)."""
    calls: list[dict[str, torch.Tensor]] = []

    def hook(module, args, kwargs):  # noqa: ANN001, ANN202, ARG001
        assert not args, "packing passes the model keyword arguments"
        calls.append({k: kwargs.get(k) for k in ("input_ids", "position_ids", "attention_mask")})

    return calls, model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)


def _retry_tree() -> list[Seg]:
    # prompt [10 11 12] -> gen [20 21] -> tool [30] -> gen [31 32]
    #                   -> gen [40 41 42]              (a retry of the first turn: the prompt is shared, stored once)
    return [
        Seg(0, -1, [10, 11, 12], False),
        Seg(1, 0, [20, 21], True, [-1.0, -1.0]),
        Seg(2, 1, [30], False),
        Seg(3, 2, [31, 32], True, [-1.0, -1.0]),
        Seg(4, 0, [40, 41, 42], True, [-1.0, -1.0, -1.0]),
    ]


def _short_chain() -> list[Seg]:
    return [Seg(0, -1, [50, 51], False), Seg(1, 0, [60, 61, 62], True, [-1.0, -1.0, -1.0])]


# The row: the longer tree first (first-fit decreasing), i.e. the retry tree (input index 1), then the chain (0).
EXPECTED_IDS = [10, 11, 12, 20, 21, 30, 31, 32, 40, 41, 42, 50, 51, 60, 61, 62]
EXPECTED_POSITIONS = [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 0, 1, 2, 3, 4]


def _check_fed(call: dict[str, torch.Tensor]) -> None:
    assert call["input_ids"].tolist() == [EXPECTED_IDS]
    assert call["position_ids"].tolist() == [EXPECTED_POSITIONS]
    assert call["attention_mask"] is not None, "a branching tree needs the tree mask, not the model's causal one"
    allowed = call["attention_mask"][0, 0] == 0  # (T, T) additive mask: 0 where attention is allowed
    at = {t: i for i, t in enumerate(EXPECTED_IDS)}
    sees = {t: {EXPECTED_IDS[j] for j in allowed[at[t]].nonzero()[:, 0].tolist()} for t in EXPECTED_IDS}
    assert sees[42] == {10, 11, 12, 40, 41, 42}  # the retry sees the shared prompt, never the other branch
    assert sees[32] == {10, 11, 12, 20, 21, 30, 31, 32}
    assert sees[62] == {50, 51, 60, 61, 62}  # the second tree sees only itself


def test_model_is_fed_the_unique_tree_tokens_at_their_root_path_depths() -> None:
    """Catches the model being fed duplicated prefixes, another token order or arange positions (not tree depths)."""
    model = _model()
    trees = [_short_chain(), _retry_tree()]
    [row] = pack_trees(trees, 64)
    assert row.tree_indices == (1, 0)
    calls, handle = _record_inputs(model)
    try:
        with torch.no_grad():
            packed_logprobs(model, row)
        assert len(calls) == 1
        _check_fed(calls[0])

        calls.clear()
        scored = [ScoredTree(tree, adv, None, "h") for tree, adv in zip(trees, [1.0, -1.0], strict=True)]
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), scored, Hyperparams(token_budget=64))
        assert len(calls) == 2  # the gradient pass (its policy is π_old), then π_new (no grad: update stats)
        for call in calls:
            _check_fed(call)
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------- 4. PPO direction


def test_ppo_step_moves_values_to_returns_and_policy_with_the_advantage() -> None:
    """Catches a PPO step whose advantage is not R - V_old (sign flipped, or R alone: both returns here are > 0),
    or whose value loss does not pull V towards R."""
    model = _model()
    head = ValueHead.for_model(model)
    with torch.no_grad():
        head.proj.bias.fill_(1.5)  # V = 1.5 everywhere: R - V = +0.5 for the good rollout, -0.5 for the bad one
    good, bad = _branching_tree(10), _branching_tree(40)
    for tree in (good, bad):
        _set_rollout_logprobs(model, tree, [0.0])  # on-policy rollouts: TIS weights 1
    returns = {"good": 2.0, "bad": 1.0}

    def measure() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per rollout: (logprobs, values) of its trainable tokens, (7,) each."""
        out = {}
        for name, tree in (("good", good), ("bad", bad)):
            row = MicroBatch.from_trees([pack_tree(tree)], [0])
            with torch.no_grad():
                logp, values = policy_and_values(model, head, row)
            out[name] = (logp[row.loss_mask], values[row.loss_mask])
        return out

    before = measure()
    optimizer = torch.optim.AdamW(
        [
            {"params": list(model.parameters()), "lr": 3e-3},
            {"params": list(head.parameters()), "lr": 1e-2},
        ]
    )
    scored = [ScoredTree(good, 0.0, returns["good"], "h"), ScoredTree(bad, 0.0, returns["bad"], "h")]
    metrics = train_step(model, optimizer, scored, Hyperparams(algorithm="ppo"), head)
    after = measure()
    assert metrics["optimizer_steps"] == 1
    assert metrics["value_loss"] == pytest.approx(0.5 * 0.5**2, rel=1e-5)  # 0.5 (V - R)^2 at V_old = 1.5
    assert metrics["advantage_mean"] == pytest.approx(0.0, abs=1e-6)  # +0.5 on 7 tokens, -0.5 on 7
    for name, r in returns.items():
        # Each rollout's values moved towards its return: the mean |V - R| over its trainable tokens shrank. (Not token
        # by token: the head is linear in shared hidden states, so one Adam step can overshoot a few tokens; on 30
        # seeds of the tiny model the mean always shrank (by 0.007 to 0.18, from 0.5) but some token did not on 17.)
        assert float((after[name][1] - r).abs().mean()) < float((before[name][1] - r).abs().mean()), name
    assert float(after["good"][0].mean()) > float(before["good"][0].mean())  # R - V > 0: logprobs raised
    assert float(after["bad"][0].mean()) < float(before["bad"][0].mean())  # R - V < 0: logprobs lowered


def test_loss_metrics_do_not_depend_on_how_many_rows_a_part_is_packed_into() -> None:
    """A row's loss is its share of the part's loss: summed over rows, not token-averaged (the reported loss
    shrank with the number of rows before)."""
    results = {}
    for budget in (11, 1000):  # 11-token trees: one per row, or all four in one row
        model = _model()
        trees = []
        for i, adv in enumerate([1.0, -1.0, -0.5, 0.7]):
            tree = _branching_tree(10 + 11 * i)
            _set_rollout_logprobs(model, tree, [0.3, -0.2, 0.0, 1.0])  # one above the cap: is_weight_max is 2
            trees.append(ScoredTree(tree, adv, None, "h"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        results[budget] = train_step(model, optimizer, trees, Hyperparams(token_budget=budget))
    assert results[11]["micro_batches"] > 1 == results[1000]["micro_batches"]
    for key in ("loss", "policy_loss", "ratio_mean", "is_weight_mean", "is_weight_max"):
        assert abs(results[11][key] - results[1000][key]) < 1e-5, key
