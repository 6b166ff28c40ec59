"""One training step on one batch of scored rollout trees: pack → π_old logprobs → loss → optimizer step(s).

Pure torch (no Kafka): the train loop hands it decoded trajectories and advantages. A step (in detail, and why each
measurement: docs/method.md#the-training-step):

1. splits the trees into ``mini_batches`` parts and packs each into micro-batch rows under the token budget
   (``learner.pack.pack_trees``; on the CPU no longer than the batch's largest tree needs: ``row_budget``);
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

The same step runs on any number of ranks: a ``learner.reduce.Reduction`` says how its numbers combine (on one rank
they do not; on a process group, ``learner.distributed.GroupReduction``: each rank trains its share of every part,
counts, statistics and gradients are summed over the ranks, docs/method.md#the-distributed-step).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from clawbase.errors import ConfigError
from clawbase.faults import fault_point
from learner.forward import packed_hidden, packed_logprobs
from learner.hparams import Hyperparams
from learner.kv_share import PrefixKV, plan_groups, suffix_row
from learner.losses import grpo_loss, ppo_loss
from learner.pack import MicroBatch, pack_trees
from learner.reduce import Reduction, combine
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


@dataclass
class _Part:
    """One mini-batch as this rank trains it: its share of the part's trees, their rows, and what the passes give."""

    trees: list[ScoredTree]  # this rank's share (whole trees: a rollout's rows are all on one rank)
    n_rollouts: int  # the whole part's rollouts, over every rank
    rows: list[MicroBatch]
    pads: list[MicroBatch]  # run with zero weight, in lockstep only
    lockstep: bool
    old: list[tuple[torch.Tensor, torch.Tensor | None] | None] = field(default_factory=list)  # π_old, V_old per row
    ref: list[torch.Tensor | None] = field(default_factory=list)  # (T,) reference logprobs per row

    @property
    def trainable(self) -> int:
        return sum(int(r.loss_mask.sum()) for r in self.rows)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trees: Sequence[ScoredTree],
    config: Hyperparams,
    value_head: ValueHead | None = None,
    ref_model: torch.nn.Module | None = None,
    reduction: Reduction | None = None,
) -> dict[str, float]:
    """Train on one batch; returns scalar metrics (loss, clip fractions, IS weight stats, reward per harness, ...).

    PPO (``config.algorithm == "ppo"``) needs ``value_head`` (its parameters must be in ``optimizer``);
    ``kl_coef > 0`` needs ``ref_model``, the frozen reference policy of the KL term. On N ranks every rank passes the
    same batch and the process group's ``reduction`` (``learner.distributed.GroupReduction``): each trains its share,
    the update is the 1-rank step's on the whole batch, and the metrics are the same on every rank."""
    if config.algorithm == "ppo" and value_head is None:
        raise ValueError("PPO needs a value head")
    if config.kl_coef > 0 and ref_model is None:
        raise ConfigError("kl_coef > 0 needs a reference policy (ref_model): the learner loads its initial model")
    ranks = reduction or Reduction()
    started = time.perf_counter()
    parts = _parts(model, trees, config, ranks)
    entropy = [0.0, 0]  # summed over trainable tokens, and their count (GRPO's π_old)
    _before_update(model, value_head, ref_model, parts, config, entropy)
    model.train()
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = 0
    for part in parts:
        n_tokens = int(ranks.sum([float(part.trainable)])[0])  # the WHOLE part's: the loss's normaliser
        if n_tokens == 0:
            continue  # on every rank alike: the count is global
        optimizer.zero_grad(set_to_none=True)
        for key, value in ranks.stats(_part_backward(model, value_head, part, config, n_tokens, entropy)).items():
            sums[key] += value
        norm = ranks.clip(optimizer, config.max_grad_norm)  # the whole gradient's: one decision on every rank
        sums["grad_norm"] += norm
        if config.skip_zero_grad and norm == 0.0:
            skipped += 1  # nothing to learn here: AdamW's momentum alone would still move every weight
        else:
            optimizer.step()
        fault_point("learner.in_step")  # weights and AdamW state moved, the step not finished (docs/faults.md)
        steps += 1

    metrics = {key: value / max(steps, 1) for key, value in sums.items()}
    trained_s = time.perf_counter() - started
    metrics.update(_after_update(model, parts, config, ranks, entropy, trained_s))
    metrics.update(ranks.finish(model))
    elapsed = time.perf_counter() - started
    metrics.update(
        {
            "optimizer_steps": float(steps - skipped),
            "skipped_steps": float(skipped),
            "rollouts": float(len(trees)),
            "step_seconds": elapsed,
            "update_stats_seconds": elapsed - trained_s,
        }
    )
    metrics.update(_reward_metrics(trees))
    return metrics


