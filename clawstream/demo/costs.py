"""What a rollout costs, per harness, read back from a run's event log after the fact.

Topics in (the run's prefix, from the beginning, read_committed; nothing produced): ``clawstream.rollout.requests``
(which harness ran each rollout; training rollouts only), ``clawstream.calls`` (every model call the proxy served:
prompt tokens, the engine's cached prompt tokens), ``clawstream.rewards`` (when the rollout ended).

Per harness, the mean per rollout of: model calls (side calls such as a title included), prompt tokens, cached
prompt tokens (as the engine reported them; 0 where it reports none) and seconds from the rollout's first call to
its final reward (harness, proxy, engine, sandbox and grading; not its wait in the worker's queue), the same figures
``warmstart.record.summarize`` reports for demonstrations (bench/results/real_harness.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from clawbase.settings import KafkaSettings
from clawstream.demo.timeline import read_topics
from schemas.events import CallEvent, RewardEvent, RewardStatus, RolloutRequest
from schemas.topics import CALLS, REWARDS, ROLLOUT_REQUESTS

FIGURES = ("calls", "prompt_tokens", "cached_tokens", "seconds")


def rollout_costs(records: Mapping[str, Iterable[bytes]]) -> dict[str, dict[str, float | int]]:
    """Harness → {rollouts, rewarded, calls, prompt_tokens, cached_tokens, seconds (means per rollout),
    cached_share}; ``records``: topic → values. Seconds average over the rollouts with a call and a final reward."""
    harness: dict[str, str] = {}
    for raw in records.get(ROLLOUT_REQUESTS, ()):
        req = RolloutRequest.from_bytes(raw)
        if not req.eval:
            harness[req.rollout_id] = req.harness
    calls: dict[str, int] = defaultdict(int)
    prompt: dict[str, int] = defaultdict(int)
    cached: dict[str, int] = defaultdict(int)
    first_call: dict[str, int] = {}
    for raw in records.get(CALLS, ()):
        call = CallEvent.from_bytes(raw)
        rid = call.rollout_id
        calls[rid] += 1
        prompt[rid] += call.prompt_len
        cached[rid] += call.cached_prompt_tokens or 0
        first_call[rid] = min(first_call.get(rid, call.timestamp_ms), call.timestamp_ms)
    ended: dict[str, int] = {}
    for raw in records.get(REWARDS, ()):
        reward = RewardEvent.from_bytes(raw)
        if reward.status != RewardStatus.INFRA_FAILURE:  # re-issued: the rollout ends with a later attempt
            ended[reward.rollout_id] = max(ended.get(reward.rollout_id, 0), reward.timestamp_ms)
    by_harness: dict[str, list[str]] = defaultdict(list)
    for rid, name in harness.items():
        by_harness[name].append(rid)
    out: dict[str, dict[str, float | int]] = {}
    for name, rids in sorted(by_harness.items()):
        timed = [(ended[r] - first_call[r]) / 1000 for r in rids if r in ended and r in first_call]
        n = len(rids)
        total_prompt = sum(prompt[r] for r in rids)
        out[name] = {
            "rollouts": n,
            "rewarded": sum(r in ended for r in rids),
            "calls": round(sum(calls[r] for r in rids) / n, 2),
            "prompt_tokens": round(total_prompt / n, 1),
            "cached_tokens": round(sum(cached[r] for r in rids) / n, 1),
            "seconds": round(sum(timed) / len(timed), 2) if timed else 0.0,
            "cached_share": round(sum(cached[r] for r in rids) / total_prompt, 4) if total_prompt else 0.0,
        }
    return out


def read_costs(kafka: KafkaSettings, timeout: float = 60.0) -> dict[str, dict[str, float | int]]:
    """Read the run's topics to their current ends and compute :func:`rollout_costs`."""
    return rollout_costs(read_topics(kafka, (ROLLOUT_REQUESTS, CALLS, REWARDS), timeout))
