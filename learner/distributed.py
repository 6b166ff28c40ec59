"""The training step on N ranks (torch.distributed): data parallel, or FSDP2 for a policy larger than one device.

``distributed_train_step`` is ``learner.step.train_step`` over the process group: the batch is split into the same
``mini_batches`` parts, each part's whole trees are dealt to the ranks by size (``deal_trees``), every rank packs
and runs its own rows with train_step's pieces, and the update equals the 1-rank step on the whole batch
(docs/method.md#the-distributed-step): the loss is normalised by the WHOLE part's trainable-token and rollout
counts (all-reduced first), gradients are SUMMED (never averaged), clipping uses the global norm, metrics are
reduced across ranks. Data parallel: every rank holds the whole model, gradients are all-reduced. FSDP2
(``shard_policy``: ``fully_shard`` on each decoder layer and on the body): parameters, gradients and AdamW moments
are sharded; every rank runs the same number of passes (a rank short of rows runs copies with zero weight), as
FSDP's all-gathers require.

Checkpoints: ``save_sharded`` / ``load_sharded`` write and read model + optimizer + RNG with
``torch.distributed.checkpoint`` (one shard file per rank, atomic rename); ``full_state_dict`` gathers the full
weights on rank 0 for the published safetensors file (``policy.weight_store``). Rank 0 owns Kafka; this module
imports no Kafka client.

Run: on every rank, after ``torch.distributed.init_process_group`` (gloo on CPU, nccl on GPUs), call
``distributed_train_step`` with the same batch (``shard_policy`` first for FSDP2, then build the optimizer). Tested on
2 gloo CPU ranks against the 1-rank step: tests/integration/test_distributed_step.py.
"""

from __future__ import annotations

import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from clawbase.errors import ConfigError
from clawbase.faults import fault_point
from learner.forward import packed_hidden
from learner.hparams import Hyperparams
from learner.pack import MicroBatch, pack_trees
from learner.step import (
    _MAXIMA,
    _MINIMA,
    ScoredTree,
    _autocast,
    _combine,
    _fused_old,
    _logprobs,
    _old_forward,
    _reward,
    _reward_metrics,
    _row_backward,
    max_path_tokens,
    update_stats,
)
from learner.value import ValueHead

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "deal_trees",
    "distributed_train_step",
    "full_state_dict",
    "is_sharded",
    "load_sharded",
    "save_sharded",
    "shard_policy",
]


