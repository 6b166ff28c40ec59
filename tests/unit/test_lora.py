"""Low-rank adapters (learner/lora.py): the published version is base + scale·B·A under the model's own tensor names,
only the adapters train, the served merged weights give the learner's logprobs, and a resume continues bit for bit."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="learner tests need torch (the 'ml' extra)")
pytest.importorskip("transformers", reason="learner tests need transformers (the 'ml' extra)")

from clawbase.errors import ConfigError  # noqa: E402
from learner.forward import packed_logprobs  # noqa: E402
from learner.hparams import Hyperparams, parse_hparams  # noqa: E402
from learner.lora import LoRA, target_names  # noqa: E402
from learner.memory import step_memory  # noqa: E402
from learner.pack import pack_trees  # noqa: E402
from learner.step import ScoredTree, train_step  # noqa: E402
from learner.version_files import VersionFiles  # noqa: E402
from policy.weight_store import copy_into, load_checked, save_state_dict  # noqa: E402
from schemas.events import WeightVersion  # noqa: E402
from tests.support.segments import Seg  # noqa: E402
from tests.support.tiny_model import VOCAB, tiny_model  # noqa: E402

TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
CONFIG = Hyperparams(lora_rank=4, lora_alpha=8.0, lora_lr=1e-2)


def _with_lora(seed: int = 0, config: Hyperparams = CONFIG) -> tuple[torch.nn.Module, LoRA, torch.optim.Optimizer]:
    model = tiny_model(seed)
    lora = LoRA(model, config.lora_rank, config.lora_alpha, config.lora_targets, config.seed)
    optimizer = torch.optim.AdamW(lora.parameters(), lr=config.lora_lr, weight_decay=0.0)
    return model, lora, optimizer


def _trees(model: torch.nn.Module, seed: int, n: int = 4) -> list[ScoredTree]:
    """``n`` rollouts (a shared prompt, a generated turn, a tool output, another turn) with ±1 advantages and the
    model's own logprobs as rollout logprobs (on policy)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        toks = torch.randint(1, VOCAB - 1, (20,), generator=gen).tolist()
        tree = [Seg(0, -1, toks[:6], False), Seg(1, 0, toks[6:11], True, [0.0] * 5), Seg(2, 1, toks[11:15], False)]
        tree.append(Seg(3, 2, toks[15:], True, [0.0] * 5))
        [row] = pack_trees([tree], 4096)
        with torch.no_grad():
            lp = packed_logprobs(model, row, only_trainable=True)  # (T,)
        tree[1].logprobs, tree[3].logprobs = lp[6:11].tolist(), lp[15:].tolist()
        out.append(ScoredTree(tree, 1.0 if i % 2 == 0 else -1.0, float(i % 2 == 0), "h"))
    return out


def _logprobs(model: torch.nn.Module, trees: list[ScoredTree]) -> torch.Tensor:
    rows = pack_trees([t.segments for t in trees], 4096)
    with torch.no_grad():
        return torch.cat([packed_logprobs(model, r, only_trainable=True) for r in rows])  # (ΣT,)


def test_targets_and_hyperparameters() -> None:
    assert target_names("attention,mlp") == TARGETS and target_names("q_proj, v_proj") == {"q_proj", "v_proj"}
    assert parse_hparams(["lora_rank=8", "lora_targets=attention"]).lora_rank == 8
    with pytest.raises(ConfigError, match="lora_rank must be >= 0"):
        parse_hparams(["lora_rank=-1"])
    with pytest.raises(ConfigError, match="lora_targets='wq'.*has no such Linear"):
        LoRA(tiny_model(0), 4, 8.0, "wq")


def test_the_merged_weights_are_base_plus_scale_b_a_under_the_model_names_and_b_zero_is_the_base() -> None:
    model = tiny_model(0)
    plain = _logprobs(model, _trees(model, 1))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora = LoRA(model, 4, 8.0, "attention,mlp")
    assert torch.equal(_logprobs(model, _trees(model, 1)), plain)  # B = 0: the base's outputs, bit for bit
    assert {n.split(".")[-1] for n in lora.names} == TARGETS and len(lora.names) == 7 * 2  # 2 layers
    with torch.no_grad():
        for b in lora.lora_B:
            b.normal_()
    merged = lora.merged_state_dict(model)
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in base.items()}
    for i, name in enumerate(lora.names):
        expected = base[f"{name}.weight"] + 2.0 * lora.lora_B[i].detach() @ lora.lora_A[i].detach()  # 8 / 4 = 2
        torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
    untouched = [k for k in base if k.removesuffix(".weight") not in lora.names]
    assert untouched and all(torch.equal(merged[k], base[k]) for k in untouched)
    assert all(torch.equal(model.state_dict()[k], base[k]) for k in base)  # the model keeps its base


