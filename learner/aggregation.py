"""Reducing a per-token loss to a scalar (the two aggregation modes), and the input checks the losses share.

Inputs are flat (T,) tensors over the packed tokens of a micro-batch (``learner.pack``): ``rollout_index`` (T,) says
which rollout a token belongs to, ``loss_mask`` (T,) marks the trainable ones; per-rollout values are (R,) tensors
indexed by ``rollout_index``. The modes (notation and why the default is the paper's Eq. 6:
docs/method.md#loss-details):

- ``"seq_mean_token_mean"`` (default): the mean over rollouts of each rollout's mean over its unique trainable tokens
  (a shared prefix counts once per rollout, never once per path);
- ``"token_mean"``: one mean over all trainable tokens of the batch (long rollouts weigh more).

Micro-batching: pass the WHOLE step's denominators (:class:`StepDenominators`) and the micro-batch losses sum to the
full-batch loss. Pure torch, no Kafka; used by ``learner.losses``.
"""

from __future__ import annotations

from typing import Literal, TypedDict

import torch

from clawbase.errors import ClawstreamError, ConfigError

__all__ = [
    "Aggregation",
    "LossInputError",
    "StepDenominators",
    "aggregate",
    "check_flat",
    "masked_frac",
    "masked_mean",
    "per_rollout",
]

Aggregation = Literal["token_mean", "seq_mean_token_mean"]


class LossInputError(ClawstreamError):
    """Loss inputs disagree (shapes, dtypes, indices): a bug upstream, caught before it becomes a wrong gradient."""


class StepDenominators(TypedDict):
    """The keyword arguments of :func:`aggregate` that make micro-batch losses sum to the whole step's loss."""

    num_tokens: int | float | None  # token_mean: trainable tokens of the step
    num_rollouts: int | float | None  # seq_mean_token_mean: rollouts of the step with a trainable token
    rollout_tokens: torch.Tensor | None  # (R,) a rollout's trainable tokens over all rows of the step


def check_flat(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != 1 or t.shape[0] != n:
        raise LossInputError(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def masked_frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    # Fraction of masked-in tokens whose flag is set, counted exactly (a statistic, never differentiated).
    return float((flags & mask).sum().item()) / max(int(mask.sum().item()), 1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # x, mask: (T,) -> scalar; 0 when nothing is masked in, instead of NaN.
    return (x * mask).sum() / mask.sum().clamp(min=1)


def per_rollout(name: str, values: torch.Tensor, rollout_index: torch.Tensor) -> torch.Tensor:
    # (R,) -> (T,) by rollout_index, with a clear error for an index out of range.
    if values.dim() != 1:
        raise LossInputError(f"{name} must be one value per rollout, shape (R,), got {tuple(values.shape)}")
    if rollout_index.numel() and int(rollout_index.max().item()) >= values.shape[0]:
        raise LossInputError(
            f"rollout_index reaches {int(rollout_index.max().item())} but {name} has {values.shape[0]} rollouts"
        )
    return values[rollout_index]


def aggregate(
    per_token: torch.Tensor,  # (T,)
    loss_mask: torch.Tensor,  # (T,) bool
    rollout_index: torch.Tensor,  # (T,) long
    mode: Aggregation = "seq_mean_token_mean",
    *,
    num_tokens: int | float | None = None,
    num_rollouts: int | float | None = None,
    rollout_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar; see the module docstring for the two modes and the global denominators.

    ``token_mean``: ``sum(per_token * mask) / num_tokens`` (default: trainable tokens here).
    ``seq_mean_token_mean``: ``sum_r mean_{t in r}(per_token) / num_rollouts`` (default: rollouts with >= 1 trainable
    token here).
    """
    mask = loss_mask.bool()
    masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # (T,)
    if mode == "token_mean":
        denom = mask.sum().clamp(min=1).to(per_token.dtype) if num_tokens is None else float(num_tokens)
        return masked.sum() / denom
    if mode == "seq_mean_token_mean" and rollout_tokens is not None:  # (R,) trainable tokens over all rows
        counts_tok = per_rollout("rollout_tokens", rollout_tokens.to(per_token.dtype), rollout_index)  # (T,)
        present = torch.unique(rollout_index[mask]).numel()
        denom = float(max(present, 1)) if num_rollouts is None else float(num_rollouts)
        return (masked / counts_tok.clamp(min=1)).sum() / denom
    if mode == "seq_mean_token_mean":
        # Renumber rollouts densely so the scatter size does not depend on how large the indices are.
        _, dense = torch.unique(rollout_index, return_inverse=True)  # (T,)
        n_slots = int(dense.max().item()) + 1 if dense.numel() else 0
        sums = torch.zeros(n_slots, dtype=per_token.dtype, device=per_token.device).index_add(0, dense, masked)
        counts = torch.zeros(n_slots, dtype=per_token.dtype, device=per_token.device).index_add(
            0, dense, mask.to(per_token.dtype)
        )
        present_slots = counts > 0  # rollouts without a trainable token here add nothing and are not counted
        seq_means = torch.where(present_slots, sums / counts.clamp(min=1), torch.zeros_like(sums))  # (R_here,)
        denom = present_slots.sum().clamp(min=1).to(per_token.dtype) if num_rollouts is None else float(num_rollouts)
        return seq_means.sum() / denom
    raise ConfigError(f"aggregation must be 'token_mean' or 'seq_mean_token_mean', got {mode!r}")
