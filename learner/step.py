"""One training step on one batch of scored rollout trees: pack → π_old logprobs → loss → optimizer step(s).

Pure torch (no Kafka): the train loop hands it decoded trajectories and advantages. A step (in detail, and why each
measurement: docs/method.md#the-training-step):

1. splits the trees into ``mini_batches`` parts and packs each into micro-batch rows under the token budget
   (``learner.pack.pack_trees``);
2. recomputes π_old logprobs for all rows with the current weights, before any update (no grad) — except for one
   GRPO update per batch (``mini_batches == 1``, no dropout), where they are the gradient pass's, detached;
3. for each part, accumulates gradients of the loss over its rows (normalised by the part's trainable-token and
   rollout counts: the accumulated gradient is the whole part's) and takes one clipped AdamW step;
4. after the update, one more forward pass (no grad) measures what the step did: ``update_kl``, ``update_kl_k3``,
   and for GRPO ``update_adv_dot`` and ``update_sign_agreement``;
5. with ``kl_coef > 0``, a frozen reference policy gives each row's logprobs for the k3 KL term (``ref_kl``);
6. GRPO's π_old logits also give ``entropy`` at the trainable tokens.

Every pass projects only the trainable positions through the LM head, ``logprob_chunk`` at a time (learner/forward.py:
no row's (T, V) logits are ever held).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clawbase.errors import ConfigError
from clawbase.faults import fault_point
from learner.forward import packed_logprobs
from learner.hparams import Hyperparams
from learner.kv_share import PrefixKV, plan_groups, suffix_row
from learner.losses import grpo_loss, ppo_loss
from learner.pack import MicroBatch, pack_trees
from learner.value import ValueHead, policy_and_values


@dataclass
class ScoredTree:
    """A rollout tree with its GRPO advantage (from a batch record)."""

    segments: Sequence  # TreeSegment-like: parent, tokens, trainable, logprobs
    advantage: float
    reward: float | None
    harness: str


def _autocast(device: torch.device) -> torch.autocast:
    # CUDA: bf16 compute with fp32 master weights. CPU: plain fp32 (autocast disabled).
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[ScoredTree],
    config: Hyperparams,
    value_head: ValueHead | None = None,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Train on one batch; returns scalar metrics (loss, clip fractions, IS weight stats, reward per harness, ...).

    PPO (``config.algorithm == "ppo"``) needs ``value_head`` (its parameters must be in ``optimizer``);
    ``kl_coef > 0`` needs ``ref_model``, the frozen reference policy of the KL term."""
    if config.algorithm == "ppo" and value_head is None:
        raise ValueError("PPO needs a value head")
    if config.kl_coef > 0 and ref_model is None:
        raise ConfigError("kl_coef > 0 needs a reference policy (ref_model): the learner loads its initial model")
    started = time.perf_counter()
    device = next(model.parameters()).device
    # Mini-batches are sets of whole trees; each is packed into rows (a tree never spans two rows).
    parts = [list(trees[i :: config.mini_batches]) for i in range(config.mini_batches)]
    parts = [p for p in parts if p]
    max_path = max_path_tokens(model, config)
    rows = [
        [
            r.to(device)
            for r in pack_trees(
                [t.segments for t in part], config.token_budget, max_path, share_prefix_min=config.share_prefix_min
            )
        ]
        for part in parts
    ]

    entropy = [0.0, 0]  # summed over trainable tokens, and their count (GRPO's π_old)
    old: list[list[tuple[torch.Tensor, torch.Tensor | None] | None]]
    if _fused_old(model, config, len(parts)):
        old = [[None] * len(rs) for rs in rows]  # filled by the gradient pass
    else:
        model.eval()  # π_old (and V_old for PPO): the current weights, before this step's updates
        with torch.no_grad(), _autocast(device):
            old = [[_old_forward(model, value_head, r, config, entropy) for r in rs] for rs in rows]

    ref: list[list[torch.Tensor | None]] = [[None] * len(rs) for rs in rows]
    if config.kl_coef > 0 and ref_model is not None:
        with torch.no_grad(), _autocast(device):
            ref = [_shared_logprobs(ref_model, rs, config) for rs in rows]  # (T,) each

    model.train()
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = 0
    for part, part_rows, part_old, part_ref in zip(parts, rows, old, ref, strict=True):
        n_tokens = int(sum(int(r.loss_mask.sum()) for r in part_rows))
        if n_tokens == 0:
            continue
        if config.algorithm == "ppo":  # returns R (γ = λ = 1); the advantage R - V_old(s_t) is formed per token
            advantages = torch.tensor([_reward(t) for t in part], dtype=torch.float32, device=device)  # (R_part,)
        else:
            # neg_adv_scale < 1 departs from the paper (Hyperparams's help): negative advantages weigh less.
            advantages = torch.tensor(
                [t.advantage if t.advantage >= 0 else t.advantage * config.neg_adv_scale for t in part],
                dtype=torch.float32,
                device=device,
            )  # (R_part,)
        # A rollout's trainable tokens over all its rows (a tree over the token budget spans several): (R_part,)
        per_rollout = torch.zeros(len(part), dtype=torch.float32, device=device)
        for row in part_rows:
            per_rollout.index_add_(0, row.rollout_index, row.loss_mask.float())
        optimizer.zero_grad(set_to_none=True)
        part_stats: dict[str, float] = {}
        for group, m in _kv_plan(model, part_rows, config):  # rows sharing a prefix run one after another
            prefix = None
            if m:
                with _autocast(device):
                    prefix = PrefixKV(model, part_rows[group[0]], m)
                sums["kv_shared_tokens"] += m * (len(group) - 1)  # tokens not computed again
            for i in group:
                row, row_old, ref_i = part_rows[i], part_old[i], part_ref[i]
                stats, used_old = _row_backward(
                    model,
                    value_head,
                    suffix_row(row, m) if m else row,
                    _tail(row_old, m),  # (logprobs, values | None)
                    advantages,
                    config,
                    n_tokens,
                    len(part),
                    per_rollout,
                    entropy,
                    None if ref_i is None else ref_i[m:],
                    past=prefix.cache() if prefix is not None else None,
                )
                part_old[i] = _padded(used_old, m)
                _combine(part_stats, stats, float(row.loss_mask.sum()) / n_tokens)
            if prefix is not None:
                with _autocast(device):
                    prefix.backward()
        for key, value in part_stats.items():
            sums[key] += value
        norm = _clip(optimizer, config.max_grad_norm)
        sums["grad_norm"] += norm
        if config.skip_zero_grad and norm == 0.0:
            skipped += 1  # nothing to learn here: AdamW's momentum alone would still move every weight
        else:
            optimizer.step()
        fault_point("learner.in_step")  # weights and AdamW state moved, the step not finished (docs/faults.md)
        steps += 1

    metrics = {key: value / max(steps, 1) for key, value in sums.items()}
    trained_s = time.perf_counter() - started
    model.eval()  # what the step did: π_new's logprobs of the same tokens
    with torch.no_grad(), _autocast(device):
        after = [_shared_logprobs(model, rs, config) for rs in rows]
    metrics.update(update_stats(parts, rows, old, after, grpo=config.algorithm == "grpo"))
    if entropy[1]:
        metrics["entropy"] = entropy[0] / entropy[1]
    tokens = sum(r.num_tokens for rs in rows for r in rs)
    trainable = sum(int(r.loss_mask.sum()) for rs in rows for r in rs)
    elapsed = time.perf_counter() - started
    metrics.update(
        {
            "optimizer_steps": float(steps - skipped),
            "skipped_steps": float(skipped),
            "rollouts": float(len(trees)),
            "micro_batches": float(sum(map(len, rows))),
            "tokens": float(tokens),
            "trainable_tokens": float(trainable),
            "tokens_per_s": tokens / trained_s,
            "step_seconds": elapsed,
            "update_stats_seconds": elapsed - trained_s,
        }
    )
    metrics.update(_reward_metrics(trees))
    return metrics