def _parts(model: torch.nn.Module, trees: Sequence[ScoredTree], config: Hyperparams, ranks: Reduction) -> list[_Part]:
    """The batch in ``mini_batches`` parts of whole trees (``trees[i::mini_batches]``), this rank's share of each
    packed into rows on the model's device (a tree never spans two rows, unless it is over the budget: then its
    paths are rows of their own)."""
    device = next(model.parameters()).device
    max_path = max_path_tokens(model, config)
    lockstep = ranks.lockstep(model)
    budget = row_budget(device, config, trees)

    def pack(part: Sequence[ScoredTree]) -> list[MicroBatch]:
        segments = [t.segments for t in part]
        rows = pack_trees(segments, budget, max_path, share_prefix_min=config.share_prefix_min)
        return [r.to(device) for r in rows]

    out = []
    for i in range(config.mini_batches):
        whole = list(trees[i :: config.mini_batches])
        if not whole:
            continue
        mine = [whole[j] for j in ranks.share([_tree_tokens(t) for t in whole])]
        rows = pack(mine) if mine else []
        pads = ranks.pad(rows, partial(pack, whole[:1])) if lockstep else []
        out.append(_Part(mine, len(whole), rows, pads, lockstep))
    return out


CPU_ROW_TOKENS = 512  # the shortest row the CPU packs to: below it a row's fixed cost (Python, its mask) adds up


def row_budget(device: torch.device, config: Hyperparams, trees: Sequence[ScoredTree]) -> int:
    """Tokens per packed row: ``token_budget``; on the CPU only what the batch's largest tree needs (at least
    ``CPU_ROW_TOKENS``). The CPU's attention kernel runs a row's whole (T, T) tree mask, skipping no block it empties
    (trees sharing a row cost T² together), and a long row buys no parallelism on a few cores: the demo's batches
    take 0.6 of the CPU time in rows of ≤ 602 tokens as in rows of 4,096 (bench/results/learner_step.md). A tree
    that fitted a row still does, and the loss is the same sum over the part's tokens and rollouts."""
    if device.type != "cpu":
        return config.token_budget
    largest = max((_tree_tokens(t) for t in trees), default=0)  # the whole batch's: the same on every rank
    return min(config.token_budget, max(largest, CPU_ROW_TOKENS))


def _before_update(
    model: torch.nn.Module,
    head: ValueHead | None,
    ref_model: torch.nn.Module | None,
    parts: Sequence[_Part],
    config: Hyperparams,
    entropy: list,
) -> None:
    """Each part's π_old (and V_old for PPO) under the current weights, before any update — left None where the
    gradient pass gives it (``_fused_old``) — and the reference policy's logprobs with ``kl_coef > 0``."""
    device = next(model.parameters()).device
    fused = _fused_old(model, config, len(parts))
    scratch = [0.0, 0]  # padding rows' entropy: dropped
    if not fused:
        model.eval()
    with torch.no_grad(), _autocast(device):
        for part in parts:
            part.old = [None] * len(part.rows)
            part.ref = [None] * len(part.rows)
            if not fused:
                part.old = [_old_forward(model, head, r, config, entropy) for r in part.rows]
                for row in part.pads:
                    _old_forward(model, head, row, config, scratch)
        if config.kl_coef > 0 and ref_model is not None:
            for part in parts:
                part.ref = list(_shared_logprobs(ref_model, part, config))  # (T,) each


