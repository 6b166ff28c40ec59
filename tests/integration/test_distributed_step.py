"""The training step on 2 gloo CPU ranks (learner.step.train_step with learner.distributed.GroupReduction) equals the
1-rank step: data parallel and FSDP2, and a resume from a sharded checkpoint continues exactly as an uninterrupted run.

One spawn of 2 ranks runs every case and writes the gathered full weights; the 1-rank references run in this
process. Cases: SGD without clipping (a gradient's scale error shows one to one: e.g. ranks that average instead of
summing, or normalise by their own counts), SGD with token_mean and clipping active in two mini-batches (the global
token count, the global norm), AdamW in four mini-batches (the optimizer the learner uses), PPO with its value head
(a replicated parameter beside the FSDP shards), and rows that share their prompt's keys and values (kv_share: each
rank trains its paths' groups; FSDP2, whose ranks run in lockstep, trains them row by row). LoRA, data parallel:
every rank attaches the same adapters (same seed), only they train (all-reduced, clipped by their global norm), and
rank 0's merged weights equal the 1-rank LoRA step's; FSDP2 and LoRA refuse each other, naming the fix.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from clawbase.errors import ConfigError
from learner.hparams import Hyperparams
from learner.lora import LoRA
from learner.precision import load_policy
from learner.step import ScoredTree, train_step
from learner.value import ValueHead
from tests.support.learner_data import branching_trajectory, small_model

pytestmark = pytest.mark.integration
WORLD = 2
TOLERANCE = 1e-5
# SGD's lr is large because the tiny model's gradient norm is ~5e-3: the update must dwarf the tolerance. "sgd" packs
# one tree a row (token_budget 60): the ranks have 4 and 3 rows, so FSDP2 pads one; "adamw" has 4 parts of
# 2, 2, 2 and 1 trees: one rank has no tree in the last part.
CASES: dict[str, tuple[dict, str]] = {
    "sgd": ({"lr": 50.0, "max_grad_norm": 0.0, "token_budget": 60}, "sgd"),
    "sgd_clip_token_mean": ({"lr": 50.0, "max_grad_norm": 1e-3, "aggregation": "token_mean", "mini_batches": 2}, "sgd"),
    "adamw": ({"lr": 1e-3, "mini_batches": 4}, "adamw"),
    "ppo": ({"algorithm": "ppo", "lr": 5.0, "max_grad_norm": 0.0, "mini_batches": 2}, "sgd"),  # + a value head
    # The 5-segment trees (2 and 5: one on each rank) are over the budget: their two paths are rows of their own
    # that share the 24-token prompt, one kv_share group per rank.
    "kv_share": ({"lr": 50.0, "max_grad_norm": 0.0, "token_budget": 40, "kv_share_min": 16}, "sgd"),
}
# LoRA in 2 mini-batches (B = 0 at first: the first trains B, the second A too), clipping of the adapters active.
LORA = {"lora_rank": 4, "lora_lr": 5e-3, "lora_targets": "q_proj,v_proj,down_proj", "mini_batches": 2}
LORA_CLIP = 1e-3


def _trees(seed: int, n: int = 7) -> list[ScoredTree]:
    """``n`` scored trees (an odd count: the ranks' shares differ), advantages of both signs and different sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        traj = branching_trajectory(f"r{seed}-{i}", rng)
        segments = traj.segments[: 3 + i % 3]  # 3, 4 or 5 segments: trees of different sizes
        out.append(ScoredTree(segments, float(rng.normal()), float(i % 2), "h"))
    return out


def _flat(trees: list[ScoredTree]) -> list[ScoredTree]:
    """The same trees with every advantage 0: groups solved alike, nothing to learn."""
    return [ScoredTree(t.segments, 0.0, t.reward, t.harness) for t in trees]


def _optimizer(kind: str, params: list[torch.nn.Parameter], config: Hyperparams) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    return torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _head(model: torch.nn.Module, config: Hyperparams) -> ValueHead | None:
    return ValueHead.for_model(model) if config.algorithm == "ppo" else None  # zero-initialised: the same everywhere


def _params(model: torch.nn.Module, head: ValueHead | None) -> list[torch.nn.Parameter]:
    return list(model.parameters()) + (list(head.parameters()) if head is not None else [])


def _untie(model_dir: Path, out: Path) -> Path:
    """The test model with a separate LM head (as Qwen3-8B and larger have), different from the embeddings."""
    model = load_policy(model_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach() * 1.5)
    model.save_pretrained(out)
    return out


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from learner.distributed import GroupReduction, full_state_dict, load_sharded, save_sharded, shard_policy
    from policy.weight_store import save_state_dict

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    out = Path(out_dir)
    group = GroupReduction()

    def step(
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trees: list[ScoredTree],
        config: Hyperparams,
        head: ValueHead | None = None,
    ) -> dict[str, float]:
        return train_step(model, optimizer, trees, config, head, reduction=group)

    def fresh(mode: str, kind: str, config: Hyperparams) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = load_policy(model_dir)
        if mode == "fsdp2":
            shard_policy(model)
        return model, _optimizer(kind, list(model.parameters()), config)

    def keep(name: str, model: torch.nn.Module, metrics: dict[str, float], head: ValueHead | None = None) -> None:
        state = full_state_dict(model)
        if rank == 0:
            state.update({f"value_head.{k}": v for k, v in (head.state_dict() if head is not None else {}).items()})
            torch.save({"state": state, "metrics": metrics}, out / f"{name}.pt")

    try:
        for mode in ("dp", "fsdp2"):
            for case, (hp, kind) in CASES.items():
                config = Hyperparams(**hp)
                model = load_policy(model_dir)
                if mode == "fsdp2":
                    shard_policy(model)
                head = _head(model, config)
                optimizer = _optimizer(kind, _params(model, head), config)
                metrics = step(model, optimizer, _trees(0), config, head)
                keep(f"{mode}-{case}", model, metrics, head)
        lora_case(rank, model_dir, out, step)
        # Nothing to learn (every advantage 0) after a real step: FSDP2 + AdamW skip all four optimizer steps alike.
        config = Hyperparams(**CASES["adamw"][0])
        model, optimizer = fresh("fsdp2", "adamw", config)
        step(model, optimizer, _trees(0), config)
        keep("fsdp2-adamw-flat", model, step(model, optimizer, _flat(_trees(0)), config))
        config = Hyperparams(**CASES["sgd"][0])  # FSDP2 with an untied head (kept whole on every rank)
        model = load_policy(out / "untied")
        shard_policy(model)
        optimizer = _optimizer("sgd", list(model.parameters()), config)
        keep("fsdp2-untied", model, step(model, optimizer, _trees(0), config))
        # Resume (FSDP2, AdamW): batch 0, a sharded checkpoint and the published full weights, then batch 1; a
        # fresh model and optimizer loaded from the checkpoint train batch 1 again.
        config = Hyperparams(**CASES["adamw"][0])
        model, optimizer = fresh("fsdp2", "adamw", config)
        step(model, optimizer, _trees(0), config)
        save_sharded(model, optimizer, out / "ckpt-v1")
        state = full_state_dict(model)
        if rank == 0:
            save_state_dict(state, out / "store", "policy", 1)
        keep("uninterrupted", model, step(model, optimizer, _trees(1), config))
        model, optimizer = fresh("fsdp2", "adamw", config)
        load_sharded(model, optimizer, out / "ckpt-v1")
        keep("resumed", model, step(model, optimizer, _trees(1), config))
    finally:
        dist.destroy_process_group()


def _lora(model: torch.nn.Module, config: Hyperparams) -> tuple[LoRA, torch.optim.Optimizer]:
    """The adapters and their AdamW, as learner.train.Learner builds them (its own seed: the same on every rank)."""
    adapters = LoRA(model, config.lora_rank, config.lora_alpha, config.lora_targets, config.seed)
    groups = [{"params": list(adapters.parameters()), "lora": True}]
    optimizer = torch.optim.AdamW(groups, lr=config.lora_lr, betas=config.betas, weight_decay=config.weight_decay)
    return adapters, optimizer


def lora_case(rank: int, model_dir: str, out: Path, step: Callable[..., dict[str, float]]) -> None:
    """Data parallel LoRA (rank 0 keeps the merged weights), then FSDP2 and LoRA each refusing the other."""
    from learner.distributed import shard_policy

    config = Hyperparams(**LORA, max_grad_norm=LORA_CLIP)
    model = load_policy(model_dir)
    adapters, optimizer = _lora(model, config)
    metrics = step(model, optimizer, _trees(0), config)
    refusals = []
    try:
        shard_policy(model)
    except ConfigError as exc:
        refusals.append(str(exc))
    sharded = shard_policy(load_policy(model_dir))
    try:
        _lora(sharded, config)
    except ConfigError as exc:
        refusals.append(str(exc))
    if rank == 0:
        torch.save(
            {"state": adapters.merged_state_dict(model), "metrics": metrics, "refusals": refusals}, out / "dp-lora.pt"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Runs every 2-rank case once; the directory of their results. Kills its processes, by pid, whatever happens."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    _untie(model_dir, out / "untied")
    context = mp.start_processes(
        _worker, args=(_free_port(), str(model_dir), str(out)), nprocs=WORLD, join=False, start_method="spawn"
    )
    try:
        deadline = time.monotonic() + 240
        while not context.join(timeout=1):
            assert time.monotonic() < deadline, "the 2-rank run did not finish in 240 s"
    finally:
        for process in context.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)
    return out


def test_fsdp2_with_an_untied_head_equals_one_rank(ranks: Path) -> None:
    reference, _ = _one_rank(ranks / "untied", "sgd")
    got = torch.load(ranks / "fsdp2-untied.pt", weights_only=True)["state"]
    assert set(got) == set(reference)  # lm_head.weight is its own tensor here
    assert not torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    diff = _max_diff(got, reference)
    print(f"fsdp2 untied head: max |2 ranks - 1 rank| = {diff:.2e}")
    assert diff < TOLERANCE


def _one_rank(model_dir: Path, case: str, batches: tuple[int, ...] = (0,)) -> tuple[dict, dict[str, float]]:
    hp, kind = CASES[case]
    config = Hyperparams(**hp)
    torch.set_num_threads(1)
    model = load_policy(model_dir)
    head = _head(model, config)
    optimizer = _optimizer(kind, _params(model, head), config)
    metrics = {}
    for seed in batches:
        metrics = train_step(model, optimizer, _trees(seed), config, head)
    state = model.state_dict()
    state.update({f"value_head.{k}": v for k, v in (head.state_dict() if head is not None else {}).items()})
    return state, metrics


def _max_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over the tensors both name (a gathered FSDP2 state names the tied head once)."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if k in b)


@pytest.mark.parametrize("mode", ["dp", "fsdp2"])
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_rank(ranks: Path, model_dir: Path, mode: str, case: str) -> None:
    reference, ref_metrics = _one_rank(model_dir, case)
    initial = load_policy(model_dir).state_dict()
    got = torch.load(ranks / f"{mode}-{case}.pt", weights_only=True)
    assert set(got["state"]) <= set(reference) and "model.embed_tokens.weight" in got["state"]
    moved = _max_diff(reference, initial)
    assert moved > 100 * TOLERANCE  # the step moved the weights far more than the tolerance
    diff = _max_diff(got["state"], reference)
    print(f"{mode} {case}: max |2 ranks - 1 rank| = {diff:.2e} (the step moved weights up to {moved:.2e})")
    assert diff < TOLERANCE
    metrics = got["metrics"]
    assert metrics["ranks"] == WORLD
    lockstep_only = {"kv_shared_tokens"} if mode == "fsdp2" else set()  # FSDP2 trains kv_share groups row by row
    assert set(metrics) - {"ranks"} == set(ref_metrics) - lockstep_only
    for key in (
        "loss",
        "policy_loss",
        "grad_norm",
        "update_kl",
        "clip_frac",
        "is_weight_max",
        "value_loss",
        "update_adv_dot",
    ):
        if key in ref_metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-7), key
    for key in ("trainable_tokens", "rollouts", "optimizer_steps", "update_sign_agreement", "kv_shared_tokens"):
        if key in metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-9, abs=1e-7), key
    if case == "ppo":
        assert float(reference["value_head.proj.weight"].abs().max()) > 100 * TOLERANCE  # the value head learned
    if case == "kv_share":
        assert ref_metrics["kv_shared_tokens"] == 2 * 23  # 2 groups, each sharing the prompt less one token
    if case == "sgd_clip_token_mean":
        assert ref_metrics["grad_norm"] > 2 * CASES[case][0]["max_grad_norm"]  # clipping was active


