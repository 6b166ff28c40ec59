"""The cache-affine router (producers/proxy/router.py): stickiness, prefix placement, overload spill, failover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.proxy.router import POLICIES, Router

BLOCK = 4


def prompt(tag: int, n: int = 32) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def test_affinity_keeps_a_rollout_on_its_engine() -> None:
    router = Router(["a", "b", "c"], block_size=BLOCK)
    first = router.route("r1", prompt(1))
    router.done(first, prompt(1, 40))
    for turn in range(5):  # other rollouts' calls come and go meanwhile
        other = router.route(f"x{turn}", prompt(10 + turn))
        router.done(other, prompt(10 + turn))
        engine = router.route("r1", prompt(1, 40 + 8 * turn))
        assert engine == first
        router.done(engine, prompt(1, 48 + 8 * turn))


def test_a_first_call_goes_where_its_prefix_is_cached() -> None:
    router = Router(["a", "b", "c"], block_size=BLOCK)
    for rollout, tag in (("r1", 1), ("r2", 2), ("r3", 3)):
        router.done(router.route(rollout, prompt(tag)), prompt(tag))
    holder = router.sticky["r2"]
    # A new rollout (a GRPO sibling) whose prompt starts with r2's: it goes to r2's engine, not round the pool.
    assert router.route("r4", prompt(2, 24) + [7, 7, 7, 7]) == holder


def test_overload_spills_new_work_elsewhere() -> None:
    router = Router(["a", "b"], block_size=BLOCK, imbalance=0.5, slack=1)
    hot = router.route("r0", prompt(1))
    placed = [router.route(f"r{i}", prompt(1)) for i in range(1, 8)]  # all want the hot engine's prefix
    loads = {name: s.load for name, s in router.state.items()}
    assert set(placed) == {"a", "b"}, placed
    assert max(loads.values()) <= 1.5 * (sum(loads.values()) / 2) + 1, loads
    # Its own later call also leaves a hot engine once it is past the bound.
    for i in range(8, 12):
        router.route(f"r{i}", prompt(5))
    assert router.state[hot].load <= 1.5 * (sum(s.load for s in router.state.values()) / 2) + 1


def test_failover_moves_a_dead_engines_rollouts() -> None:
    router = Router(["a", "b", "c"], block_size=BLOCK)
    engine = router.route("r1", prompt(1))
    router.done(engine, prompt(1, 40))
    router.mark_dead(engine)
    for i in range(20):
        assert router.route(f"n{i}", prompt(100 + i)) != engine
    moved = router.route("r1", prompt(1, 48))
    assert moved != engine and router.state[moved].alive
    assert router.route("r1", prompt(1, 56)) == moved  # and stays on its new engine


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_skips_dead_engines_and_is_deterministic(policy: str) -> None:
    runs = []
    for _ in range(2):
        router = Router(["a", "b", "c", "d"], policy=policy, block_size=BLOCK)
        router.mark_dead("c")
        picks = [router.route(f"r{i % 5}", prompt(i % 3)) for i in range(30)]
        assert "c" not in picks
        runs.append(picks)
    assert runs[0] == runs[1]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Router(["a"], policy="random")


def test_the_benchmark_replays_the_committed_real_harness_trace(tmp_path: Path) -> None:
    from bench import router as bench

    rollouts = bench.read_jsonl(bench.TRACES["harness"])
    assert len(rollouts) >= 40 and all(call.prompt for r in rollouts for call in r.calls)
    params = bench.Params()
    affinity = bench.simulate(rollouts, 8, "affinity", params)
    round_robin = bench.simulate(rollouts, 8, "round_robin", params)
    assert affinity.hit_rate >= 1.5 * round_robin.hit_rate  # the goal at N = 8
    assert abs(sum(affinity.shares) - 1) < 1e-9
    # A JSON-lines trace of full prompts (the --trace format) replays too.
    trace = tmp_path / "t.jsonl"
    lines = [
        {"rollout_id": f"r{r}", "timestamp_ms": r, "seq": s, "prompt_token_ids": list(range(64 + 40 * s)),
         "completion_tokens": 4}
        for r in range(3) for s in range(2)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert bench.simulate(bench.read_jsonl(trace), 2, "affinity", params).hit_rate > 0.5
