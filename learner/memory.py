"""What a training step needs in memory, from the model's shape and the packed rows: the learner's pre-step check.

A step holds the fp32 master weights, the gradients and AdamW's two moments of what the optimizer trains (16 bytes per
trained parameter, 4 per frozen one: LoRA's base, learner/lora.py; a KL reference model adds 4), and, for the longest
micro-batch row of T tokens, the activations its backward pass needs.
Per token and decoder layer a Qwen/Llama-style layer keeps ≈ 10 H + 4 I + 3 (q + 2 kv) floats (norms, projections,
RoPE, attention, SwiGLU; H hidden, I intermediate, q/kv the query and key/value widths); with activation
checkpointing a layer keeps ≈ 2 H (its input, then its input's gradient) and one layer is recomputed at a time.
The body's ends and the backward pass's working set add ≈ 12 H + 4 I per token; the chunked LM head 5 × chunk × V
floats (9 with top-k/top-p, learner/forward.py); the embedding's and head's gradients 2 V H as they are built (none
when frozen); a tree row's dense mask 2 T². Checked against measured peak RSS in bench/results/learner_memory.md
(docs/method.md).

The learner compares the estimate (× ``SAFETY``) with the memory it may use before any parameter changes: a batch
that cannot fit is dead-lettered with this module's explanation, never an OOM kill. Pure: no Kafka.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FLOAT = 4  # bytes: activations are counted in fp32 (bf16 autocast on CUDA keeps norms and the head in fp32)
SAFETY = 1.25  # the estimate's margin over the formula (bench/results/learner_memory.md); allocators fragment
GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The figures of a decoder-only LM that its training memory depends on."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    q_width: int  # attention heads × head dim
    kv_width: int  # key/value heads × head dim
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelShape:
        config: Any = getattr(model, "config", None)
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(
            parameters=sum(p.numel() for p in model.parameters()),
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
            q_width=heads * head_dim,
            kv_width=kv_heads * head_dim,
            vocab=int(config.vocab_size),
        )

    def layer_floats(self) -> int:
        """Activation floats one layer keeps per token for its backward pass (no checkpointing)."""
        return 10 * self.hidden + 4 * self.intermediate + 3 * (self.q_width + 2 * self.kv_width)


def activation_bytes(
    shape: ModelShape,
    tokens: int,
    *,
    tree: bool,
    checkpointing: bool,
    chunk: int,
    top_k_or_p: bool = False,
    embedding_grads: bool = True,
) -> int:
    """Peak activation memory of one row's forward + backward (bytes): the formula in the module docstring."""
    per_layer = 2 * shape.hidden if checkpointing else shape.layer_floats()
    recomputed = shape.layer_floats() if checkpointing else 0
    ends = 12 * shape.hidden + 4 * shape.intermediate
    floats = tokens * (shape.layers * per_layer + recomputed + ends)
    floats += (9 if top_k_or_p else 5) * min(chunk, tokens) * shape.vocab
    if embedding_grads:  # the embedding's and the head's gradient, each built before it is added
        floats += 2 * shape.vocab * shape.hidden
    if tree:
        floats += 2 * tokens * tokens  # the (T, T) additive mask, and one more of its size in attention's backward
    return FLOAT * floats


@dataclass(frozen=True)
class StepMemory:
    """One step's estimate: what is still to be allocated beside what the learner already holds."""

    activations: int  # the largest row's
    gradients: int  # 0 when the gradient buffers already exist
    optimizer: int  # 0 once AdamW's moments exist
    row_tokens: int
    checkpointing: bool

    @property
    def needed(self) -> int:
        return int(SAFETY * (self.activations + self.gradients + self.optimizer))

    def explain(self) -> str:
        return (
            f"≈ {self.needed / GIB:.2f} GiB ({SAFETY:g} × (activations of a {self.row_tokens:,}-token row "
            f"{self.activations / GIB:.2f} GiB{' with' if self.checkpointing else ' without'} activation checkpointing"
            f" + gradients {self.gradients / GIB:.2f} + AdamW moments {self.optimizer / GIB:.2f}))"
        )


