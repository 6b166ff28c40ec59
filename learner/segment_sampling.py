"""A trainable segment's sampling settings, as the learner recomputes its logprobs (``learner.pack``, "Sampling
settings"): its call's (temperature, top_p, top_k) recorded by the proxy, refused when missing or impossible.

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
    """(temperature, top_p, top_k) of a trainable segment; see "Sampling settings" in the module docstring."""
    if not hasattr(seg, "temperature"):
        return PLAIN_SAMPLING
    values = (getattr(seg, "temperature", None), getattr(seg, "top_p", None), getattr(seg, "top_k", None))
    call = getattr(seg, "call_id", None)
    what = f"trainable segment {index}" + (f" (call {call})" if call else "")
    if any(v is None for v in values):
        raise UnreproducibleSampling(
            f"{what} carries no sampling settings (temperature={values[0]}, top_p={values[1]}, top_k={values[2]}): "
            "it was recorded by a proxy that did not record them, so the distribution behind its rollout logprobs is "
            "unknown and importance weights against it would be biased; re-run those rollouts with a current proxy"
        )
    temperature, top_p, top_k = float(values[0]), float(values[1]), int(values[2])
    if not (math.isfinite(temperature) and temperature >= 0 and 0 < top_p <= 1 and top_k >= 0):
        raise UnreproducibleSampling(
            f"{what} was sampled with temperature={temperature}, top_p={top_p}, top_k={top_k}: not settings the "
            "engine samples with (temperature >= 0, 0 < top_p <= 1, top_k >= 0), so its logprobs cannot be recomputed"
        )
    return temperature, top_p, top_k
