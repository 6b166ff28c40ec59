"""The learned logit scale (learner/logit_scale.py): it is a temperature, folding it changes no logit, and the policy
gradient moves it towards the tokens the better rollouts sampled (sharper when they took the likelier tokens)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from clawbase.errors import ConfigError  # noqa: E402
from learner.forward import packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams  # noqa: E402
from learner.logit_scale import LogitScale  # noqa: E402
from learner.pack import MicroBatch, pack_tree  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import tiny_model  # noqa: E402

PROMPT = [5, 6, 7]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([PROMPT + [8, 9]])).logits[0]  # (T, V)


def test_the_scale_is_a_temperature_and_folding_it_changes_no_logit() -> None:
    model = tiny_model(3)
    plain = _logits(model)
    scale = LogitScale(model)
    with torch.no_grad():
        scale.log_scale.fill_(0.7)
    hooked = _logits(model)
    torch.testing.assert_close(hooked, plain * torch.exp(torch.tensor(0.7)), rtol=1e-5, atol=1e-5)  # T = exp(-0.7)
    factor = scale.fold()
    assert factor == pytest.approx(2.0138, abs=1e-3) and float(scale.log_scale.detach()) == 0.0
    torch.testing.assert_close(_logits(model), hooked, rtol=1e-5, atol=1e-5)
    scale.remove()  # the folded model alone, as published and served: the same logits
    torch.testing.assert_close(_logits(model), hooked, rtol=1e-5, atol=1e-5)
    assert scale.relative_gain() == pytest.approx(factor, rel=1e-5)
    assert all("log_scale" not in name for name in model.state_dict())


def _tree(model: torch.nn.Module, pick: str, n: int = 4) -> list[Seg]:
    """The prompt, then ``n`` generated tokens: each the model's likeliest (``max``) or least likely (``min``) next one,
    with the model's own logprobs as rollout logprobs (on policy)."""
    tokens = list(PROMPT)
    for _ in range(n):
        with torch.no_grad():
            last = model(torch.tensor([tokens])).logits[0, -1]  # (V,)
        tokens.append(int(last.argmax() if pick == "max" else last.argmin()))
    tree = [Seg(0, -1, list(PROMPT), False), Seg(1, 0, tokens[len(PROMPT) :], True, [0.0] * n)]
    with torch.no_grad():
        lp = packed_logprobs(model, MicroBatch.from_trees([pack_tree(tree)], [0]), only_trainable=True)  # (T,)
    tree[1].logprobs = lp[len(PROMPT) :].tolist()  # the tree's tokens in order: the prompt's, then the generated
    return tree


@pytest.mark.parametrize(("better", "sign"), [("max", 1.0), ("min", -1.0)])
def test_a_step_sharpens_when_the_better_rollout_took_the_likelier_tokens(better: str, sign: float) -> None:
    model = tiny_model(4)
    worse = "min" if better == "max" else "max"
    trees = [ScoredTree(_tree(model, better), 1.0, 1.0, "h"), ScoredTree(_tree(model, worse), -1.0, 0.0, "h")]
    config = Hyperparams(lr=1e-9, logit_scale_lr=0.05)
    scale = LogitScale(model)
    groups = [{"params": list(model.parameters())}, {"params": [scale.log_scale], "lr": config.logit_scale_lr}]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)
    gain = model.model.norm.weight.detach().clone()
    metrics = train_step(model, optimizer, trees, config)
    # AdamW's first step moves a parameter with a clear gradient by ~lr in its direction.
    assert sign * float(scale.log_scale.detach()) == pytest.approx(0.05, rel=0.05)
    assert metrics["update_adv_dot"] > 0  # and the step helped the better rollout, as any GRPO step
    factor = scale.fold()
    torch.testing.assert_close(model.model.norm.weight.detach(), gain * factor, rtol=1e-5, atol=1e-6)


def test_a_negative_lr_and_a_model_without_a_final_norm_are_refused() -> None:
    with pytest.raises(ConfigError, match="logit_scale_lr must be >= 0"):
        Hyperparams(logit_scale_lr=-1.0)
    with pytest.raises(ConfigError, match="final norm"):
        LogitScale(torch.nn.Linear(2, 2))