def step_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[tuple[int, bool, bool]],  # per row: (tokens, is a tree (dense mask), uses top-k/top-p)
    *,
    checkpointing: bool,
    chunk: int,
) -> StepMemory:
    """The estimate for training ``rows`` (learner.pack's micro-batches) on ``model`` in its current state."""
    shape = ModelShape.of(model)
    hf: Any = model  # a transformers PreTrainedModel (nn.Module's __getattr__ types its methods as tensors)
    embedding = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    trains_embedding = embedding is None or bool(embedding.weight.requires_grad)  # frozen under LoRA
    acts, longest = 0, 0
    for tokens, tree, sampled in rows:
        need = activation_bytes(
            shape,
            tokens,
            tree=tree,
            checkpointing=checkpointing,
            chunk=chunk,
            top_k_or_p=sampled,
            embedding_grads=trains_embedding,
        )
        if need > acts:
            acts, longest = need, tokens
    # What the optimizer trains (the model's weights, or LoRA's adapters on a frozen base; a value head, a logit scale)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params if p.grad is None)
    moments = sum(2 * p.numel() * p.element_size() for p in params if p not in optimizer.state)
    return StepMemory(acts, grads, moments, longest, checkpointing)


def available_bytes(device: torch.device) -> int:
    """Memory a step may still allocate: CUDA's free memory plus what torch reserved and does not use; on the CPU
    MemAvailable, or less when a cgroup (a container's limit) leaves less."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    avail = _meminfo_kib("MemAvailable") * 1024
    cgroup = _cgroup_room()
    return min(avail, cgroup) if cgroup is not None else avail


def _meminfo_kib(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // 1024  # not Linux


def _cgroup_room() -> int | None:
    """cgroup v2: memory.max − memory.current of this process's cgroup; None without a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class StepPlan:
    """Whether to checkpoint activations for a step, or why the step cannot run (``refusal``)."""

    checkpointing: bool
    estimate: StepMemory
    limit: int
    refusal: str | None = None


def plan_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rows: list[tuple[int, bool, bool]],
    *,
    mode: str,  # "auto" | "on" | "off" (LearnerSettings.activation_checkpointing)
    limit: int,  # bytes the step may allocate
    chunk: int,
) -> StepPlan:
    """auto: checkpoint only when the step would not fit without; a step that fits in neither way is refused."""
    can = bool(getattr(model, "supports_gradient_checkpointing", False))
    choices = {"on": [can], "off": [False], "auto": [False, True] if can else [False]}[mode]
    estimate = None
    for checkpointing in choices:
        estimate = step_memory(model, optimizer, rows, checkpointing=checkpointing, chunk=chunk)
        if estimate.needed <= limit:
            return StepPlan(checkpointing, estimate, limit)
    assert estimate is not None
    hint = "" if estimate.checkpointing or not can else "; activation_checkpointing=on would need less"
    return StepPlan(
        estimate.checkpointing,
        estimate,
        limit,
        f"the step needs {estimate.explain()}, more than the {limit / GIB:.2f} GiB it may use{hint}: lower the "
        "token budget or max_path_tokens (--hp), set memory_limit_gib, or train on a larger device "
        "(docs/method.md#learner-memory)",
    )


def set_checkpointing(model: torch.nn.Module, on: bool) -> bool:
    """Turn the model's per-layer activation checkpointing on or off; True when that changed anything."""
    if bool(getattr(model, "is_gradient_checkpointing", False)) == on:
        return False
    hf: Any = model  # a transformers PreTrainedModel (nn.Module's __getattr__ types these as tensors)
    if on:  # non-reentrant: works with inputs that need no grad, and under the step's no_grad passes
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_disable()
    return True