def test_a_batch_with_nothing_to_learn_moves_no_weight_on_any_rank(ranks: Path) -> None:
    """AdamW's momentum from the first step would move every shard on the second's zero gradient; every rank skips."""
    after_first = torch.load(ranks / "fsdp2-adamw.pt", weights_only=True)["state"]
    got = torch.load(ranks / "fsdp2-adamw-flat.pt", weights_only=True)
    assert got["metrics"]["grad_norm"] == 0.0
    assert got["metrics"]["skipped_steps"] == 4 and got["metrics"]["optimizer_steps"] == 0
    diff = _max_diff(got["state"], after_first)
    print(f"fsdp2 adamw, a batch of zero advantages after a real one: max |moved| = {diff:.2e}")
    assert diff < TOLERANCE


def test_resume_from_a_sharded_checkpoint_continues_exactly(ranks: Path, model_dir: Path) -> None:
    from safetensors.torch import load_file

    from policy.weight_store import version_path

    uninterrupted = torch.load(ranks / "uninterrupted.pt", weights_only=True)["state"]
    resumed = torch.load(ranks / "resumed.pt", weights_only=True)["state"]
    diff = _max_diff(resumed, uninterrupted)
    reference, _ = _one_rank(model_dir, "adamw", (0, 1))  # 1 rank, the same two batches
    print(f"resume: max |resumed - uninterrupted| = {diff:.2e}, vs 1 rank {_max_diff(uninterrupted, reference):.2e}")
    assert diff < TOLERANCE and _max_diff(uninterrupted, reference) < TOLERANCE
    # The checkpoint's AdamW moments matter: batch 1 from v1's weights with fresh moments lands elsewhere.
    after_first, _ = _one_rank(model_dir, "adamw", (0,))
    config = Hyperparams(**CASES["adamw"][0])
    model = load_policy(model_dir)
    model.load_state_dict(after_first)
    train_step(model, _optimizer("adamw", list(model.parameters()), config), _trees(1), config)
    assert _max_diff(model.state_dict(), uninterrupted) > 100 * TOLERANCE
    # The published version is one full safetensors file, as a 1-rank learner writes it (tied head once).
    published = load_file(str(version_path(ranks / "store", "policy", 1)))
    assert "lm_head.weight" not in published and _max_diff(published, after_first) < TOLERANCE


