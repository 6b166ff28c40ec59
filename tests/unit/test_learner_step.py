"""Learner pieces without Kafka: batch collection, the weight store, and one real training step on a tiny model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from learner.forward import packed_logprobs
from learner.hparams import Hyperparams
from learner.pack import pack_trees
from learner.step import ScoredTree, train_step
from learner.train import BatchCollector, parse_hparams
from policy.weight_store import WeightsRejected, copy_into, load_checked, save_weights, verify_file
from schemas.events import Trajectory, WeightVersion
from tests.support.learner_data import batch_records, branching_trajectory, small_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _load(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")


def test_batch_collector_seals_and_never_commits_past_an_open_batch() -> None:
    a, b = batch_records("A", 1, 2, seed=0), batch_records("B", 2, 2, seed=1)
    collector = BatchCollector()
    # A0 B0 A1 B1 A-seal B-seal, at offsets 10..15
    order = [a[0], b[0], a[1], b[1], a[2], b[2]]
    sealed = [collector.add(10 + i, rec) for i, rec in enumerate(order)]
    assert sealed[:4] == [None] * 4
    first, second = sealed[4], sealed[5]
    assert first.batch_id == "A" and len(first.records) == 2 and first.commit_offset == 11  # B still open at 11
    assert second.batch_id == "B" and second.commit_offset == 16 and not collector.pending


def test_weight_store_round_trip_and_rejections(model_dir: Path, tmp_path: Path) -> None:
    model = _load(model_dir)
    saved = save_weights(model, tmp_path / "store", "policy", 3)
    assert saved.path.parent.name == "v000003" and len(saved.sha256) == 64

    def event(**kw: object) -> WeightVersion:
        fields = {
            "policy_version": 3,
            "timestamp_ms": 0,
            "model_name": "policy",
            "step": 3,
            "uri": saved.uri,
            "sha256": saved.sha256,
            "size_bytes": saved.size_bytes,
            **kw,
        }
        return WeightVersion(**fields)  # type: ignore[arg-type]

    other = _load(model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    copy_into(other, load_checked(verify_file(event()), other))
    for (name, p), q in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(WeightsRejected, match="sha256") as info:
        verify_file(event(sha256="0" * 64))
    assert info.value.kind == "checksum_mismatch"
    with pytest.raises(WeightsRejected) as info:
        verify_file(event(uri=(tmp_path / "nope.safetensors").as_uri()))
    assert info.value.kind == "missing_file"


def test_train_step_moves_logprobs_with_the_advantage(model_dir: Path) -> None:
    torch.manual_seed(0)
    model = _load(model_dir)
    rng = np.random.default_rng(0)
    good, bad = branching_trajectory("good", rng), branching_trajectory("bad", rng)
    # Rollout logprobs = the current policy's, so TIS weights are 1 and only the advantage sign matters.
    for traj in (good, bad):
        [row] = pack_trees([traj.segments], 4096)
        with torch.no_grad():
            lp = packed_logprobs(model, row, only_trainable=True)
        offset = 0
        for seg in traj.segments:
            n = len(seg.tokens)
            if seg.trainable:
                seg.logprobs = lp[offset : offset + n].numpy().astype("<f4")
            offset += n
    trees = [ScoredTree(good.segments, 1.0, 1.0, "agentloop"), ScoredTree(bad.segments, -1.0, 0.0, "other")]

    def mean_lp(traj: Trajectory) -> float:
        [row] = pack_trees([traj.segments], 4096)
        with torch.no_grad():
            lp = packed_logprobs(model, row, only_trainable=True)
        return float(lp[row.loss_mask].mean())

    before = mean_lp(good), mean_lp(bad)
    config = Hyperparams(lr=3e-3, mini_batches=2)
    metrics = train_step(model, torch.optim.AdamW(model.parameters(), lr=config.lr), trees, config)
    after = mean_lp(good), mean_lp(bad)
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["optimizer_steps"] == 2 and metrics["rollouts"] == 2
    assert metrics["reward/agentloop"] == 1.0 and metrics["reward/other"] == 0.0
    assert metrics["trainable_tokens"] == 2 * 18 and np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_hparams_parse_and_name_the_field() -> None:
    config = parse_hparams(["lr=0.5", "is_mode=masked", "betas=0.8,0.9", "mini_batches=3"])
    assert config.lr == 0.5 and config.is_mode == "masked" and config.betas == (0.8, 0.9) and config.mini_batches == 3
    from clawbase.errors import ConfigError

    with pytest.raises(ConfigError, match="NAME one of"):
        parse_hparams(["learning_rate=1"])
    with pytest.raises(ConfigError, match="mini_batches"):
        parse_hparams(["mini_batches=x"])


def test_value_pretraining_fits_rewards_and_ppo_step_trains_policy_and_head(model_dir: Path) -> None:
    from learner.value import ValueHead, policy_and_values, pretrain_value

    torch.manual_seed(0)
    model = _load(model_dir)
    rng = np.random.default_rng(3)
    trajs = [branching_trajectory(f"r{i}", rng) for i in range(4)]
    rewards = [1.0, 0.0, 1.0, 0.0]
    head = ValueHead.for_model(model)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    losses = pretrain_value(
        model, head, [(t.segments, r) for t, r in zip(trajs, rewards, strict=True)], steps=150, lr=2e-2, log_every=0
    )
    assert losses[-1] < 0.5 * losses[0]  # V(s) ≈ R: from 0.25 (V = 0) down
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())  # the policy stayed frozen

    config = Hyperparams(algorithm="ppo", lr=1e-3)
    head_before = head.proj.weight.detach().clone()
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=config.lr)
    trees = [ScoredTree(t.segments, 0.0, r, "h") for t, r in zip(trajs, rewards, strict=True)]
    metrics = train_step(model, optimizer, trees, config, head)
    assert np.isfinite(metrics["loss"]) and metrics["value_loss"] > 0
    assert not torch.equal(head.proj.weight, head_before)  # the value head learns during PPO
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())  # and so does the policy
    [row] = pack_trees([trajs[0].segments], 4096)
    logp, values = policy_and_values(model, head, row)
    assert logp.shape == values.shape == (row.num_tokens,)
    with pytest.raises(ValueError, match="value head"):
        train_step(model, optimizer, trees, config, None)


def test_kl_term_pulls_the_policy_back_toward_the_reference(model_dir: Path) -> None:
    """kl_coef > 0: the step computes the reference policy's logprobs and the k3 KL's gradient moves toward it."""
    from clawbase.errors import ConfigError

    torch.manual_seed(0)
    ref, model = _load(model_dir), _load(model_dir)
    with torch.no_grad():  # the policy has drifted from the reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    traj = branching_trajectory("t", np.random.default_rng(5))
    [row] = pack_trees([traj.segments], 4096)

    def ref_gap() -> float:  # mean |log π − log π_ref| on the sampled tokens
        with torch.no_grad():
            a, b = packed_logprobs(model, row, only_trainable=True), packed_logprobs(ref, row, only_trainable=True)
        return float((a - b)[row.loss_mask].abs().mean())

    # Zero advantage: the policy-gradient term is 0, so only the KL term can move the policy.
    trees = [ScoredTree(traj.segments, 0.0, 1.0, "h")]
    config = Hyperparams(lr=1e-3, kl_coef=1.0, is_mode="none")
    with pytest.raises(ConfigError, match="reference policy"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), trees, config)
    before = ref_gap()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    metrics = [train_step(model, optimizer, trees, config, ref_model=ref) for _ in range(5)]
    assert metrics[0]["ref_kl"] > 0 and metrics[-1]["ref_kl"] < metrics[0]["ref_kl"]
    assert ref_gap() < before


def test_lr_warmup_is_linear_then_constant() -> None:
    config = Hyperparams(lr=1e-3, lr_warmup_steps=4)
    assert [config.lr_at(k) for k in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert Hyperparams(lr=1e-3).lr_at(0) == 1e-3
    assert parse_hparams(["lr_warmup_steps=3"]).lr_warmup_steps == 3


def test_neg_adv_scale_zero_trains_as_if_negative_advantages_were_zero(model_dir: Path) -> None:
    from clawbase.errors import ConfigError

    rng = np.random.default_rng(7)
    good, bad = branching_trajectory("good", rng), branching_trajectory("bad", rng)

    def trained(advantages: tuple[float, float], **hp: float) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = _load(model_dir)
        trees = [ScoredTree(good.segments, advantages[0], 1.0, "h"), ScoredTree(bad.segments, advantages[1], 0.0, "h")]
        config = Hyperparams(lr=1e-2, is_mode="none", **hp)
        train_step(model, torch.optim.SGD(model.parameters(), lr=config.lr), trees, config)
        return model.state_dict()

    scaled, zeroed, plain = trained((1.0, -1.0), neg_adv_scale=0.0), trained((1.0, 0.0)), trained((1.0, -1.0))
    assert all(torch.allclose(scaled[k], zeroed[k]) for k in scaled)
    assert any(not torch.allclose(scaled[k], plain[k]) for k in scaled)  # the negative rollout did count in GRPO
    with pytest.raises(ConfigError, match="neg_adv_scale"):
        Hyperparams(neg_adv_scale=-1.0)


@pytest.mark.parametrize("skip", [True, False])
def test_a_mini_batch_with_nothing_to_learn_moves_no_weight(model_dir: Path, skip: bool) -> None:
    """All advantages 0 (GRPO, kl_coef 0): the gradient is exactly 0, yet AdamW's momentum from an earlier step would
    move every weight; skip_zero_grad (the default) skips that optimizer step. skip=False shows the test can fail."""
    torch.manual_seed(0)
    model = _load(model_dir)
    rng = np.random.default_rng(0)
    good, bad = branching_trajectory("good", rng), branching_trajectory("bad", rng)
    config = Hyperparams(lr=1e-3, skip_zero_grad=skip)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    learned = [ScoredTree(good.segments, 1.0, 1.0, "agentloop"), ScoredTree(bad.segments, -1.0, 0.0, "agentloop")]
    assert train_step(model, optimizer, learned, config)["optimizer_steps"] == 1  # momentum now non-zero

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    flat = [ScoredTree(good.segments, 0.0, 1.0, "agentloop"), ScoredTree(bad.segments, 0.0, 1.0, "agentloop")]
    metrics = train_step(model, optimizer, flat, config)
    assert metrics["grad_norm"] == 0.0
    moved = max(float((p.detach() - weights[name]).abs().max()) for name, p in model.named_parameters())
    if skip:
        assert moved == 0.0 and metrics["optimizer_steps"] == 0 and metrics["skipped_steps"] == 1
    else:  # the step AdamW takes on a zero gradient: most of a real one
        assert moved > 0.5 * config.lr and metrics["optimizer_steps"] == 1 and metrics["skipped_steps"] == 0


def test_boolean_hparams_parse_their_words() -> None:
    assert parse_hparams(["skip_zero_grad=false"]).skip_zero_grad is False
    assert parse_hparams(["skip_zero_grad=On"]).skip_zero_grad is True
    with pytest.raises(Exception, match="skip_zero_grad: 'maybe' is not a valid bool"):
        parse_hparams(["skip_zero_grad=maybe"])
