"""How a training step's numbers combine: a row's statistics into its part's, and the step over the ranks.

``Reduction`` is the step's hook for the ranks that train it (``learner.step.train_step``): this one is a single rank,
where nothing combines; ``learner.distributed.GroupReduction`` is a process group's. Pure torch, no Kafka, no
torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from learner.pack import MicroBatch


class Reduction:
    """How a step's numbers combine over the ranks that train it. This one is a single rank: nothing to combine.
    ``learner.distributed.GroupReduction`` is a process group's: trees dealt to the ranks, counts and statistics
    all-reduced, gradients summed and clipped by the global norm, and FSDP2's lockstep (padding rows)."""

    def share(self, sizes: Sequence[int]) -> list[int]:
        """Which of a part's trees (their token counts, in batch order) this rank trains."""
        return list(range(len(sizes)))

    def sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks."""
        return values

    def stats(self, stats: dict[str, float]) -> dict[str, float]:
        """A part's row statistics over the ranks (each rank's are shares of the whole part's, see :func:`combine`)."""
        return stats

    def clip(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Sums the gradient over the ranks and clips it by its norm (``max_norm`` > 0); the norm before clipping."""
        return clip_grad(optimizer, max_norm)

    def lockstep(self, model: torch.nn.Module) -> bool:
        """Whether every rank must run the same passes (FSDP2: a unit's all-gathers pair up across ranks)."""
        return False

    def pad(self, rows: list[MicroBatch], spare: Callable[[], list[MicroBatch]]) -> list[MicroBatch]:
        """In lockstep: rows to run with zero weight so this rank runs as many as the busiest (``spare``: the rows
        of one of the part's trees, for a rank that has none)."""
        return []

    def finish(self, model: torch.nn.Module) -> dict[str, float]:
        """After the step: gives back what the ranks held for it; metrics of the group."""
        return {}


# A row's loss terms are its share of the part's loss (normalised by the part's token and rollout counts): they add
# up over rows. Extremes combine as extremes; every other statistic is a token-weighted mean over rows.
ADDITIVE = frozenset({"loss", "policy_loss", "value_loss", "ref_kl"})
MAXIMA = frozenset({"is_weight_max", "is_raw_ratio_max"})
MINIMA = frozenset({"is_raw_ratio_min"})


def combine(into: dict[str, float], stats: dict[str, float], token_share: float = 1.0) -> None:
    """Adds one row's statistics (its share ``token_share`` of the part's trainable tokens) into ``into``; with the
    default share, a rank's part statistics into the other ranks' (each already a share of the whole part's)."""
    for key, value in stats.items():
        if key in MAXIMA:
            into[key] = max(into.get(key, value), value)
        elif key in MINIMA:
            into[key] = min(into.get(key, value), value)
        else:
            into[key] = into.get(key, 0.0) + (value if key in ADDITIVE else value * token_share)


def clip_grad(optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """Clips the optimizer's gradients by their global norm when ``max_norm`` > 0; returns the norm before."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
