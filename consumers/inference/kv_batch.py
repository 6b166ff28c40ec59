"""Bookkeeping of a left-padded batch of sequences that share one KV cache, and the cache itself.

Pure torch (no model, no HTTP, no Kafka; topics: none); the engine (``consumers.inference.engine``) keeps its running
batch in a :class:`KVBatch` and uses :func:`left_pad`, :func:`select` and :func:`merge` to add and drop sequences
without recomputing anyone's prefix. Layout: every row is right-aligned, so column T-1 holds each row's newest
cached token; ``mask`` says which columns are real for a row; positions are per row, so padding never shifts a
rotary position.

The cache is a transformers ``Cache`` of :class:`GrowingLayer` s: transformers' ``DynamicLayer`` concatenates the
whole history on every step (``torch.cat``: at 35k tokens that copy costs more than the attention of a decode
step), this layer writes into a buffer with spare capacity and returns views of it. :func:`attention` is SDPA with
grouped-query heads passed through (``enable_gqa``) instead of transformers' ``repeat_kv`` copy when a mask is
present; both are numerically the same attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "clawstream_sdpa"  # the name our attention function is registered under
DECODE_RESERVE = 256  # spare columns of a rebuilt batch cache: most answers finish before it has to grow


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values (B, H_kv, T, D) are views of a buffer grown by doubling."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity_hint = capacity  # columns of the first allocation (a prompt + answer's known size)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self.length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self._k is None or end > self._k.shape[-2]:
            # Grow by a quarter: amortised O(1) copies per token without doubling a 35k-token cache for a reply.
            old = self._k.shape[-2] if self._k is not None else 0
            capacity = max(end, old + old // 4, 64, self.capacity_hint)
            b, h, _, d = key_states.shape
            k = key_states.new_empty((b, h, capacity, d))
            v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
            if self.length:
                k[:, :, : self.length] = self.keys
                v[:, :, : self.length] = self.values
            self._k, self._v = k, v
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take buffers (B, H_kv, capacity, D) whose first ``length`` columns are filled, without copying."""
        self.lazy_initialization(keys, values)
        self._k, self._v, self.length = keys, values, length
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]


def growing_cache(
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None, num_layers: int = 0, reserve: int = 0
) -> Cache:
    """A cache of ``num_layers`` empty :class:`GrowingLayer` s (first allocation ``reserve`` columns), or holding a
    copy of ``layers`` ((K, V) per layer) with room for ``reserve`` more columns."""
    cache = Cache(layers=[GrowingLayer(reserve) for _ in range(len(layers) if layers else num_layers)])
    for layer, (k, v) in zip(cache.layers, layers or [], strict=False):
        t = k.shape[2]
        kb = k.new_empty((*k.shape[:2], t + reserve, k.shape[3]))
        vb = v.new_empty((*v.shape[:2], t + reserve, v.shape[3]))
        kb[:, :, :t], vb[:, :, :t] = k, v
        layer.adopt(kb, vb, t)
    return cache


def adopting_cache(buffer: torch.Tensor, length: int) -> Cache:
    """A cache over ``buffer`` (L, 2, H_kv, capacity, D) — per layer its keys and values, the first ``length``
    columns filled — without copying it."""
    cache = Cache(layers=[GrowingLayer() for _ in range(buffer.shape[0])])
    for i, layer in enumerate(cache.layers):
        layer.adopt(buffer[i, 0].unsqueeze(0), buffer[i, 1].unsqueeze(0), length)
    return cache


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA for query (B, H, S, D) over key/value (B, H_kv, T, D) and a bool mask (B, 1, S, T) or None (causal)."""
    is_causal = attention_mask is None and query.shape[2] > 1
    if is_causal and key.shape[2] != query.shape[2]:  # SDPA's causal mask is top-left aligned: spell it out
        t, s = key.shape[2], query.shape[2]
        attention_mask = torch.ones((s, t), dtype=torch.bool, device=query.device).tril(diagonal=t - s)
        is_causal = False
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # (B, H, S, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_engine_attention(model: torch.nn.Module) -> None:
    """Switch a model on transformers' SDPA attention to :func:`attention` (same maths, no K/V copies)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION)


@dataclass
class KVBatch:
    """One row per active sequence, left-padded to a common cache length T."""

    cache: Cache  # per layer keys/values (B, H_kv, T, D)
    mask: torch.Tensor  # (B, T) int64, 1 where the cache column is a real token of that row
    positions: torch.Tensor  # (B,) position id of each row's pending token (= real tokens cached so far)
    pending: torch.Tensor  # (B,) last sampled token, not yet in the cache
    rows: list[Any]  # per-row payload (the engine's sequence state), same order as the tensors


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """Right-align prompts in a (G, L) grid: returns ids, mask (1 on real tokens) and positions (0.. per row)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (G, L)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (G, L)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # (G, L); pads get 0, they are masked anyway
    return ids.to(device), mask.to(device), positions.to(device)


def cache_layers(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer, each (B, H_kv, T, D)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def select(batch: KVBatch, index: torch.Tensor, rows: list[Any]) -> KVBatch:
    """Keep (or repeat) the rows in ``index`` (B',), in that order, and drop cache columns no kept row uses."""
    mask = batch.mask.index_select(0, index)  # (B', T)
    used = mask.any(dim=0).nonzero()
    start = int(used[0]) if used.numel() else mask.shape[1]
    layers = [
        (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
        for k, v in cache_layers(batch.cache)
    ]
    return KVBatch(
        growing_cache(layers, reserve=DECODE_RESERVE),
        mask[:, start:],
        batch.positions.index_select(0, index),
        batch.pending.index_select(0, index),
        rows,
    )


def _pad_left(t: torch.Tensor, extra: int, dim_from_end: int) -> torch.Tensor:
    """Prepend ``extra`` zeros along the dimension ``dim_from_end`` places from the last (1 = last)."""
    return F.pad(t, (0, 0) * (dim_from_end - 1) + (extra, 0)) if extra else t


def merge(a: KVBatch, b: KVBatch) -> KVBatch:
    """Concatenate two batches along B; the shorter cache gets masked columns on the left."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    layers = []
    for (ka, va), (kb, vb) in zip(cache_layers(a.cache), cache_layers(b.cache), strict=True):
        ea, eb = width - ka.shape[2], width - kb.shape[2]
        layers.append(
            (
                torch.cat([_pad_left(ka, ea, 2), _pad_left(kb, eb, 2)]),
                torch.cat([_pad_left(va, ea, 2), _pad_left(vb, eb, 2)]),
            )
        )
    mask = torch.cat([_pad_left(a.mask, width - a.mask.shape[1], 1), _pad_left(b.mask, width - b.mask.shape[1], 1)])
    return KVBatch(
        growing_cache(layers, reserve=DECODE_RESERVE),
        mask,
        torch.cat([a.positions, b.positions]),
        torch.cat([a.pending, b.pending]),
        a.rows + b.rows,
    )
