"""Evaluation requests are seeded per task × harness × mode × sample: two evaluations draw the same seeds (a rerun or
the after-training evaluation reproduces the draws of the first), different rollouts draw different ones, and the
seed survives the Avro round trip to the sandbox worker. That the seed reaches the engine and makes a rerun draw the
same tokens: tests/integration/test_eval_seeds.py."""

from __future__ import annotations

from clawbase.settings import KafkaSettings
from producers.scheduler.plan import eval_seed
from producers.scheduler.service import Scheduler
from producers.scheduler.settings import SchedulerSettings
from schemas.events import RolloutRequest


def _requests(**overrides: object) -> list[RolloutRequest]:
    settings = SchedulerSettings(
        **{
            "eval_limit": 4,
            "eval_harnesses": ["agentloop", "agentloop-anthropic"],
            "eval_modes": ["greedy", "sampled"],
            "eval_repeats": 3,
            **overrides,
        }
    )
    return Scheduler(settings, KafkaSettings()).eval_requests()  # never connects: only plans


def _by_rollout(requests: list[RolloutRequest]) -> dict[tuple[str, str, str, int], int | None]:
    out: dict[tuple[str, str, str, int], int | None] = {}
    for r in requests:
        key = (r.task_id, r.harness, r.metadata["eval_mode"])
        n = sum(1 for k in out if k[:3] == key)
        out[(*key, n)] = r.seed
    return out


def test_every_eval_rollout_has_its_own_seed_and_a_rerun_has_the_same() -> None:
    first, again = _by_rollout(_requests()), _by_rollout(_requests())
    assert len(first) == 4 * 2 * (1 + 3)
    assert first == again  # fresh rollout ids, the same draws
    seeds = list(first.values())
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds)
    assert len(set(seeds)) == len(seeds), "two eval rollouts share a seed"


def test_the_base_seed_changes_every_seed_and_none_leaves_them_unseeded() -> None:
    base0, base1 = _by_rollout(_requests()), _by_rollout(_requests(eval_seed=1))
    assert base0.keys() == base1.keys() and not set(base0.values()) & set(base1.values())
    assert all(s is None for s in _by_rollout(_requests(eval_seed=None)).values())


def test_the_seed_is_a_pure_function_of_its_parts() -> None:
    assert eval_seed(0, "cpu", "t1", "agentloop", "sampled", 0) == eval_seed(0, "cpu", "t1", "agentloop", "sampled", 0)
    parts = [(0, "cpu", "t1", "agentloop", "sampled", 0), (0, "cpu", "t2", "agentloop", "sampled", 0)]
    parts += [(0, "cpu", "t1", "opencode", "sampled", 0), (0, "cpu", "t1", "agentloop", "greedy", 0)]
    parts += [(0, "cpu", "t1", "agentloop", "sampled", 1), (0, "x", "t1", "agentloop", "sampled", 0)]
    assert len({eval_seed(*p) for p in parts}) == len(parts)


def test_the_seed_survives_the_avro_round_trip() -> None:
    req = _requests()[0]
    assert req.seed is not None and RolloutRequest.from_bytes(req.to_bytes()).seed == req.seed
    req.seed = None
    assert RolloutRequest.from_bytes(req.to_bytes()).seed is None
