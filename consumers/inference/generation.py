"""What goes in and out of the CPU engine: sampling settings, generated sequences, results, weight swaps.

Plain dataclasses (no model, no HTTP, no Kafka; topics: none), shared by the engine (``consumers.inference.engine``),
the OpenAI-protocol layer (``consumers.inference.protocol``) and the weight follower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from clawbase.errors import ClawstreamError
from policy import sampling


class EngineError(ClawstreamError):
    """The engine could not run a request (stopped, or the model failed)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (a subset of vLLM's ``SamplingParams``, same meanings and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no top-logprobs; k >= 0: the sampled token + the k most likely
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < sampling.GREEDY_EPS


@dataclass
class SequenceOutput:
    """One generated sequence (one OpenAI ``choice``)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-prob of each sampled token (see .sampling)
    # Per step when requested: [(sampled id, logprob), then the k most likely (id, logprob)], vLLM's order.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended it; None for eos or length (as vLLM)


@dataclass
class GenerationResult:
    request_id: str
    prompts: list[list[int]]
    outputs: list[SequenceOutput]  # prompt-major, then sample index: vLLM's choice order
    policy_version: int
    queued_s: float  # submit → admitted
    total_s: float  # submit → finished
    # Per prompt: how many of its tokens came from the prefix cache (vLLM's usage.prompt_tokens_details).
    cached_tokens: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SwapOutcome:
    version: int
    error: BaseException | None
    wait_s: float  # swap requested → batch drained (in-flight requests finishing on the old weights)
    apply_s: float  # copying the new weights in


@dataclass
class WeightSwap:
    """New weights to apply between steps: ``apply(model)`` copies them in; ``done`` hears how it went."""

    version: int
    apply: Callable[[torch.nn.Module], None]
    done: Callable[[SwapOutcome], None]
    requested_at: float = field(default_factory=time.monotonic)


Callback = Callable[[GenerationResult | BaseException], None]