def deal_trees(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Indices of the trees each rank trains: largest first to the least-loaded rank (ties: lower index, lower rank),
    each rank's list in batch order. Deterministic, so every rank computes the same deal without talking."""
    loads = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += sizes[i]
        shares[rank].append(i)
    return [sorted(s) for s in shares]


def _tree_tokens(tree: ScoredTree) -> int:
    return sum(len(s.tokens) for s in tree.segments)


class _TiedHead(torch.nn.Module):
    """The LM head of a tied-embedding model under FSDP2: reads the embedding's weight when called, so it uses
    whatever FSDP holds there (the gathered tensor during a pass). Not a submodule of the embedding's: one parameter,
    in one FSDP group."""

    _embedding: torch.nn.Embedding

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        object.__setattr__(self, "_embedding", embedding)  # not registered: the weight stays the body's

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (C, H) -> (C, V)
        return torch.nn.functional.linear(hidden, self._embedding.weight)  # weight (V, H): gathered by FSDP


def shard_policy(model: torch.nn.Module, mesh: DeviceMesh | None = None) -> torch.nn.Module:
    """FSDP2 on a Hugging Face causal LM, in place: each decoder layer one unit, the body (embeddings, final norm)
    the root unit. The body is the root because learner.forward runs ``model.get_decoder()`` directly (no (T, V)
    logits), so the top module's forward, where a root's hooks would run, is never called; FSDP keeps the root
    gathered after its forward, so the LM head, called after the body, sees full weights. Tied embeddings: the head
    reads the embedding's weight (one parameter, one group). An untied head stays whole on every rank (its gradient
    is all-reduced like data parallel's): it runs once per LM-head chunk, a count that differs between ranks, and an
    FSDP unit's all-gathers must pair up.
    Gradients are reduce-scattered as SUMS (divide factor 1): the loss is already normalised by the global counts."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    body = model.get_decoder()  # type: ignore[operator]
    head = model.get_output_embeddings()  # type: ignore[operator]
    embedding = body.get_input_embeddings()
    if head.weight is embedding.weight:
        model.set_output_embeddings(_TiedHead(embedding))  # type: ignore[operator]
    for layer in body.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(body, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def distributed_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[ScoredTree],
    config: Hyperparams,
    value_head: ValueHead | None = None,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """``train_step`` on this process group: every rank passes the whole batch (same ``trees``, same order) and
    trains its share; returns the same metrics as the 1-rank step, reduced over the ranks (equal on every rank)."""
    if config.algorithm == "ppo" and value_head is None:
        raise ValueError("PPO needs a value head")
    if config.kl_coef > 0 and ref_model is None:
        raise ConfigError("kl_coef > 0 needs a reference policy (ref_model): the learner loads its initial model")
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = is_sharded(model)
    device = next(model.parameters()).device
    # The same parts as train_step (trees[i::mini_batches]), then each part's trees dealt to the ranks.
    global_parts = [list(range(len(trees)))[i :: config.mini_batches] for i in range(config.mini_batches)]
    global_parts = [p for p in global_parts if p]
    shares = [deal_trees([_tree_tokens(trees[i]) for i in gp], world)[rank] for gp in global_parts]
    parts = [[trees[gp[j]] for j in share] for gp, share in zip(global_parts, shares, strict=True)]
    max_path = max_path_tokens(model, config)

    def pack(part: Sequence[ScoredTree]) -> list[MicroBatch]:
        if not part:
            return []
        rows = pack_trees(
            [t.segments for t in part], config.token_budget, max_path, share_prefix_min=config.share_prefix_min
        )
        return [r.to(device) for r in rows]

    rows = [pack(part) for part in parts]
    real = [len(rs) for rs in rows]  # rows past these are padding (FSDP2)
    if sharded:  # FSDP's all-gathers pair up across ranks: every rank runs as many passes as the busiest one
        most = _all_reduce([float(n) for n in real], dist.ReduceOp.MAX)
        for i, gp in enumerate(global_parts):
            if len(rows[i]) < int(most[i]):
                spare = rows[i][0] if rows[i] else pack([trees[gp[0]]])[0]
                rows[i] += [spare] * (int(most[i]) - len(rows[i]))

    entropy = [0.0, 0]
    scratch = [0.0, 0]  # padding rows' entropy: dropped
    fused = _fused_old(model, config, len(parts))
    old: list[list[tuple[torch.Tensor, torch.Tensor | None] | None]]
    if fused:
        old = [[None] * len(rs) for rs in rows]
    else:
        model.eval()
        with torch.no_grad(), _autocast(device):
            old = [
                [_old_forward(model, value_head, r, config, entropy if j < n else scratch) for j, r in enumerate(rs)]
                for rs, n in zip(rows, real, strict=True)
            ]
    ref: list[list[torch.Tensor | None]] = [[None] * len(rs) for rs in rows]
    if config.kl_coef > 0 and ref_model is not None:
        with torch.no_grad(), _autocast(device):
            ref = [[_logprobs(ref_model, r, config) for r in rs] for rs in rows]

    model.train()
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = 0
    per_rollout_of: list[torch.Tensor] = []
    for part, part_rows, n_real, part_old, part_ref, gp in zip(parts, rows, real, old, ref, global_parts, strict=True):
        # (R_part,) a rollout's trainable tokens over its rows: all on this rank (a tree is never split over ranks)
        per_rollout = torch.zeros(len(part), dtype=torch.float32, device=device)
        for row in part_rows[:n_real]:
            per_rollout.index_add_(0, row.rollout_index, row.loss_mask.float())
        per_rollout_of.append(per_rollout)
        local_tokens = int(per_rollout.sum())
        n_tokens = int(_all_reduce([float(local_tokens)], dist.ReduceOp.SUM)[0])  # the WHOLE part's count
        if n_tokens == 0:
            continue  # on every rank alike: the count is global
        n_rollouts = len(gp)  # the whole part's rollouts, as train_step's len(part)
        if config.algorithm == "ppo":
            targets = torch.tensor([_reward(t) for t in part], dtype=torch.float32, device=device)  # (R_part,)
        else:
            targets = torch.tensor(
                [t.advantage if t.advantage >= 0 else t.advantage * config.neg_adv_scale for t in part],
                dtype=torch.float32,
                device=device,
            )  # (R_part,)
        optimizer.zero_grad(set_to_none=True)
        part_stats: dict[str, float] = {}
        for i, row in enumerate(part_rows):
            if i >= n_real:  # padding: the body's passes and FSDP's collectives of a row, with zero gradient
                with _autocast(device):
                    (packed_hidden(model, row).sum() * 0.0).backward()  # (T, H) -> scalar 0
                continue
            stats, used_old = _row_backward(
                model,
                value_head,
                row,
                part_old[i],
                targets,
                config,
                n_tokens,
                n_rollouts,
                per_rollout,
                entropy,
                part_ref[i],
            )
            part_old[i] = used_old
            _combine(part_stats, stats, float(row.loss_mask.sum()) / n_tokens)
        for key, value in _reduce_stats(part_stats).items():
            sums[key] += value
        _sum_replicated_grads(optimizer)
        norm = _clip_global(optimizer, config.max_grad_norm)  # the whole gradient's: one decision on every rank
        sums["grad_norm"] += norm
        if config.skip_zero_grad and norm == 0.0:
            skipped += 1  # as train_step: a zero gradient would still move every weight through AdamW's momentum
        else:
            optimizer.step()
        fault_point("learner.in_step")
        steps += 1

    metrics = {key: value / max(steps, 1) for key, value in sums.items()}
    trained_s = time.perf_counter() - started
    model.eval()
    with torch.no_grad(), _autocast(device):
        after = [[_logprobs(model, r, config) for r in rs] for rs in rows]
    metrics.update(_update_stats(parts, rows, real, old, after, per_rollout_of, config.algorithm == "grpo"))
    counts = _all_reduce(
        [
            entropy[0],
            float(entropy[1]),
            float(sum(r.num_tokens for rs, n in zip(rows, real, strict=True) for r in rs[:n])),
            float(sum(int(r.loss_mask.sum()) for rs, n in zip(rows, real, strict=True) for r in rs[:n])),
            float(sum(real)),
        ],
        dist.ReduceOp.SUM,
    )
    if counts[1]:
        metrics["entropy"] = counts[0] / counts[1]
    if sharded:  # the root stays gathered after a forward pass: give the memory back between steps
        _reshard(model)
    elapsed = time.perf_counter() - started
    metrics.update(
        {
            "optimizer_steps": float(steps - skipped),
            "skipped_steps": float(skipped),
            "rollouts": float(len(trees)),
            "micro_batches": counts[4],
            "tokens": counts[2],
            "trainable_tokens": counts[3],
            "tokens_per_s": counts[2] / trained_s,
            "step_seconds": elapsed,
            "update_stats_seconds": elapsed - trained_s,
            "ranks": float(world),
        }
    )
    metrics.update(_reward_metrics(trees))
    return metrics


def _all_reduce(values: list[float], op: dist.ReduceOp.RedOpType) -> list[float]:
    # float64: token counts stay exact, sums of statistics lose nothing to the transport
    t = torch.tensor(values, dtype=torch.float64)  # (K,)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _reduce_stats(stats: dict[str, float]) -> dict[str, float]:
    """A part's row statistics over the ranks. Each rank's are already shares of the whole part (additive terms
    normalised by the global counts, means weighted by row tokens / global tokens): they add; extremes stay extremes.
    A rank without rows contributes nothing."""
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, stats)
    out: dict[str, float] = {}
    for one in gathered:
        for key, value in (one or {}).items():
            if key in _MAXIMA:
                out[key] = max(out.get(key, value), value)
            elif key in _MINIMA:
                out[key] = min(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0.0) + value
    return out


def _sum_replicated_grads(optimizer: torch.optim.Optimizer) -> None:
    """All-reduce (SUM) the gradients of every parameter that is not an FSDP shard (data parallel: all of them; FSDP2:
    a value head, say). A rank without rows has no gradient (None): it adds zeros; a parameter no rank touched keeps
    None, as in the 1-rank step (AdamW skips it)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if not isinstance(p, DTensor)]
    if not params:
        return
    has = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float32)  # (P,)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    touched = [p for p, h in zip(params, has.tolist(), strict=True) if h]
    if not touched:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in touched])  # (N,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in touched:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def _clip_global(optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clip by the norm of the WHOLE gradient (torch's clip_grad_norm_ formula): an FSDP shard's squares are summed
    over the ranks, a replicated gradient (already summed) counts once. Returns the norm before clipping."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return 0.0
    shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
    full = [g for g in grads if not isinstance(g, DTensor)]
    sq = torch.zeros((), dtype=torch.float32)
    if shards:
        sq = sq + torch.stack([torch.linalg.vector_norm(g) ** 2 for g in shards]).sum()
    sq = sq.reshape(1)  # (1,)
    if dist.get_world_size() > 1 and any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    if full:
        sq = sq + torch.stack([torch.linalg.vector_norm(g) ** 2 for g in full]).sum()
    norm = float(sq.sqrt())
    if max_norm > 0:  # a non-finite norm poisons the gradients as torch's does (min(nan, 1.0) is nan)
        coef = min(max_norm / (norm + 1e-6), 1.0)
        for g in grads:
            g.mul_(coef)
    return norm


