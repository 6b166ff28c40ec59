"""Automatic prefix caching for the CPU engine: KV blocks keyed by the chain of token ids before them.

Pure torch (no model, no HTTP, no Kafka; topics: none). The engine (``consumers.inference.engine``) asks
:meth:`PrefixCache.lookup` for the longest cached prefix of a prompt before prefilling it, prefills only the rest,
and hands every full block it computed back with :meth:`PrefixCache.insert`. Use::

    cache = PrefixCache(block_size=32, budget_bytes=2 << 30)
    hit = cache.lookup(prompt)            # Hit(tokens=k, layers=[(K, V) each (1, H_kv, k, D)]) — k % 32 == 0
    cache.insert(tokens, layers)          # layers of ONE unpadded row: (K, V) each (1, H_kv, >= len, D)
    cache.clear()                         # new weights: KV of old weights must never serve new weights

A block of ``block_size`` tokens is keyed by its own tokens AND every token before it (vLLM's automatic prefix
caching), so two prompts share exactly the blocks of their common prefix; partial blocks are never cached. A hit is
only taken after the block's tokens and parent are compared (a hash collision costs a miss, never a wrong answer);
eviction is least recently used first within a byte budget, deep blocks before the prefix they hang from; each block
is ONE tensor (L, 2, H_kv, block_size, D), copied out on a hit. Why, and each rule in detail:
docs/inference.md#the-prefix-caches-blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_ROOT = 0  # key of the empty prefix


@dataclass
class _Block:
    key: int
    parent: int  # key of the block before it (_ROOT for the first)
    tokens: tuple[int, ...]
    kv: torch.Tensor  # (L, 2, H_kv, block_size, D)
    children: int = 0


@dataclass
class Hit:
    """The cached prefix of a prompt: ``tokens`` ids (a multiple of the block size) and their KV per layer."""

    tokens: int
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (K, V) each (1, H_kv, T, D)
    buffer: torch.Tensor | None = None  # (L, 2, H_kv, T + reserve, D): ``layers`` are views of its first T columns


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens found cached
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """A pool of KV blocks with a memory budget and LRU eviction (not thread-safe: the scheduler thread owns it)."""

    def __init__(self, block_size: int = 32, budget_bytes: int = 2 << 30) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be non-negative, got {budget_bytes}")
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.stats = PrefixCacheStats()

    @property
    def blocks(self) -> int:
        return len(self._blocks)

    # ---- keys ------------------------------------------------------------------------------------------------
    @staticmethod
    def _key(parent: int, tokens: tuple[int, ...]) -> int:
        key = hash((parent, tokens))
        return key if key != _ROOT else 1

    def _chain(self, tokens: Sequence[int]) -> list[_Block]:
        """The cached blocks covering the longest cached prefix of ``tokens``, root first."""
        chain: list[_Block] = []
        parent = _ROOT
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            block_tokens = tuple(tokens[start : start + size])
            block = self._blocks.get(self._key(parent, block_tokens))
            if block is None or block.parent != parent or block.tokens != block_tokens:
                break
            chain.append(block)
            parent = block.key
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # leaf first: parents end up more recent than their children
            self._blocks.move_to_end(block.key)

    # ---- public ----------------------------------------------------------------------------------------------
    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` are cached (no stats, no LRU touch)."""
        return len(self._chain(tokens)) * self.block_size

    def lookup(self, tokens: Sequence[int], *, limit: int | None = None, count: bool = True, reserve: int = 0) -> Hit:
        """The longest cached prefix of ``tokens`` (at most ``limit`` tokens, rounded down to whole blocks), its KV
        copied out into ``Hit.buffer`` (L, 2, H_kv, T + ``reserve``, D), the rest of which is left for the caller
        to fill. ``count`` adds the query to the hit-rate statistics."""
        chain = self._chain(tokens if limit is None else tokens[:limit])
        if count:
            self.stats.queries += len(tokens)
            self.stats.hits += len(chain) * self.block_size
        if not chain:
            return Hit(0)
        self._touch(chain)
        first = chain[0].kv
        t = len(chain) * self.block_size
        buffer = first.new_empty((*first.shape[:3], t + reserve, first.shape[4]))  # (L, 2, H_kv, T + reserve, D)
        torch.cat([block.kv for block in chain], dim=3, out=buffer[:, :, :, :t])
        layers = [(buffer[i, 0, :, :t].unsqueeze(0), buffer[i, 1, :, :t].unsqueeze(0)) for i in range(len(buffer))]
        return Hit(t, layers, buffer)

    def insert(self, tokens: Sequence[int], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Cache every full block of ``tokens`` whose KV is in ``layers`` (one unpadded row: (K, V) each
        (1, H_kv, >= len(tokens), D) — columns past ``len(tokens)`` are ignored). Returns the blocks added."""
        if self.budget_bytes == 0:
            return 0
        size = self.block_size
        length = min(len(tokens), int(layers[0][0].shape[2])) if layers else 0
        chain = self._chain(tokens[:length])
        parent = chain[-1].key if chain else _ROOT
        added = 0
        for start in range(len(chain) * size, length - size + 1, size):
            block_tokens = tuple(tokens[start : start + size])
            key = self._key(parent, block_tokens)
            if key in self._blocks:  # a colliding key of another chain: stop caching this chain here
                break
            kv = torch.stack(
                [torch.stack([k[0, :, start : start + size], v[0, :, start : start + size]]) for k, v in layers]
            )  # (L, 2, H_kv, size, D), a copy
            block = _Block(key, parent, block_tokens, kv)
            nbytes = kv.numel() * kv.element_size()
            if nbytes > self.budget_bytes:
                break
            self._blocks[key] = block
            self.bytes += nbytes
            if parent != _ROOT:
                self._blocks[parent].children += 1
            chain.append(block)
            parent = key
            added += 1
        self._touch(chain)
        self.stats.inserted_blocks += added
        self._evict(keep=chain)
        return added

    def clear(self) -> None:
        """Drop every block (the weights changed)."""
        self._blocks.clear()
        self.bytes = 0

    # ---- eviction --------------------------------------------------------------------------------------------
    def _evict(self, keep: list[_Block]) -> None:
        """Evict least recently used leaves until within budget; blocks in ``keep`` go last."""
        protected = {block.key for block in keep}
        while self.bytes > self.budget_bytes and self._blocks:
            victim = next((b for b in self._blocks.values() if b.children == 0 and b.key not in protected), None)
            if victim is None:  # only the chain just inserted is left: trim it from its end
                victim = next(b for b in reversed(keep) if b.key in self._blocks)
            self._remove(victim)

    def _remove(self, block: _Block) -> None:
        del self._blocks[block.key]
        self.bytes -= block.kv.numel() * block.kv.element_size()
        self.stats.evicted_blocks += 1
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.children -= 1