def _part_backward(
    model: torch.nn.Module, head: ValueHead | None, part: _Part, config: Hyperparams, n_tokens: int, entropy: list
) -> dict[str, float]:
    """Accumulates this rank's rows' gradient of the part's loss (normalised by the whole part's counts, so the
    ranks' gradients add up to the part's); returns the rows' statistics, combined (``learner.reduce.combine``)."""
    device = next(model.parameters()).device
    if config.algorithm == "ppo":  # returns R (γ = λ = 1); the advantage R - V_old(s_t) is formed per token
        targets = torch.tensor([_reward(t) for t in part.trees], dtype=torch.float32, device=device)  # (R_part,)
    else:
        # neg_adv_scale < 1 departs from the paper (Hyperparams's help): negative advantages weigh less.
        targets = torch.tensor(
            [t.advantage if t.advantage >= 0 else t.advantage * config.neg_adv_scale for t in part.trees],
            dtype=torch.float32,
            device=device,
        )  # (R_part,)
    # A rollout's trainable tokens over all its rows (a tree over the token budget spans several): (R_part,)
    per_rollout = torch.zeros(len(part.trees), dtype=torch.float32, device=device)
    for row in part.rows:
        per_rollout.index_add_(0, row.rollout_index, row.loss_mask.float())
    stats: dict[str, float] = {}
    for group, m in _kv_plan(model, part, config):  # rows sharing a prefix run one after another
        prefix = None
        if m:
            with _autocast(device):
                prefix = PrefixKV(model, part.rows[group[0]], m)
            stats["kv_shared_tokens"] = stats.get("kv_shared_tokens", 0.0) + m * (len(group) - 1)  # not recomputed
        for i in group:
            row, ref = part.rows[i], part.ref[i]
            row_stats, used_old = _row_backward(
                model,
                head,
                suffix_row(row, m) if m else row,
                _tail(part.old[i], m),  # (logprobs, values | None)
                targets,
                config,
                n_tokens,
                part.n_rollouts,
                per_rollout,
                entropy,
                None if ref is None else ref[m:],
                past=prefix.cache() if prefix is not None else None,
            )
            part.old[i] = _padded(used_old, m)
            combine(stats, row_stats, float(row.loss_mask.sum()) / n_tokens)
        if prefix is not None:
            with _autocast(device):
                prefix.backward()
    for row in part.pads:  # the body's passes and FSDP's collectives of a row, with zero gradient
        with _autocast(device):
            (packed_hidden(model, row).sum() * 0.0).backward()  # (T, H) -> scalar 0
    return stats


