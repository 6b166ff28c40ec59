"""The training step's N-rank pieces (torch.distributed): data parallel, or FSDP2 for a policy larger than one device.

``learner.step.train_step`` is the one training step for any number of ranks; ``GroupReduction`` is what it does
differently on a process group, and the update equals the 1-rank step on the whole batch
(docs/method.md#the-distributed-step): each part's whole trees are dealt to the ranks by size (``deal_trees``), the
loss is normalised by the WHOLE part's trainable-token and rollout counts (all-reduced first), gradients are SUMMED
(never averaged), clipping uses the global norm, metrics are reduced across ranks. Data parallel: every rank holds the
whole model, gradients are all-reduced. FSDP2 (``shard_policy``: ``fully_shard`` on each decoder layer and on the
body): parameters, gradients and AdamW moments are sharded; every rank runs the same number of passes (a rank short
of rows runs copies with zero weight), as FSDP's all-gathers require.

Checkpoints: ``save_sharded`` / ``load_sharded`` write and read model + optimizer + RNG with
``torch.distributed.checkpoint`` (one shard file per rank, atomic rename); ``full_state_dict`` gathers the full
weights on rank 0 for the published safetensors file (``policy.weight_store``). Rank 0 owns Kafka; this module
imports no Kafka client.

Run: on every rank, after ``torch.distributed.init_process_group`` (gloo on CPU, nccl on GPUs), call
``train_step(..., reduction=GroupReduction())`` with the same batch (``shard_policy`` first for FSDP2, then build the
optimizer). Tested on 2 gloo CPU ranks against the 1-rank step: tests/integration/test_distributed_step.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
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
from learner import lora
from learner.pack import MicroBatch
from learner.reduce import Reduction, combine

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "GroupReduction",
    "deal_trees",
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
    Gradients are reduce-scattered as SUMS (divide factor 1): the loss is already normalised by the global counts.
    A model with LoRA adapters is refused (learner/lora.py: LoRA trains data parallel)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if lora.attached(model):  # the merge and the resume's check read whole weights (learner/lora.py)
        raise ConfigError(lora.SHARDED)
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


class GroupReduction(Reduction):
    """``learner.step.train_step``'s reduction over this process group (docs/method.md#the-distributed-step): each
    part's whole trees dealt to the ranks by size, counts and statistics all-reduced, gradients SUMMED (never
    averaged) and clipped by the whole gradient's norm; under FSDP2 every rank runs as many rows as the busiest."""

    def share(self, sizes: Sequence[int]) -> list[int]:
        return deal_trees(sizes, dist.get_world_size())[dist.get_rank()]

    def sum(self, values: list[float]) -> list[float]:
        return _all_reduce(values, dist.ReduceOp.SUM)

    def stats(self, stats: dict[str, float]) -> dict[str, float]:
        return _reduce_stats(stats)

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        _sum_replicated_grads(optimizer)
        return _clip_global(optimizer, max_norm)

    def lockstep(self, model: torch.nn.Module) -> bool:
        return is_sharded(model)

    def pad(self, rows: list[MicroBatch], spare: Callable[[], list[MicroBatch]]) -> list[MicroBatch]:
        most = int(_all_reduce([float(len(rows))], dist.ReduceOp.MAX)[0])
        if len(rows) >= most:
            return []
        return [rows[0] if rows else spare()[0]] * (most - len(rows))

    def finish(self, model: torch.nn.Module) -> dict[str, float]:
        if is_sharded(model):  # the root stays gathered after a forward pass: give the memory back between steps
            _reshard(model)
        return {"ranks": float(dist.get_world_size())}


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
        combine(out, one or {})
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