def update_stats(
    parts: Sequence[Sequence[ScoredTree]],
    rows: Sequence[Sequence[MicroBatch]],
    old: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor | None]]],  # per part, per row: (logp_old (T,), values)
    after: Sequence[Sequence[torch.Tensor]],  # per part, per row: logp_new (T,) after the step
    *,
    grpo: bool = True,
) -> dict[str, float]:
    """How far the step moved the policy on its own samples (see the module docstring, item 4)."""
    kl_sum, kl3_sum, n_tok = 0.0, 0.0, 0
    dots, agree, signed = [], 0, 0
    for part, part_rows, part_old, part_after in zip(parts, rows, old, after, strict=True):
        delta_sum = torch.zeros(len(part), dtype=torch.float64)  # (R_part,) Σ_t (log π_new − log π_old)
        count = torch.zeros(len(part), dtype=torch.float64)  # (R_part,) trainable tokens
        for row, (logp_old, _), logp_new in zip(part_rows, part_old, part_after, strict=True):
            mask = row.loss_mask.to(logp_new.device)
            delta = (logp_new - logp_old).double()[mask]  # (K,)
            kl_sum += float(-delta.sum())
            kl3_sum += float((torch.exp(delta) - 1.0 - delta).sum())
            n_tok += int(mask.sum())
            index = row.rollout_index.to(logp_new.device)[mask].cpu()
            delta_sum.index_add_(0, index, delta.cpu())
            count.index_add_(0, index, torch.ones_like(delta, device="cpu"))
        if not grpo:
            continue
        for tree, total, k in zip(part, delta_sum.tolist(), count.tolist(), strict=True):
            if k == 0:
                continue
            mean_delta = total / k
            dots.append(tree.advantage * mean_delta)
            if tree.advantage != 0.0:
                signed += 1
                agree += int(mean_delta != 0.0 and (mean_delta > 0) == (tree.advantage > 0))
    out = {"update_kl": kl_sum / max(n_tok, 1), "update_kl_k3": kl3_sum / max(n_tok, 1)}
    if grpo and dots:
        out["update_adv_dot"] = sum(dots) / len(dots)
    if grpo and signed:
        out["update_sign_agreement"] = agree / signed
    return out