def _after_update(
    model: torch.nn.Module,
    parts: Sequence[_Part],
    config: Hyperparams,
    ranks: Reduction,
    entropy: list,
    trained_s: float,
) -> dict[str, float]:
    """What the step did (π_new's logprobs of the same tokens: ``update_stats``), π_old's entropy, and what it ran
    on, each summed over the ranks."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad(), _autocast(device):
        after = [_shared_logprobs(model, part, config) for part in parts]
    sums = _update_sums(parts, after, grpo=config.algorithm == "grpo")
    rows = [r for part in parts for r in part.rows]
    counts = [
        entropy[0],
        float(entropy[1]),
        float(sum(r.num_tokens for r in rows)),
        float(sum(int(r.loss_mask.sum()) for r in rows)),
        float(len(rows)),
    ]
    totals = ranks.sum(sums + counts)
    metrics = update_stats(totals[: len(sums)], grpo=config.algorithm == "grpo")
    ent, n_ent, tokens, trainable, n_rows = totals[len(sums) :]
    if n_ent:
        metrics["entropy"] = ent / n_ent
    metrics.update(
        {"micro_batches": n_rows, "tokens": tokens, "trainable_tokens": trainable, "tokens_per_s": tokens / trained_s}
    )
    return metrics


def _update_sums(parts: Sequence[_Part], after: Sequence[Sequence[torch.Tensor]], *, grpo: bool) -> list[float]:
    """What :func:`update_stats` averages, as sums over this rank's rows (they add up over the ranks): Σ −δ, Σ k3,
    trainable tokens, Σ adv · mean δ, rollouts in it, rollouts that moved their advantage's way, signed rollouts
    (δ = log π_new − log π_old per trainable token; ``after``: per part, per row, logp_new (T,))."""
    kl_sum, kl3_sum, n_tok, dot_sum, n_dots, agree, signed = 0.0, 0.0, 0, 0.0, 0, 0, 0
    for part, part_after in zip(parts, after, strict=True):
        delta_sum = torch.zeros(len(part.trees), dtype=torch.float64)  # (R_part,) Σ_t (log π_new − log π_old)
        count = torch.zeros(len(part.trees), dtype=torch.float64)  # (R_part,) trainable tokens
        for row, old, logp_new in zip(part.rows, part.old, part_after, strict=True):
            if old is None:  # fused π_old, and the part had no trainable token: the gradient pass never ran
                continue
            mask = row.loss_mask.to(logp_new.device)
            delta = (logp_new - old[0]).double()[mask]  # (K,)
            kl_sum += float(-delta.sum())
            kl3_sum += float((torch.exp(delta) - 1.0 - delta).sum())
            n_tok += int(mask.sum())
            index = row.rollout_index.to(logp_new.device)[mask].cpu()
            delta_sum.index_add_(0, index, delta.cpu())
            count.index_add_(0, index, torch.ones_like(delta, device="cpu"))
        if not grpo:
            continue
        for tree, total, k in zip(part.trees, delta_sum.tolist(), count.tolist(), strict=True):
            if k == 0:
                continue
            mean_delta = total / k
            dot_sum += tree.advantage * mean_delta
            n_dots += 1
            if tree.advantage != 0.0:
                signed += 1
                agree += int(mean_delta != 0.0 and (mean_delta > 0) == (tree.advantage > 0))
    return [kl_sum, kl3_sum, float(n_tok), dot_sum, float(n_dots), float(agree), float(signed)]


def update_stats(sums: Sequence[float], *, grpo: bool = True) -> dict[str, float]:
    """How far the step moved the policy on its own samples (see the module docstring, item 4), from
    :func:`_update_sums` (summed over the ranks)."""
    kl_sum, kl3_sum, n_tok, dot_sum, n_dots, agree, signed = sums
    out = {"update_kl": kl_sum / max(n_tok, 1), "update_kl_k3": kl3_sum / max(n_tok, 1)}
    if grpo and n_dots:
        out["update_adv_dot"] = dot_sum / n_dots
    if grpo and signed:
        out["update_sign_agreement"] = agree / signed
    return out


def _kv_plan(model: torch.nn.Module, part: _Part, config: Hyperparams) -> list[tuple[list[int], int]]:
    """Every row of the part once, as (rows, shared prefix length): groups sharing a prefix (``learner.kv_share``),
    then the rest alone with 0. Off for PPO (its value rows), under activation checkpointing (recomputation
    re-appends), and in lockstep (FSDP2: a group's passes — prefix, suffixes, the prefix's backward — would not pair
    up with another rank's rows)."""
    checkpointing = bool(getattr(model, "is_gradient_checkpointing", False))
    on = config.kv_share_min > 0 and config.algorithm == "grpo" and not checkpointing and not part.lockstep
    groups = plan_groups(part.rows, config.kv_share_min) if on else []
    grouped = {i for members, _ in groups for i in members}
    return groups + [([i], 0) for i in range(len(part.rows)) if i not in grouped]


def _shared_logprobs(model: torch.nn.Module, part: _Part, config: Hyperparams) -> list[torch.Tensor]:
    """:func:`_logprobs` of every row (T,) each, a shared prefix computed once per group (no gradient here); the
    padding rows run too (their passes pair up with other ranks'), their logprobs dropped."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(part.rows)
    for group, m in _kv_plan(model, part, config):
        prefix = PrefixKV(model, part.rows[group[0]], m) if m else None
        for i in group:
            row, past = (suffix_row(part.rows[i], m), prefix.cache()) if prefix is not None else (part.rows[i], None)
            out[i] = _padded((_logprobs(model, row, config, past=past), None), m)[0]
    for row in part.pads:
        _logprobs(model, row, config)
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


def _tree_tokens(tree: ScoredTree) -> int:
    return sum(len(s.tokens) for s in tree.segments)


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
    common: dict[str, Any] = {
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
