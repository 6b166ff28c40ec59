"""Low-rank adapters (LoRA, ``lora_rank > 0``): only ΔW = (alpha / r)·B·A of attention and MLP matrices trains.

Why: full-weight AdamW moves every weight by about ``lr`` per step whatever the batch's signal; a rank-r update per
matrix at a ~10x higher lr puts a small batch's signal into a few directions (RL with LoRA matches full fine-tuning
even at low rank: Schulman et al., "LoRA Without Regret", 2025). How: each target ``nn.Linear`` (``lora_targets``:
attention q/k/v/o, MLP gate/up/down) gets a forward hook adding ``scale·B(A x)``, A (r, in) random, B (out, r) zero,
so the model starts as its base exactly. The base is frozen (no weight gradients; AdamW state for the adapters only).
The adapters accumulate over the whole run on top of the unmerged base (model_dir's weights, never changed); each
published version is a merged copy (:meth:`LoRA.merged_state_dict`): the same tensor names and shapes, plain weights
any engine loads. Merge-and-reset each step was the alternative: the learner's model would be the published one bit
for bit, but every step would restart A and AdamW's moments (a sign step in a random subspace, not LoRA). Here the
learner's π differs from the served merged weights by float rounding only (tests/unit/test_lora.py). The trainer state
carries the adapters (sha256 in the weights' header, as the optimizer's); a resume checks base + ΔW against the
published targets (:meth:`LoRA.adopt`: a changed model_dir is refused, not trained from).

Own module, not peft: peft's injection renames the targets' tensors (``q_proj.base_layer.weight``) and puts the
adapters in the model's state dict, whose names the version files, their name/shape/tied checks and the engines'
loaders rely on; its merge changes the model in place, where the learner needs a merged copy beside the unmerged
base. Hooks leave the model and its state dict as they are, so learner.forward's passes (tree masks, chunked LM head,
kv_share's prefix, activation checkpointing) run unchanged. On N data-parallel ranks every rank attaches the same
adapters (same seed); FSDP2 (learner.distributed.shard_policy) and LoRA refuse each other: the merge, the resume's
check and the adapters' hooks would have to work on shards (gathered weights), which none of them does.
Pure torch, no Kafka; used by ``learner.train`` and ``learner.version_files``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch.distributed.tensor import DTensor

from clawbase.errors import ConfigError

# ``lora_targets`` may name these groups as well as module names.
GROUPS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
DEFAULT_TARGETS = "attention,mlp"
# A resume's check of base + ΔW against the published targets: rounding of a recomputed matmul passes, another base not.
_ADOPT_RTOL, _ADOPT_ATOL = 1e-5, 1e-6
_MARK = "_clawstream_lora"  # set on a model while adapters are hooked into it
SHARDED = (
    "lora_rank > 0 does not train an FSDP2-sharded model (learner.distributed.shard_policy): train LoRA data "
    "parallel (clawstream learner-ranks, every rank whole), or set lora_rank=0 to shard"
)


def attached(model: torch.nn.Module) -> bool:
    """Whether LoRA adapters are hooked into ``model``."""
    return getattr(model, _MARK, None) is not None


def target_names(spec: str) -> set[str]:
    """``"attention,mlp"`` / ``"q_proj,v_proj"`` → the last components of the module names that get adapters."""
    out: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if item:
            out.update(GROUPS.get(item, (item,)))
    if not out:
        raise ConfigError(f"lora_targets: {spec!r} names no module; e.g. {DEFAULT_TARGETS!r} or 'q_proj,v_proj'")
    return out


class LoRA(torch.nn.Module):
    """The adapters of ``model``'s target Linear modules, hooked into its forward; ``parameters()`` are what trains."""

    _model: torch.nn.Module

    def __init__(self, model: torch.nn.Module, rank: int, alpha: float, targets: str, seed: int = 0) -> None:
        super().__init__()
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ConfigError(SHARDED)
        wanted = target_names(targets)
        found = [
            (n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in wanted
        ]
        if not found:
            names = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ConfigError(f"lora_targets={targets!r}: {type(model).__name__} has no such Linear; it has {names}")
        self.rank, self.scale = rank, alpha / rank
        object.__setattr__(self, "_model", model)  # not a submodule: parameters() are the adapters alone
        self.names = [n for n, _ in found]
        generator = torch.Generator().manual_seed(seed)  # its own: the learner's RNG stream stays as without adapters
        a_list, b_list = [], []
        for _, linear in found:
            weight = linear.weight  # (out, in)
            a = torch.empty(rank, weight.shape[1], dtype=torch.float32)
            bound = 1.0 / math.sqrt(weight.shape[1])  # nn.Linear's (and peft's) kaiming-uniform(a=√5) bound
            a.uniform_(-bound, bound, generator=generator)
            a_list.append(torch.nn.Parameter(a.to(weight.device)))  # (r, in)
            b_list.append(torch.nn.Parameter(torch.zeros(weight.shape[0], rank, device=weight.device)))  # (out, r)
        self.lora_A, self.lora_B = torch.nn.ParameterList(a_list), torch.nn.ParameterList(b_list)
        model.requires_grad_(False)  # the base is frozen: no weight gradients, no AdamW state
        self._hooks = [linear.register_forward_hook(self._hook(i)) for i, (_, linear) in enumerate(found)]
        object.__setattr__(model, _MARK, True)

    def _hook(self, i: int) -> Any:
        def add(_module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
            low = F.linear(F.linear(inputs[0], self.lora_A[i]) * self.scale, self.lora_B[i])  # (..., r) -> (..., out)
            # In place: the base's backward does not read its output, and no second (..., out) tensor is made.
            # B = 0 adds exact zeros: the base's output bit for bit.
            return output.add_(low)

        return add

    def delta(self, i: int) -> torch.Tensor:
        """ΔW of target ``i``: (out, in), fp32."""
        return (self.lora_B[i].detach() @ self.lora_A[i].detach()) * self.scale

    @torch.no_grad()
    def merged_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s state dict with base + ΔW in every target (new tensors: the model keeps its base)."""
        state = dict(model.state_dict())
        for i, name in enumerate(self.names):
            key = f"{name}.weight"
            state[key] = state[key] + self.delta(i).to(state[key].dtype)
        return state

    def state(self) -> dict[str, Any]:
        """What the trainer state carries (``learner.version_files``)."""
        return {
            "rank": self.rank,
            "scale": self.scale,
            "A": {n: a.detach().clone() for n, a in zip(self.names, self.lora_A, strict=True)},
            "B": {n: b.detach().clone() for n, b in zip(self.names, self.lora_B, strict=True)},
        }

    @torch.no_grad()
    def load_state(self, saved: Mapping[str, Any]) -> None:
        """Adapters back from :meth:`state`; another rank, scale or set of targets is refused, naming the fields."""
        mine = {n: tuple(a.shape) for n, a in zip(self.names, self.lora_A, strict=True)}
        theirs = {n: tuple(a.shape) for n, a in saved["A"].items()}
        if mine != theirs or saved["scale"] != self.scale:
            raise ConfigError(
                f"the saved adapters (rank {saved['rank']}, scale {saved['scale']}, {len(theirs)} targets) are not "
                f"this learner's (lora_rank {self.rank}, scale {self.scale}, {len(mine)} targets): resume with the "
                "run's own --hp lora_rank/lora_alpha/lora_targets, or start a new --model-name"
            )
        for i, name in enumerate(self.names):
            self.lora_A[i].copy_(saved["A"][name])
            self.lora_B[i].copy_(saved["B"][name])

    @torch.no_grad()
    def adopt(
        self, tensors: dict[str, torch.Tensor], trainer_state: Mapping[str, Any] | None, version: int
    ) -> dict[str, torch.Tensor]:
        """A published version's checked ``tensors`` → the ones to copy into the model: its adapters are loaded from
        ``trainer_state``, and its targets (base + ΔW) are checked against this model's base and left out of it."""
        saved = (trainer_state or {}).get("lora")
        if saved is None:
            raise ConfigError(
                f"v{version} was trained without adapters (its trainer state holds none), so model_dir is not its "
                "base: resume it with lora_rank=0, or start the LoRA run under a new --model-name"
            )
        self.load_state(saved)
        merged = self.merged_state_dict(self._model)
        for name in self.names:
            key = f"{name}.weight"
            if not torch.allclose(merged[key], tensors[key], rtol=_ADOPT_RTOL, atol=_ADOPT_ATOL):
                worst = float((merged[key] - tensors[key]).abs().max())
                raise ConfigError(
                    f"{key} of v{version} is not --model-dir's weights plus the saved adapters (off by up to "
                    f"{worst:.3g}): resume with the model directory the run started from"
                )
        targets = {f"{name}.weight" for name in self.names}
        return {k: t for k, t in tensors.items() if k not in targets}

    def remove(self) -> None:
        """Unhook: the model computes its base alone again (its weights are still frozen)."""
        for hook in self._hooks:
            hook.remove()
        object.__setattr__(self._model, _MARK, None)