def _kv_plan(model: torch.nn.Module, rows: Sequence[MicroBatch], config: Hyperparams) -> list[tuple[list[int], int]]:
    """Every row once, as (rows, shared prefix length): groups sharing a prefix (``learner.kv_share``), then the rest
    alone with 0. Off for PPO (its value rows) and under activation checkpointing (recomputation re-appends)."""
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    on = config.kv_share_min > 0 and config.algorithm == "grpo" and not checkpointing
    groups = plan_groups(rows, config.kv_share_min) if on else []
    grouped = {i for members, _ in groups for i in members}
    return groups + [([i], 0) for i in range(len(rows)) if i not in grouped]


def _shared_logprobs(model: torch.nn.Module, rows: Sequence[MicroBatch], config: Hyperparams) -> list[torch.Tensor]:
    """:func:`_logprobs` of every row (T,) each, a shared prefix computed once per group (no gradient here)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for group, m in _kv_plan(model, rows, config):
        prefix = PrefixKV(model, rows[group[0]], m) if m else None
        for i in group:
            row, past = (suffix_row(rows[i], m), prefix.cache()) if prefix is not None else (rows[i], None)
            out[i] = _padded((_logprobs(model, row, config, past=past), None), m)[0]
    return out


def _tail(
    old: tuple[torch.Tensor, torch.Tensor | None] | None, m: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A row's (π_old, V_old) without its first ``m`` tokens (the shared prefix's)."""
    if old is None or m == 0:
        return old
    return old[0][m:], None if old[1] is None else old[1][m:]


