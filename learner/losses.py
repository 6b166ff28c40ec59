"""Policy-gradient losses of the learner: GRPO and PPO with truncated / masked importance sampling, on packed trees.

Inputs are flat tensors over the packed tokens of a micro-batch (see ``learner.pack``): every unique token of a
rollout's prefix tree appears once, ``rollout_index`` (T,) says which rollout a token belongs to and ``loss_mask``
(T,) marks the trainable ones (generated tokens of kept calls). Per-rollout quantities (GRPO advantage, PPO return)
are (R,) tensors indexed by ``rollout_index``.

The pieces, as in ClawGym II (docs/method.md#advantages, docs/method.md#off-policy-correction; every formula, and
where the project departs from the paper or the paper is silent: docs/method.md#loss-details):

- clipped surrogate with separate low/high clip ("clip-higher") and an optional dual clip (``clipped_surrogate``);
- truncated importance sampling ``min(exp(logp_old - logp_rollout), c)``, or masked IS, or none
  (``importance_weights``);
- GRPO: one advantage per rollout, broadcast to its tokens (group normalisation is done upstream, in streams/);
- PPO: gamma = lambda = 1, ``A_t = R - V(s_t)``; value loss ``0.5 (V - R)^2``, optionally clipped (``value_loss``);
- optional k3 KL to a reference policy with ``kl_coef`` (0 = off, the default).

Per-token losses are reduced by ``learner.aggregation.aggregate`` (``seq_mean_token_mean`` by default, the paper's
form; ``token_mean`` optional), with the whole step's denominators so micro-batch losses sum to the full-batch loss.
Pure torch, no Kafka; used by ``learner.step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from clawbase.errors import ConfigError
from learner.aggregation import (
    Aggregation,
    LossInputError,
    StepDenominators,
    aggregate,
    check_flat,
    masked_frac,
    masked_mean,
    per_rollout,
)

__all__ = [
    "ISMode",
    "LossConfig",
    "clipped_surrogate",
    "grpo_loss",
    "importance_weights",
    "k3_kl",
    "policy_loss",
    "ppo_loss",
    "value_loss",
]

ISMode = Literal["tis", "masked", "none"]

# exp() of a log-ratio beyond this overflows nothing but says nothing useful either (verl uses the same bound).
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the learner's loss. Defaults: GRPO-style clip-higher, TIS with c = 2, no KL."""

    eps_low: float = 0.2  # r_t is clipped below at 1 - eps_low (for A < 0)
    eps_high: float = 0.28  # r_t is clipped above at 1 + eps_high (for A > 0); DAPO's clip-higher value
    dual_clip_c: float | None = None  # dual-clip PPO bound (> 1) for A < 0; None = off
    is_mode: ISMode = "tis"
    is_cap: float = 2.0  # c: TIS truncation, and the [1/c, c] band of masked IS
    aggregation: Aggregation = "seq_mean_token_mean"  # the paper's Eq. 6: per-rollout token mean, then mean
    kl_coef: float = 0.0  # coefficient of the k3 KL to the reference policy; 0 = off
    vf_coef: float = 0.5  # PPO only: weight of the value loss
    value_clip: float | None = None  # PPO only: clip range of the value loss around the old values; None = plain MSE

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low < 1.0:
            raise ConfigError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ConfigError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ConfigError(f"dual_clip_c must be > 1 (or None to disable), got {self.dual_clip_c}")
        if self.is_mode not in ("tis", "masked", "none"):
            raise ConfigError(f"is_mode must be 'tis', 'masked' or 'none', got {self.is_mode!r}")
        if self.is_cap < 1.0:
            raise ConfigError(f"is_cap must be >= 1, got {self.is_cap}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ConfigError(f"aggregation must be 'token_mean' or 'seq_mean_token_mean', got {self.aggregation!r}")
        if self.kl_coef < 0.0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.vf_coef < 0.0:
            raise ConfigError(f"vf_coef must be >= 0, got {self.vf_coef}")
        if self.value_clip is not None and self.value_clip <= 0.0:
            raise ConfigError(f"value_clip must be > 0 (or None for plain MSE), got {self.value_clip}")


def _safe_log_ratio(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # (T,) a - b on trainable tokens, 0 elsewhere (non-trainable tokens may carry any placeholder logprob), clamped so
    # exp() stays finite: inf * 0 would be NaN and poison the whole sum.
    return torch.where(mask, a - b, torch.zeros_like(a)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def importance_weights(
    logp_old: torch.Tensor,  # (T,)
    logp_rollout: torch.Tensor,  # (T,)
    loss_mask: torch.Tensor,  # (T,) bool
    mode: ISMode = "tis",
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token off-policy weights (T,), detached, 0 on non-trainable tokens, plus their statistics.

    ``tis``: ``min(rho, cap)`` with ``rho = exp(logp_old - logp_rollout)``; ``masked``: ``rho`` inside
    ``[1/cap, cap]`` (bounds included), 0 outside; ``none``: 1.
    """
    with torch.no_grad():
        mask = loss_mask.bool()
        # At least fp32: bf16 logprobs would put the [1/c, c] band edges and the truncation point off by ~1%.
        dtype = torch.promote_types(torch.promote_types(logp_old.dtype, logp_rollout.dtype), torch.float32)
        raw = torch.exp(_safe_log_ratio(logp_old.to(dtype), logp_rollout.to(dtype), mask))  # (T,)
        if mode == "tis":
            weights = raw.clamp(max=cap)
            off = raw > cap  # truncated tokens
        elif mode == "masked":
            off = (raw < 1.0 / cap) | (raw > cap)  # dropped tokens
            weights = torch.where(off, torch.zeros_like(raw), raw)
        elif mode == "none":
            weights = torch.ones_like(raw)
            off = torch.zeros_like(mask)
        else:
            raise ConfigError(f"is_mode must be 'tis', 'masked' or 'none', got {mode!r}")
        weights = weights * mask
        off = off & mask
        n = mask.sum().clamp(min=1).to(dtype)
        raw_on = torch.where(mask, raw, torch.zeros_like(raw))
        stats = {
            "is_weight_mean": float((weights.sum() / n).item()),
            "is_weight_max": float(weights.max().item()) if weights.numel() else 0.0,
            "is_raw_ratio_max": float(raw_on.max().item()) if raw.numel() else 0.0,
            "is_raw_ratio_min": float(torch.where(mask, raw, torch.full_like(raw, float("inf"))).min().item())
            if bool(mask.any())
            else 0.0,
            # TIS: fraction truncated at cap; masked IS: fraction dropped; none: 0.
            "is_truncated_frac": masked_frac(off, mask) if mode == "tis" else 0.0,
            "is_masked_frac": masked_frac(off, mask) if mode == "masked" else 0.0,
            # Mismatch between inference engine and trainer: mean of k1 = log pi_rollout - log pi_old on its samples.
            "rollout_old_kl": float(masked_mean(-torch.log(raw.clamp(min=1e-30)), mask.to(dtype)).item()),
        }
    return weights, stats


def clipped_surrogate(
    logp_new: torch.Tensor,  # (T,)
    logp_old: torch.Tensor,  # (T,)
    advantages: torch.Tensor,  # (T,) per-token advantage
    loss_mask: torch.Tensor,  # (T,) bool
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate loss (T,) (0 on non-trainable tokens) and per-token clip indicators (T,) bool.

    The indicators: ``clipped_low`` (A < 0 and r < 1 - eps_low), ``clipped_high`` (A > 0 and r > 1 + eps_high), i.e.
    where the clipped branch is active and the token's gradient is zero; ``dual_clipped`` (A < 0 and the dual bound
    -A c is active).
    """
    mask = loss_mask.bool()
    log_ratio = _safe_log_ratio(logp_new, logp_old.detach(), mask)  # (T,)
    ratio = torch.exp(log_ratio)  # (T,)
    adv = torch.where(mask, advantages.detach(), torch.zeros_like(advantages))  # (T,)
    loss_unclipped = -adv * ratio  # (T,)
    loss_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # (T,)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (T,)
    clip_active = (loss_clipped > loss_unclipped) & mask
    info = {
        "ratio": ratio.detach(),
        "clipped_low": clip_active & (adv < 0),
        "clipped_high": clip_active & (adv > 0),
        "dual_clipped": torch.zeros_like(mask),
    }
    if dual_clip_c is not None:
        bound = -adv * dual_clip_c  # (T,): the most a negative-advantage token may contribute
        dual = (adv < 0) & (loss > bound) & mask
        loss = torch.where(dual, bound, loss)
        info["dual_clipped"] = dual
    return torch.where(mask, loss, torch.zeros_like(loss)), info


def k3_kl(logp_new: torch.Tensor, logp_ref: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(T,) k3 estimate of KL(pi_new || pi_ref) per token: exp(q) - q - 1, q = logp_ref - logp_new; 0 if not trainable.

    Unbiased for the KL under samples from pi_new and always >= 0 (Schulman, "Approximating KL divergence").
    """
    mask = loss_mask.bool()
    q = _safe_log_ratio(logp_ref.detach(), logp_new, mask)  # (T,)
    return torch.where(mask, torch.exp(q) - q - 1.0, torch.zeros_like(q))


def _validate(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor | None,
    logp_rollout: torch.Tensor,
    rollout_index: torch.Tensor,
    loss_mask: torch.Tensor,
    logp_ref: torch.Tensor | None,
) -> int:
    n = int(logp_new.shape[0]) if logp_new.dim() == 1 else -1
    check_flat("logp_new", logp_new, n)
    for name, t in (("logp_old", logp_old), ("logp_rollout", logp_rollout), ("logp_ref", logp_ref)):
        if t is not None:
            check_flat(name, t, n)
    check_flat("rollout_index", rollout_index, n)
    check_flat("loss_mask", loss_mask, n)
    if loss_mask.dtype != torch.bool:
        raise LossInputError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if rollout_index.dtype not in (torch.int64, torch.int32):
        raise LossInputError(f"rollout_index must be an integer tensor, got {rollout_index.dtype}")
    if n and int(rollout_index.min().item()) < 0:
        raise LossInputError("rollout_index must be >= 0")
    return n


def policy_loss(
    logp_new: torch.Tensor,  # (T,) current policy, with grad
    logp_old: torch.Tensor | None,  # (T,) policy at the start of the step; None = logp_new detached (one update)
    logp_rollout: torch.Tensor,  # (T,) inference engine's logprobs
    advantages: torch.Tensor,  # (T,) per-token advantages
    rollout_index: torch.Tensor,  # (T,) long
    loss_mask: torch.Tensor,  # (T,) bool
    config: LossConfig,
    *,
    logp_ref: torch.Tensor | None = None,  # (T,) reference policy, for the KL term
    num_tokens: int | float | None = None,
    num_rollouts: int | float | None = None,
    rollout_tokens: torch.Tensor | None = None,  # (R,) a rollout's trainable tokens over all rows of the step
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate x IS weight (+ kl_coef x k3 KL), aggregated. Shared by ``grpo_loss`` and ``ppo_loss``."""
    n = _validate(logp_new, logp_old, logp_rollout, rollout_index, loss_mask, logp_ref)
    check_flat("advantages", advantages, n)
    old = logp_new.detach() if logp_old is None else logp_old.detach()  # (T,)
    mask = loss_mask
    maskf = mask.to(logp_new.dtype)

    weights, is_stats = importance_weights(old, logp_rollout, mask, config.is_mode, config.is_cap)  # (T,)
    surrogate, info = clipped_surrogate(
        logp_new, old, advantages, mask, config.eps_low, config.eps_high, config.dual_clip_c
    )  # (T,)
    per_token = surrogate * weights.to(surrogate.dtype)  # (T,)
    agg: StepDenominators = {"num_tokens": num_tokens, "num_rollouts": num_rollouts, "rollout_tokens": rollout_tokens}
    pg = aggregate(per_token, mask, rollout_index, config.aggregation, **agg)
    loss = pg

    stats: dict[str, float] = {"policy_loss": float(pg.detach().item())}
    if logp_ref is not None:
        kl = k3_kl(logp_new, logp_ref, mask)  # (T,)
        kl_term = aggregate(kl, mask, rollout_index, config.aggregation, **agg)
        stats["ref_kl"] = float(kl_term.detach().item())
        if config.kl_coef > 0.0:
            loss = loss + config.kl_coef * kl_term
    elif config.kl_coef > 0.0:
        raise LossInputError("kl_coef > 0 needs logp_ref (reference-policy logprobs)")

    with torch.no_grad():
        log_ratio = _safe_log_ratio(logp_new.detach(), old, mask)  # (T,)
        stats.update(
            {
                "clip_frac_low": masked_frac(info["clipped_low"], mask),
                "clip_frac_high": masked_frac(info["clipped_high"], mask),
                "clip_frac": masked_frac(info["clipped_low"] | info["clipped_high"], mask),
                "dual_clip_frac": masked_frac(info["dual_clipped"], mask),
                # k1 estimate of KL(pi_old || pi_new) on pi_old's samples (verl's ppo_kl) and the k3 one.
                "approx_kl": float(masked_mean(-log_ratio, maskf).item()),
                "approx_kl_k3": float(masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, maskf).item()),
                "ratio_mean": float(masked_mean(info["ratio"], maskf).item()),
                "advantage_mean": float(masked_mean(advantages.detach().to(maskf.dtype), maskf).item()),
                "trainable_tokens": float(mask.sum().item()),
                "rollouts": float(torch.unique(rollout_index[mask]).numel()),
            }
        )
    stats.update(is_stats)
    stats["loss"] = float(loss.detach().item())
    return loss, stats


def grpo_loss(
    logp_new: torch.Tensor,  # (T,)
    logp_old: torch.Tensor | None,  # (T,) or None
    logp_rollout: torch.Tensor,  # (T,)
    advantages: torch.Tensor,  # (R,) one GRPO advantage per rollout
    rollout_index: torch.Tensor,  # (T,) long in [0, R)
    loss_mask: torch.Tensor,  # (T,) bool
    config: LossConfig | None = None,
    *,
    logp_ref: torch.Tensor | None = None,
    num_tokens: int | float | None = None,
    num_rollouts: int | float | None = None,
    rollout_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: the rollout's advantage on every one of its tokens, clipped surrogate with TIS / masked IS."""
    config = config or LossConfig()
    _validate(logp_new, logp_old, logp_rollout, rollout_index, loss_mask, logp_ref)
    adv_tok = per_rollout("advantages", advantages.to(logp_new.dtype), rollout_index)  # (T,)
    return policy_loss(
        logp_new,
        logp_old,
        logp_rollout,
        adv_tok,
        rollout_index,
        loss_mask,
        config,
        logp_ref=logp_ref,
        num_tokens=num_tokens,
        num_rollouts=num_rollouts,
        rollout_tokens=rollout_tokens,
    )


def value_loss(
    values: torch.Tensor,  # (T,) current value predictions V(s_t), with grad
    returns: torch.Tensor,  # (T,) per-token return
    loss_mask: torch.Tensor,  # (T,) bool
    rollout_index: torch.Tensor,  # (T,) long
    *,
    old_values: torch.Tensor | None = None,  # (T,) values at the start of the step (needed when value_clip is set)
    value_clip: float | None = None,
    aggregation: Aggregation = "seq_mean_token_mean",
    num_tokens: int | float | None = None,
    num_rollouts: int | float | None = None,
    rollout_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 (V - R)^2 aggregated; with ``value_clip`` the PPO clipped form around ``old_values`` (as verl / TRL).

    Plain MSE is the default: with gamma = lambda = 1 and a terminal reward the target R is the same for every token
    of a rollout and does not move during a step, so the trust-region role of value clipping is weak, and clipping can
    stall a value head that is far off (e.g. after the pre-training of the value model, when R's scale changes).
    """
    mask = loss_mask.bool()
    err = (values - returns.detach()) ** 2  # (T,)
    clip_frac = torch.zeros((), device=values.device)
    if value_clip is not None:
        if old_values is None:
            raise LossInputError("value_clip needs old_values (the value predictions the step started from)")
        old = old_values.detach()
        clipped = torch.maximum(torch.minimum(values, old + value_clip), old - value_clip)  # (T,)
        err_clipped = (clipped - returns.detach()) ** 2  # (T,)
        clip_frac = torch.tensor(masked_frac(err_clipped > err, mask))
        err = torch.maximum(err, err_clipped)
    loss = 0.5 * aggregate(
        err,
        mask,
        rollout_index,
        aggregation,
        num_tokens=num_tokens,
        num_rollouts=num_rollouts,
        rollout_tokens=rollout_tokens,
    )
    stats = {
        "value_loss": float(loss.detach().item()),
        "value_clip_frac": float(clip_frac.item()),
        "value_mean": float(masked_mean(values.detach(), mask.to(values.dtype)).item()),
    }
    return loss, stats


def ppo_loss(
    logp_new: torch.Tensor,  # (T,)
    logp_old: torch.Tensor | None,  # (T,) or None
    logp_rollout: torch.Tensor,  # (T,)
    values: torch.Tensor,  # (T,) V(s_t): value head at the PREDICTOR position of token t, with grad
    returns: torch.Tensor,  # (R,) the rollout's terminal reward R
    rollout_index: torch.Tensor,  # (T,) long in [0, R)
    loss_mask: torch.Tensor,  # (T,) bool
    config: LossConfig | None = None,
    *,
    old_values: torch.Tensor | None = None,  # (T,) V at the start of the step; None = values detached
    logp_ref: torch.Tensor | None = None,
    num_tokens: int | float | None = None,
    num_rollouts: int | float | None = None,
    rollout_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO with gamma = lambda = 1: ``A_t = R - V_old(s_t)``; ``loss = policy + vf_coef * value``.

    ``values[t]`` must be V of the state in which token t was chosen, i.e. the value head's output at
    ``predictor[t]`` of the packed micro-batch (the same position whose logits give token t's logprob).
    The advantage uses ``old_values`` (detached), so the policy gradient never flows into the value head.
    """
    config = config or LossConfig()
    n = _validate(logp_new, logp_old, logp_rollout, rollout_index, loss_mask, logp_ref)
    check_flat("values", values, n)
    if old_values is not None:
        check_flat("old_values", old_values, n)
    ret_tok = per_rollout("returns", returns.to(values.dtype), rollout_index)  # (T,)
    v_old = values.detach() if old_values is None else old_values.detach()  # (T,)
    adv_tok = (ret_tok - v_old).to(logp_new.dtype)  # (T,)
    agg: StepDenominators = {"num_tokens": num_tokens, "num_rollouts": num_rollouts, "rollout_tokens": rollout_tokens}
    pg, stats = policy_loss(
        logp_new, logp_old, logp_rollout, adv_tok, rollout_index, loss_mask, config, logp_ref=logp_ref, **agg
    )
    vl, vstats = value_loss(
        values,
        ret_tok,
        loss_mask,
        rollout_index,
        old_values=v_old,
        value_clip=config.value_clip,
        aggregation=config.aggregation,
        **agg,
    )
    loss = pg + config.vf_coef * vl
    stats.update(vstats)
    stats["loss"] = float(loss.detach().item())
    return loss, stats
