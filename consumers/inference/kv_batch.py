"""Bookkeeping of a left-padded batch of sequences that share one transformers ``DynamicCache``.

Pure torch (no model, no HTTP, no Kafka; topics: none); the engine (``consumers.inference.engine``) keeps its running
batch
in a :class:`KVBatch` and uses :func:`left_pad`, :func:`select` and :func:`merge` to add and drop sequences
without recomputing anyone's prefix. Layout: every row is right-aligned, so column T-1 holds each row's newest
cached token; ``mask`` says which columns are real for a row; positions are per row, so padding never shifts a
rotary position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


@dataclass
class KVBatch:
    """One row per active sequence, left-padded to a common cache length T."""

    cache: DynamicCache  # per layer keys/values (B, H_kv, T, D)
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


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
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
        DynamicCache(ddp_cache_data=layers),
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
        layers.append((
            torch.cat([_pad_left(ka, ea, 2), _pad_left(kb, eb, 2)]),
            torch.cat([_pad_left(va, ea, 2), _pad_left(vb, eb, 2)]),
        ))  # fmt: skip
    mask = torch.cat([_pad_left(a.mask, width - a.mask.shape[1], 1), _pad_left(b.mask, width - b.mask.shape[1], 1)])
    return KVBatch(
        DynamicCache(ddp_cache_data=layers),
        mask,
        torch.cat([a.positions, b.positions]),
        torch.cat([a.pending, b.pending]),
        a.rows + b.rows,
    )
