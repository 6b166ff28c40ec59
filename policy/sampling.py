"""Sampling maths for the CPU engine: temperature, top-k, top-p, the reported log-probs, and seeded draws.

Pure torch, no model, no HTTP, no Kafka; unit-tested in ``tests/unit/test_engine.py``. Everything works on a batch
of rows, one row per sequence, each with its own parameters.

Which log-probs are reported (read this before using them for importance sampling)
------------------------------------------------------------------------------------
``logprob`` of a sampled token is ``log q(token)`` where ``q`` is the distribution the token was ACTUALLY drawn from:
``q = softmax(top_p(top_k(logits / T)))``, renormalised after truncation. That is vLLM's ``processed_logprobs``
mode. vLLM's default is ``raw_logprobs`` (``--logprobs-mode``, ``ModelConfig.logprobs_mode`` in
vllm/config/model.py: "Raw means the values before applying any logit processors [...] Processed means the values
after applying all processors, including temperature and top_k/top_p"), i.e. ``log_softmax(logits)`` at
temperature 1 whatever the request's temperature. For RL the behaviour policy is ``q``: the truncated
importance weight ``min(exp(log pi_old - log pi_rollout), c)`` is only unbiased when ``log pi_rollout`` is the
log-prob under the distribution that produced the sample, so ``processed_logprobs`` is our default. The engine's
``logprobs_mode="raw_logprobs"`` reproduces vLLM's default for comparisons. A vLLM server used as the engine for
training must be started with ``--logprobs-mode processed_logprobs`` to match.

Greedy rows (temperature < ``GREEDY_EPS``) take the argmax; like vLLM's ``apply_temperature`` they are scaled by
1, so their reported log-prob is the model's own (after top-k/top-p), never a degenerate 0.
"""

from __future__ import annotations

import torch

# Below this a temperature means greedy decoding (vLLM's _SAMPLING_EPS in vllm/v1/sample/sampler.py).
GREEDY_EPS = 1e-5

# vLLM clamps -inf log-probs to this in JSON (vllm/entrypoints/openai/completion/serving.py).
MIN_REPORTED_LOGPROB = -9999.0


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits`` (B, V) / ``temperature`` (B,), in float32; greedy rows are divided by 1."""
    temp = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)  # (B,)
    return logits.float() / temp.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``top_k`` largest logits of each row (ties at the k-th value are kept); ``top_k <= 0`` disables."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))  # (B,)
    sorted_desc = logits.sort(dim=-1, descending=True).values  # (B, V)
    kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))  # (B, 1) the k-th largest value
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass reaches ``top_p``.

    A token is dropped when the mass of the strictly more likely tokens already reaches ``top_p``; the most
    likely token always survives. ``top_p >= 1`` leaves the row untouched.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of the tokens ranked above each token
    # Rows with top_p >= 1 must never drop: their cumulative sum can round up to 1 before the tail.
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def processed_logprobs(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs (B, V) of the distribution tokens are drawn from: temperature, then top-k, then top-p.

    ``None`` skips a stage for every row; the caller decides from the request parameters it holds on the host,
    so no step needs a device-to-host sync (or a (B, V) sort) just to find out that nobody asked for top-p.
    """
    out = logits.float() if temperature is None else apply_temperature(logits, temperature)
    if top_k is not None:
        out = apply_top_k(out, top_k)
    if top_p is not None:
        out = apply_top_p(out, top_p)
    return torch.log_softmax(out, dim=-1)


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's default ``raw_logprobs``: ``log_softmax`` of the unprocessed logits (B, V)."""
    return torch.log_softmax(logits.float(), dim=-1)


def sample(logprobs: torch.Tensor, greedy: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row from ``exp(logprobs)`` (B, V); greedy rows take the argmax. Returns (B,) int64.

    vLLM's batched draw (``random_sample`` in vllm/v1/sample/sampler.py): ``argmax(p / E)`` with ``E ~ Exp(1)``
    i.i.d. picks token i with probability p_i, in one kernel for the whole batch; only rows with their own
    ``torch.Generator`` (seeded requests) redraw their noise from it, so a seeded sequence draws the same tokens
    whatever else shares its batch. Tokens with probability 0 (cut by top-k/top-p) are never drawn.
    """
    probs = logprobs.exp()  # (B, V)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logprobs.argmax(dim=-1), drawn)


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row: (values (B, k), ids (B, k)); ``k = 0`` gives empty tensors."""
    if k <= 0:
        empty = logprobs.new_empty((logprobs.shape[0], 0))
        return empty, empty.long()
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return values, ids


def clamp_logprob(value: float) -> float:
    """A log-prob as vLLM puts it in JSON: ``-inf`` becomes ``MIN_REPORTED_LOGPROB``."""
    return max(value, MIN_REPORTED_LOGPROB)
