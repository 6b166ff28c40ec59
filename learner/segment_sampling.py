"""A trainable segment's sampling settings, as the learner recomputes its logprobs: its call's (temperature, top_p,
top_k) recorded by the proxy, refused when missing or impossible (docs/method.md#off-policy-correction, "Same
distribution on both sides").

Pure: no Kafka, no torch.
"""

from __future__ import annotations

import math

from clawbase.errors import ClawstreamError

__all__ = ["PLAIN_SAMPLING", "UnreproducibleSampling", "segment_sampling"]

# What a segment without sampling attributes means: temperature 1, top_p 1 (off), top_k 0 (off).
PLAIN_SAMPLING = (1.0, 1.0, 0)


class UnreproducibleSampling(ClawstreamError):
    """A trainable segment's sampling settings are missing or are not ones the learner can recompute logprobs for."""


def segment_sampling(seg: object, index: int) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) of a trainable segment; plain settings for a segment without the attributes."""
    if not hasattr(seg, "temperature"):
        return PLAIN_SAMPLING
    raw_t, raw_p, raw_k = getattr(seg, "temperature", None), getattr(seg, "top_p", None), getattr(seg, "top_k", None)
    call = getattr(seg, "call_id", None)
    what = f"trainable segment {index}" + (f" (call {call})" if call else "")
    if raw_t is None or raw_p is None or raw_k is None:
        raise UnreproducibleSampling(
            f"{what} carries no sampling settings (temperature={raw_t}, top_p={raw_p}, top_k={raw_k}): "
            "it was recorded by a proxy that did not record them, so the distribution behind its rollout logprobs is "
            "unknown and importance weights against it would be biased; re-run those rollouts with a current proxy"
        )
    temperature, top_p, top_k = float(raw_t), float(raw_p), int(raw_k)
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1 and top_k >= 0):
        raise UnreproducibleSampling(
            f"{what} was sampled with temperature={temperature}, top_p={top_p}, top_k={top_k}: not settings the "
            "engine samples with (temperature >= 0, 0 < top_p <= 1, top_k >= 0), so its logprobs cannot be recomputed"
        )
    return temperature, top_p, top_k