def test_only_the_adapters_train_and_the_published_version_changes_only_the_targets(tmp_path: Path) -> None:
    model, lora, optimizer = _with_lora()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trees = _trees(model, 2)
    metrics = train_step(model, optimizer, trees, CONFIG)
    assert metrics["optimizer_steps"] == 1 and metrics["grad_norm"] > 0
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in lora.lora_B)
    assert all(torch.equal(model.state_dict()[k], base[k]) for k in base)  # the base did not move
    saved = save_state_dict(lora.merged_state_dict(model), tmp_path, "policy", 1)
    served = tiny_model(5)  # another model of the architecture, as an engine holds it
    copy_into(served, load_checked(saved.path, served))  # the CPU engine's loader (consumers.inference.weight_follower)
    published = served.state_dict()
    changed = {k for k in base if not torch.equal(published[k], base[k])}
    assert changed == {f"{n}.weight" for n in lora.names}
    # The engine's π of the published version is the learner's π (the next step's π_old), to float rounding.
    torch.testing.assert_close(_logprobs(served, trees), _logprobs(model, trees), rtol=0, atol=2e-5)
    assert not torch.equal(_logprobs(model, trees), _logprobs(tiny_model(0), trees))  # and the step did move it


def test_the_memory_plan_counts_only_the_adapters_gradients_and_moments() -> None:
    model, lora, optimizer = _with_lora()
    rows = [(40, True, False)]
    plan = step_memory(model, optimizer, rows, checkpointing=False, chunk=256)
    adapters = sum(p.numel() for p in lora.parameters())
    assert (plan.gradients, plan.optimizer) == (4 * adapters, 8 * adapters)
    full = tiny_model(0)
    whole = step_memory(full, torch.optim.AdamW(full.parameters()), rows, checkpointing=False, chunk=256)
    assert whole.activations - plan.activations == 4 * 2 * VOCAB * 32  # no embedding/head gradient to build


class _Files(VersionFiles):
    def __init__(self, store: Path, seed: int = 0, config: Hyperparams = CONFIG) -> None:
        self.settings = SimpleNamespace(weight_store=store, model_name="policy")  # type: ignore[assignment]
        self.model, self.lora, self.optimizer = _with_lora(seed, config)
        self.value_head, self.device = None, torch.device("cpu")
        self._initial_state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}


def _event(saved: object, version: int) -> WeightVersion:
    return WeightVersion(
        policy_version=version,
        timestamp_ms=0,
        model_name="policy",
        step=version,
        uri=saved.uri,  # type: ignore[attr-defined]
        sha256=saved.sha256,  # type: ignore[attr-defined]
        size_bytes=saved.size_bytes,  # type: ignore[attr-defined]
    )


def test_a_resumed_learner_continues_bit_for_bit_and_refuses_another_base(tmp_path: Path) -> None:
    """Two steps in one learner vs one step, its version saved, and the second step in a fresh learner loaded from
    it: the same merged weights, adapters and AdamW moments, exactly (the base comes from model_dir, the adapters
    and their moments from the trainer state)."""
    straight = _Files(tmp_path)
    batches = [_trees(straight.model, 10), _trees(straight.model, 11)]
    train_step(straight.model, straight.optimizer, batches[0], CONFIG)
    v1 = _event(straight._save_version(1), 1)
    train_step(straight.model, straight.optimizer, batches[1], CONFIG)

    resumed = _Files(tmp_path, seed=0, config=Hyperparams(lora_rank=4, lora_alpha=8.0, lora_lr=1e-2, seed=7))
    resumed._load(v1)  # another adapter init (seed 7): the trainer state's adapters replace it
    train_step(resumed.model, resumed.optimizer, batches[1], CONFIG)
    a, b = straight.lora.merged_state_dict(straight.model), resumed.lora.merged_state_dict(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(straight.optimizer.state.values(), resumed.optimizer.state.values(), strict=True):
        assert torch.equal(x["exp_avg"], y["exp_avg"]) and torch.equal(x["exp_avg_sq"], y["exp_avg_sq"])

    other_base = _Files(tmp_path, seed=1)  # --model-dir is not the run's
    with pytest.raises(ConfigError, match="not --model-dir's weights plus the saved adapters"):
        other_base._load(v1)
    other_rank = _Files(tmp_path, config=Hyperparams(lora_rank=2, lora_alpha=8.0))
    with pytest.raises(ConfigError, match="not this learner's .lora_rank 2"):
        other_rank._load(v1)