def _padded(old: tuple[torch.Tensor, torch.Tensor | None], m: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A suffix's (π_old, V_old) back at the full row's length (the prefix holds no trained token: zeros)."""
    if m == 0:
        return old
    pad = lambda t: torch.cat([t.new_zeros(m), t])  # noqa: E731
    return pad(old[0]), None if old[1] is None else pad(old[1])


def _old_forward(
    model: torch.nn.Module, head: ValueHead | None, row: MicroBatch, config: Hyperparams, entropy: list
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """π_old's (logprobs (T,), values (T,) or None) of a row; GRPO also adds its entropy sum/count to ``entropy``."""
    if config.algorithm == "ppo":
        return _forward(model, head, row, config)
    return _logprobs(model, row, config, entropy), None  # (T,)


def _forward(
    model: torch.nn.Module, head: ValueHead | None, row: MicroBatch, config: Hyperparams, past: Any = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs (T,), values (T,) or None) of a row under the current weights."""
    if config.algorithm == "ppo":
        assert head is not None and past is None
        return policy_and_values(model, head, row, chunk=config.logprob_chunk)
    return _logprobs(model, row, config, past=past), None  # each token under its call's sampling settings


def _logprobs(
    model: torch.nn.Module, row: MicroBatch, config: Hyperparams, entropy: list | None = None, past: Any = None
) -> torch.Tensor:
    """Logprobs (T,) of a row's trainable tokens; ``entropy`` = [sum, count] gets their entropy added."""
    return packed_logprobs(model, row, only_trainable=True, chunk=config.logprob_chunk, entropy=entropy, past=past)


def max_path_tokens(model: torch.nn.Module, config: Hyperparams) -> int | None:
    """The longest root-to-leaf path a row may hold: the hyperparameter, else the model's context."""
    return config.max_path_tokens or getattr(getattr(model, "config", None), "max_position_embeddings", None)


def _reward(tree: ScoredTree) -> float:
    if tree.reward is None:
        raise ValueError("PPO needs every trajectory's reward; got one without (ungraded rollouts must not be batched)")
    return tree.reward


def _fused_old(model: torch.nn.Module, config: Hyperparams, n_parts: int) -> bool:
    """One GRPO update per batch on a model without dropout: π_old is exactly the gradient pass's policy (same
    weights, same inputs), so its logprobs are that pass's, detached — one forward pass less per step (that pass
    pays for the update statistics' pass after the step). Several mini-batches need π_old from before the first
    update for every part (the later parts see updated weights), and dropout would make the passes differ."""
    if config.algorithm != "grpo" or n_parts != 1:
        return False
    dropout = float(getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0)
    return dropout == 0.0 and not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _row_backward(
    model: torch.nn.Module,
    head: ValueHead | None,
    row: MicroBatch,
    old: tuple[torch.Tensor, torch.Tensor | None] | None,  # logp_old (T,), V_old (T,) or None; None: fused
    targets: torch.Tensor,  # (R,) GRPO advantages, or PPO returns
    config: Hyperparams,
    n_tokens: int,
    n_rollouts: int,
    rollout_tokens: torch.Tensor,  # (R,) trainable tokens of each rollout over all its rows
    entropy: list,
    logp_ref: torch.Tensor | None = None,  # (T,) reference-policy logprobs for the KL term; None: no KL
    past: Any = None,  # the keys and values of a prefix shared with other rows (learner.kv_share)
) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor | None]]:
    """Loss and backward of one row; returns its statistics and the (π_old, V_old) it used."""
    device = next(model.parameters()).device
    if old is None:  # fused (see _fused_old): π_old = this pass's policy
        with _autocast(device):
            logp_new = _logprobs(model, row, config, entropy, past)  # (T,)
        values: torch.Tensor | None = None
        old = (logp_new.detach(), None)
    else:
        with _autocast(device):
            logp_new, values = _forward(model, head, row, config, past)  # (T,), (T,) | None
    logp_old, values_old = old
    common = {
        "num_tokens": n_tokens,
        "num_rollouts": n_rollouts,
        "rollout_tokens": rollout_tokens,
        "logp_ref": logp_ref,
    }
    if config.algorithm == "ppo":
        assert values is not None
        loss, stats = ppo_loss(
            logp_new,
            logp_old,
            row.rollout_logprobs,
            values,
            targets,
            row.rollout_index,
            row.loss_mask,
            config.loss_config(),
            old_values=values_old,
            **common,
        )
    else:
        loss, stats = grpo_loss(
            logp_new,
            logp_old,
            row.rollout_logprobs,
            targets,
            row.rollout_index,
            row.loss_mask,
            config.loss_config(),
            **common,
        )
    loss.backward()
    return {k: float(v) for k, v in stats.items() if isinstance(v, int | float) and math.isfinite(float(v))}, old


# A row's loss terms are its share of the part's loss (normalised by the part's token and rollout counts): they add
# up over rows. Extremes combine as extremes; every other statistic is a token-weighted mean over rows.
_ADDITIVE = frozenset({"loss", "policy_loss", "value_loss", "ref_kl"})
_MAXIMA = frozenset({"is_weight_max", "is_raw_ratio_max"})
_MINIMA = frozenset({"is_raw_ratio_min"})


def _combine(into: dict[str, float], stats: dict[str, float], token_share: float) -> None:
    for key, value in stats.items():
        if key in _MAXIMA:
            into[key] = max(into.get(key, value), value)
        elif key in _MINIMA:
            into[key] = min(into.get(key, value), value)
        else:
            into[key] = into.get(key, 0.0) + (value if key in _ADDITIVE else value * token_share)


def _clip(optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


def _reward_metrics(trees: Sequence[ScoredTree]) -> dict[str, float]:
    by_harness: dict[str, list[float]] = defaultdict(list)
    for tree in trees:
        if tree.reward is not None:
            by_harness[tree.harness].append(tree.reward)
    out = {f"reward/{h}": sum(v) / len(v) for h, v in by_harness.items()}
    out.update({f"rollouts/{h}": float(len(v)) for h, v in by_harness.items()})
    everything = [r for v in by_harness.values() for r in v]
    if everything:
        out["reward/mean"] = sum(everything) / len(everything)
    return out