def _update_stats(
    parts: Sequence[Sequence[ScoredTree]],
    rows: Sequence[Sequence[MicroBatch]],
    real: Sequence[int],
    old: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None] | None]],
    after: Sequence[Sequence[torch.Tensor]],
    per_rollout: Sequence[torch.Tensor],  # per part: (R_part,) trainable tokens of each local rollout
    grpo: bool,
) -> dict[str, float]:
    """train_step's update statistics over all ranks: each rank's means, weighted by what they average over."""
    local = update_stats(
        parts,
        [rs[:n] for rs, n in zip(rows, real, strict=True)],
        [cast(list[tuple[torch.Tensor, torch.Tensor | None]], list(o[:n])) for o, n in zip(old, real, strict=True)],
        [a[:n] for a, n in zip(after, real, strict=True)],
        grpo=grpo,
    )
    n_tok = float(sum(float(c.sum()) for c in per_rollout))
    n_dots = float(sum(int((c > 0).sum()) for c in per_rollout))
    n_signed = float(
        sum(
            sum(1 for t, k in zip(part, c.tolist(), strict=True) if k > 0 and t.advantage != 0.0)
            for part, c in zip(parts, per_rollout, strict=True)
        )
    )
    weights = {"update_kl": n_tok, "update_kl_k3": n_tok, "update_adv_dot": n_dots, "update_sign_agreement": n_signed}
    keys = list(weights)
    totals = _all_reduce(
        [local.get(k, 0.0) * weights[k] for k in keys] + [weights[k] if k in local else 0.0 for k in keys],
        dist.ReduceOp.SUM,
    )
    out = {}
    for i, key in enumerate(keys):
        weight = totals[len(keys) + i]
        if key.startswith("update_kl"):
            out[key] = totals[i] / max(weight, 1.0)  # train_step's kl_sum / max(n_tok, 1)
        elif weight > 0:  # train_step leaves them out when nothing was averaged
            out[key] = totals[i] / weight
    return out


def _reshard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights on CPU, on rank 0 (other ranks: {}); a collective, every rank calls it. For the
    published version: one safetensors file, as the inference engines load it (policy.weight_store)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    return state if dist.get_rank() == 0 else {}


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Model + optimizer (+ RNG) with torch.distributed.checkpoint: each rank writes its own shards. Written under
    ``<path>.partial`` and renamed by rank 0 once every rank is done, so ``path`` is never half a checkpoint."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    if dist.get_rank() == 0 and partial.exists():
        shutil.rmtree(partial)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "torch_rng": torch.get_rng_state()}, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        if path.exists():  # an unpublished checkpoint of this version from a run that crashed before its commit
            shutil.rmtree(path)
        partial.rename(path)
    dist.barrier()


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Read back what :func:`save_sharded` wrote into this (equally sharded) model and optimizer, and the RNG."""
    model_state, optim_state = get_state_dict(model, optimizer)
    rng = torch.get_rng_state()
    dcp.load({"model": model_state, "optim": optim_state, "torch_rng": rng}, checkpoint_id=Path(path))  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    torch.set_rng_state(rng)
