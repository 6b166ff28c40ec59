"""Cache-affine routing of model calls over a pool of engines: pure, no Kafka, no HTTP (topics: none).

The proxy's engine pool (``producers.proxy.engine_pool``) asks it for an engine per call. Use::

    router = Router(["e0", "e1"], policy="affinity", block_size=32)
    engine = router.route("rollout-1", prompt_ids)   # pick an engine; load += 1
    router.done(engine, prompt_ids + answer_ids)     # load -= 1; the engine now holds that prefix
    router.mark_dead("e1")                           # failover: its rollouts move, nothing goes to it
    router.drop_cache("e0")                          # e0 swapped weights: its cache is empty

Policies (:data:`POLICIES`): ``affinity`` — a rollout's first call goes to the engine with the longest cached prefix
among those not overloaded (load ≤ (1 + imbalance) × mean load + slack), ties to the least loaded; later calls stay
on the rollout's engine unless it is overloaded or dead; ``round_robin``; ``least_loaded``. The router's view of
each engine's cache is approximate: a bounded LRU of block-chain keys (the engine's block size, 32 on the CPU
engine: ``consumers.inference.prefix_cache``) filled from what it routed there, so evictions the engine makes on
its own are not seen. Deterministic: ties break by engine order. Why and numbers: docs/scaling.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """One key per full block, chaining every token before it (as the engine keys its KV blocks)."""
    keys: list[int] = []
    parent = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


class BlockIndex:
    """An approximate prefix index of one engine's cache: LRU of block-chain keys, at most ``capacity_blocks``."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._keys)

    def matched(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` are held (a chain breaks at the first missing block)."""
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n

    def add(self, keys: Sequence[int]) -> None:
        """Hold ``keys`` (a prompt's chain), most recent last; the root-side blocks are touched last so eviction
        removes deep blocks before the prefix they hang from (the engine's rule)."""
        for key in reversed(keys):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity_blocks:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


@dataclass
class EngineState:
    name: str
    index: BlockIndex
    load: int = 0  # calls routed here and not yet done
    alive: bool = True
    routed: int = 0  # calls routed here in total


@dataclass
class Router:
    """Engines, their state, and a routing policy (a name in :data:`POLICIES`)."""

    engines: Sequence[str]
    policy: str = "affinity"
    block_size: int = 32
    capacity_blocks: int = 1 << 16  # per engine: the engine's cache size in blocks
    imbalance: float = 0.5  # an engine is overloaded above (1 + imbalance) × mean load + slack
    slack: int = 2
    state: dict[str, EngineState] = field(init=False)
    sticky: dict[str, str] = field(init=False, default_factory=dict)  # rollout → engine
    _next: int = field(init=False, default=0)  # round robin's cursor

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("a router needs at least one engine")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; known: {sorted(POLICIES)}")
        self.state = {name: EngineState(name, BlockIndex(self.capacity_blocks)) for name in self.engines}

    # ---- what policies see -----------------------------------------------------------------------------------
    def alive(self) -> list[EngineState]:
        live = [s for s in self.state.values() if s.alive]
        if not live:
            raise RuntimeError("no engine is alive")
        return live

    def overloaded(self, engine: EngineState, live: Sequence[EngineState]) -> bool:
        # Counting the call about to be placed keeps an idle pool (mean 0) from calling its first busy engine hot.
        mean = (sum(s.load for s in live) + 1) / len(live)
        return engine.load + 1 > (1 + self.imbalance) * mean + self.slack

    # ---- the public API --------------------------------------------------------------------------------------
    def route(self, rollout_id: str, prompt: Sequence[int]) -> str:
        """The engine for this call; its load counts the call until :meth:`done`."""
        engine = POLICIES[self.policy](self, rollout_id, prompt)
        engine.load += 1
        engine.routed += 1
        engine.index.add(block_keys(prompt, self.block_size))  # prefilled there soon: siblings may share it now
        self.sticky[rollout_id] = engine.name
        return engine.name

    def done(self, engine: str, tokens: Sequence[int]) -> None:
        """A call on ``engine`` finished; ``tokens`` (prompt + answer) are now in its cache."""
        state = self.state[engine]
        state.load = max(0, state.load - 1)
        if state.alive:
            state.index.add(block_keys(tokens, self.block_size))

    def mark_dead(self, engine: str) -> None:
        """Failover: route nothing more to it; its rollouts are placed afresh on their next call. Its load stays:
        the calls still in flight there are each released by :meth:`done` when they fail (or finish)."""
        state = self.state[engine]
        state.alive = False
        state.index.clear()  # a restarted engine comes back with an empty cache
        self.sticky = {r: e for r, e in self.sticky.items() if e != engine}

    def drop_cache(self, engine: str) -> None:
        """The engine emptied its prefix cache (a weight swap drops every cached block): forget what it held."""
        self.state[engine].index.clear()

    def mark_alive(self, engine: str) -> None:
        self.state[engine].alive = True

    def forget(self, rollout_id: str) -> None:
        """The rollout ended: drop its stickiness."""
        self.sticky.pop(rollout_id, None)


def _least_loaded(router: Router, rollout_id: str, prompt: Sequence[int]) -> EngineState:
    return min(router.alive(), key=lambda s: s.load)  # min keeps the first of equals: deterministic


def _round_robin(router: Router, rollout_id: str, prompt: Sequence[int]) -> EngineState:
    names = list(router.state)
    for i in range(len(names)):
        state = router.state[names[(router._next + i) % len(names)]]
        if state.alive:
            router._next = (router._next + i + 1) % len(names)
            return state
    raise RuntimeError("no engine is alive")


def _affinity(router: Router, rollout_id: str, prompt: Sequence[int]) -> EngineState:
    live = router.alive()
    home = router.state.get(router.sticky.get(rollout_id, ""))
    if home is not None and home.alive and not router.overloaded(home, live):
        return home  # its cache holds the rollout's history: every call but the last turn's tokens is a hit
    keys = block_keys(prompt, router.block_size)
    candidates = [s for s in live if not router.overloaded(s, live)] or live
    # Longest cached prefix first, then least loaded, then engine order.
    return max(candidates, key=lambda s: (s.index.matched(keys), -s.load))


POLICIES: dict[str, Callable[[Router, str, Sequence[int]], EngineState]] = {
    "affinity": _affinity,
    "round_robin": _round_robin,
    "least_loaded": _least_loaded,
}
