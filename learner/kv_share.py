"""Context shared by rows of their own, computed once: the common prefix's keys and values, with gradient.

Rollouts over the token budget are trained path by path, each path a chain row of its own (``learner.tree_split``),
so the context they begin with — a harness's system prompt and tool schemas (13–40k tokens for the real harnesses),
a group's task prompt, an OpenClaw tree's trunk — was computed again in every row; ``learner.prefix_share`` only
shares within a packed row. Here chain rows whose first ``m`` tokens are the same pure context (out of the loss,
logprob 0, plain sampling) form a group: the decoder runs once on those ``m`` tokens, keeping their per-layer keys
and values; each row then runs only its suffix, attending to detached leaf copies of them (a fresh cache per row:
the model appends to it); after the group's last row the accumulated gradient of the leaves flows back through the
prefix in one backward pass. Gradients equal per-path training's (tests/unit/test_kv_share.py, 1e-5); the token
after the prefix must not be trained, since its predictor is the prefix's last position (so ``m`` stops one short).

Not used with activation checkpointing (its recomputation would append to the cache again) nor for PPO's value
rows. Memory: the prefix's activations live while its group's suffixes run — about one full row's, the peak the
memory plan already counts (learner/memory.py). Pure torch, no Kafka; used by ``learner.step``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, cast

import torch

from learner.pack import MicroBatch
from policy.token_prefix import common_prefix_len_all, leading_run

__all__ = ["PrefixKV", "plan_groups", "suffix_row"]


def _shareable(row: MicroBatch) -> torch.Tensor:
    """(T,) bool: pure context, the kind another row may hold in common (the same rule as learner.prefix_share)."""
    return ~row.loss_mask & (row.rollout_logprobs == 0) & (row.temperature == 1) & (row.top_p == 1) & (row.top_k == 0)


def _chain_context(row: MicroBatch) -> torch.Tensor:
    """(T,) bool: pure context at its chain position (position i holds the row's i-th token)."""
    return _shareable(row) & (row.position_ids == torch.arange(len(row.position_ids), device=row.position_ids.device))


def _common_length(rows: Sequence[MicroBatch]) -> int:
    """Leading tokens every row has alike (same ids at positions 0, 1, ...) and as pure context, less one."""
    alike = common_prefix_len_all([r.input_ids.cpu().numpy() for r in rows])
    run = min(alike, *(leading_run(_chain_context(r).cpu().numpy()) for r in rows))
    # The token right after the prefix is predicted from the prefix's last position: it stays in the suffix, so the
    # prefix ends one token before the shared run does (that token is then context in every row).
    return max(run - 1, 0)


def plan_groups(rows: Sequence[MicroBatch], min_tokens: int) -> list[tuple[list[int], int]]:
    """Groups of ≥ 2 chain rows sharing ≥ ``min_tokens`` leading context tokens: (row indices, prefix length)."""
    if min_tokens <= 0:
        return []
    by_head: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row.is_chain and row.num_tokens > min_tokens:
            by_head[tuple(row.input_ids[:min_tokens].tolist())].append(i)
    groups: list[tuple[list[int], int]] = []
    for members in by_head.values():
        if len(members) > 1:
            groups += _best_split(rows, members, min_tokens)
    return groups


def _best_split(rows: Sequence[MicroBatch], members: list[int], min_tokens: int) -> list[tuple[list[int], int]]:
    """One group of ``members``, or subgroups split where their context first differs, whichever computes fewer
    tokens again. Why: opencode puts the date in its system prompt, so a batch spanning midnight shared 3.8k of a
    13k-token prefix as one group (the learner's step went from 43 s to 401 s); split by the date, each half shares
    all 13k."""
    m = _common_length([rows[i] for i in members])
    whole = [(members, m)] if m >= min_tokens else []
    parts: dict[object, list[int]] = defaultdict(list)
    at = m + 1  # the first position where the rows differ (or stop being context, or end)
    for i in members:
        row = rows[i]
        alike = at < row.num_tokens and bool(_shareable(row)[at])
        parts[int(row.input_ids[at]) if alike else ("alone", i)].append(i)
    if len(parts) < 2:
        return whole
    split = [g for part in parts.values() if len(part) > 1 for g in _best_split(rows, part, min_tokens)]
    saved = sum(n * (len(g) - 1) for g, n in split)
    return split if saved > sum(n * (len(g) - 1) for g, n in whole) else whole


def suffix_row(row: MicroBatch, m: int) -> MicroBatch:
    """A chain row without its first ``m`` tokens: positions keep counting from ``m``, predictors shift by ``m``."""
    per_token = {
        f.name: getattr(row, f.name)[m:]
        for f in dataclasses.fields(row)
        if isinstance(getattr(row, f.name), torch.Tensor) and f.name not in ("segment_ancestors", "predictor")
    }
    predictor = row.predictor[m:] - m
    per_token["predictor"] = torch.where(predictor >= 0, predictor, torch.full_like(predictor, -1))
    per_token["segment_ids"] = torch.zeros_like(row.segment_ids[m:])  # one chain: one segment, the causal mask
    return dataclasses.replace(row, **per_token, segment_ancestors=torch.ones(1, 1, dtype=torch.bool))


class PrefixKV:
    """The decoder run once on a prefix; :meth:`cache` hands each suffix its keys and values, :meth:`backward` ends."""

    def __init__(self, model: torch.nn.Module, row: MicroBatch, m: int) -> None:
        device = next(model.parameters()).device
        body = cast(Any, model).get_decoder()
        out = body(
            input_ids=row.input_ids[:m].to(device)[None],  # (1, m)
            position_ids=torch.arange(m, device=device)[None],
            use_cache=True,
        )
        self.config = cast(Any, model).config
        self.kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]  # each (1, kv_heads, m, d)
        self.leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in self.kv]
        self.tokens = m

    def cache(self) -> Any:
        """A fresh cache over the leaves (the model appends the suffix's keys and values to what it is given)."""
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=list(self.leaves), config=self.config)

    def backward(self) -> None:
        """The gradient the suffixes left on the leaves, through the prefix's computation, once."""
        pairs = [
            (t, leaf.grad) for kv, lv in zip(self.kv, self.leaves, strict=True) for t, leaf in zip(kv, lv, strict=True)
        ]
        pairs = [(t, g) for t, g in pairs if g is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.kv, self.leaves = [], []