def test_lora_on_two_ranks_equals_one_rank(ranks: Path, model_dir: Path) -> None:
    """Every rank's adapters the same, their gradients summed over the ranks and clipped by the global norm: rank 0's
    merged weights are the 1-rank LoRA step's; the base stays model_dir's outside the targets."""
    config = Hyperparams(**LORA, max_grad_norm=LORA_CLIP)
    torch.set_num_threads(1)
    model = load_policy(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    adapters, optimizer = _lora(model, config)
    ref_metrics = train_step(model, optimizer, _trees(0), config)
    reference = adapters.merged_state_dict(model)
    got = torch.load(ranks / "dp-lora.pt", weights_only=True)
    assert set(got["state"]) == set(reference)
    moved = _max_diff(reference, initial)
    assert moved > 100 * TOLERANCE and ref_metrics["grad_norm"] > 2 * LORA_CLIP  # clipping was active
    diff = _max_diff(got["state"], reference)
    print(f"dp lora: max |2 ranks - 1 rank| = {diff:.2e} (the step moved merged weights up to {moved:.2e})")
    assert diff < TOLERANCE
    for key in ("loss", "grad_norm", "update_kl"):
        assert got["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-7), key
    assert got["metrics"]["optimizer_steps"] == ref_metrics["optimizer_steps"] == 2
    untouched = [k for k in reference if not any(t in k for t in ("q_proj", "v_proj", "down_proj"))]
    assert _max_diff({k: got["state"][k] for k in untouched}, initial) == 0.0
    assert len(got["refusals"]) == 2 and all("data parallel" in r and "lora_rank" in r for r in got["refusals"])
