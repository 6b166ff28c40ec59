"""What a training step reports about itself (issue #13: "print the real loss"): the entropy of π_old at the trained
tokens, the KL between the policy before and after the step on the batch's own samples, and whether the step moved
each rollout's logprobs in its advantage's direction. Every number is recomputed here by hand from a plain causal
forward pass of each rollout (no packing), before and after the step, on a tiny random Qwen3 in fp32."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from learner.hparams import Hyperparams  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402


def _chain(base: int, logprobs: list[float] | None = None) -> list[Seg]:
    """prompt [b b+1 b+2] -> generated [b+3 b+4 b+5 b+6] (trainable)."""
    gen = [base + 3, base + 4, base + 5, base + 6]
    return [Seg(0, -1, [base, base + 1, base + 2], False), Seg(1, 0, gen, True, logprobs or [0.0] * len(gen))]


def _by_hand(model: torch.nn.Module, tree: list[Seg]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs (4,), entropies (4,)) of the generated tokens from one plain causal forward pass."""
    ids = [t for s in tree for t in s.tokens]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (L, V)
    logq = torch.log_softmax(logits.float(), dim=-1)[2:-1]  # positions predicting tokens 3..6
    target = torch.tensor(ids[3:])
    return logq.gather(-1, target[:, None])[:, 0], -(logq.exp() * logq).sum(-1)


def _on_policy(model: torch.nn.Module, base: int) -> list[Seg]:
    """A chain whose recorded rollout logprobs are the model's own (TIS weights 1)."""
    tree = _chain(base)
    tree[1].logprobs = _by_hand(model, tree)[0].tolist()
    return tree


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_step_reports_entropy_kl_and_the_direction_it_moved(sign: float) -> None:
    model = tiny_model(3, "sdpa")
    before = copy.deepcopy(model)
    trees = [_on_policy(model, 10), _on_policy(model, 40), _on_policy(model, 70)]
    advantages = [sign * 1.2, -sign * 0.8, 0.0]
    scored = [ScoredTree(t, a, None, "h") for t, a in zip(trees, advantages, strict=True)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    metrics = train_step(model, optimizer, scored, Hyperparams(token_budget=64, max_grad_norm=0.0))

    old = [_by_hand(before, t) for t in trees]
    new = [_by_hand(model, t) for t in trees]
    entropy = torch.cat([h for _, h in old]).mean()
    assert metrics["entropy"] == pytest.approx(float(entropy), rel=1e-4)
    deltas = [n - o for (n, _), (o, _) in zip(new, old, strict=True)]  # (4,) each: log π_new − log π_old
    kl = float(-torch.cat(deltas).mean())
    assert abs(kl) > 1e-6, "the step did not move the policy: the test proves nothing"
    assert metrics["update_kl"] == pytest.approx(kl, rel=1e-3, abs=1e-7)
    kl3 = float(torch.cat([torch.exp(d) - 1 - d for d in deltas]).mean())
    assert metrics["update_kl_k3"] == pytest.approx(kl3, rel=1e-3, abs=1e-8)
    means = [float(d.mean()) for d in deltas]
    dot = sum(a * m for a, m in zip(advantages, means, strict=True)) / 3
    assert metrics["update_adv_dot"] == pytest.approx(dot, rel=1e-3)
    # A small policy-gradient step raises the logprobs of the positive-advantage rollout and lowers the negative one.
    assert means[0] * sign > 0 and means[1] * sign < 0
    assert metrics["update_adv_dot"] > 0 and metrics["update_sign_agreement"] == 1.0


def test_a_step_that_does_nothing_reports_no_movement() -> None:
    model = tiny_model(3, "sdpa")
    trees = [_on_policy(model, 10), _on_policy(model, 40)]
    scored = [ScoredTree(t, a, None, "h") for t, a in zip(trees, [1.0, -1.0], strict=True)]
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), scored, Hyperparams(token_budget=64))
    assert metrics["update_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["update_adv_dot"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["update_sign_agreement"] == 0.0  # nothing moved, so nothing moved the right way
    assert metrics["entropy"] > 0


def test_one_update_per_batch_reuses_the_gradient_pass_as_pi_old(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one GRPO update per batch π_old comes from the gradient pass itself; the step must be the one a separate
    π_old pass gives (same loss, statistics and weights), with the off-policy correction still applied."""
    import learner.step as step

    results = []
    for fused in (True, False):
        monkeypatch.setattr(step, "_fused_old", lambda *_a, fused=fused: fused)
        model = tiny_model(3, "sdpa")
        trees = [_on_policy(model, 10), _on_policy(model, 40), _chain(70, [-20.0] * 4)]  # 3rd: off-policy (capped)
        scored = [ScoredTree(t, a, None, "h") for t, a in zip(trees, [1.0, -0.5, 0.7], strict=True)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
        metrics = train_step(model, optimizer, scored, Hyperparams(token_budget=64))
        results.append((metrics, torch.cat([p.detach().reshape(-1) for p in model.parameters()])))
    (fused_m, fused_w), (plain_m, plain_w) = results
    for key in ("loss", "policy_loss", "is_weight_mean", "is_truncated_frac", "entropy", "update_kl", "ratio_mean"):
        assert fused_m[key] == pytest.approx(plain_m[key], rel=1e-5, abs=1e-8), key
    assert fused_m["is_truncated_frac"] > 0  # the off-policy rollout's weights were capped: TIS is in effect
    torch.testing.assert_close(fused_w, plain_w, rtol=1e-5, atol=1e-7)
