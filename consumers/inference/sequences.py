"""The CPU engine's per-sequence state, and the per-step work on its rows: sample, record, stop, cache.

A request (``Request``) is admitted, each of its prompts is prefilled chunk by chunk (``Prefill``), then every sample
becomes a row of the decode batch (``Row``). Each scheduler step samples one token per row from the model's logits
(``sample_and_record``: the sampling transform of ``policy.sampling``, the reported log-probs, vLLM's stop order) and
puts the full blocks of finished sequences into the prefix cache (``cache_sequences``). Used by
``consumers.inference.engine`` only; pure torch (no HTTP, no Kafka; topics: none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.cache_utils import Cache

from consumers.inference.generation import Callback, SamplingParams, SequenceOutput
from consumers.inference.kv_batch import KVBatch, cache_layers
from consumers.inference.prefix_cache import PrefixCache
from policy import sampling

__all__ = ["LogprobsMode", "Prefill", "Request", "Row", "cache_sequences", "row_generator", "sample_and_record"]

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


@dataclass
class Request:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    callback: Callback
    arrival: float
    outputs: list[SequenceOutput] = field(default_factory=list)
    remaining: int = 0
    admitted: float = 0.0
    policy_version: int = 0
    cancelled: bool = False
    cached: list[int] = field(default_factory=list)  # per prompt: tokens taken from the prefix cache


@dataclass
class Prefill:
    """One prompt of an admitted request, being prefilled chunk by chunk in a cache of its own."""

    request: Request
    prompt_index: int
    cache: Cache | None = None
    done: int = 0  # prompt tokens whose KV is in ``cache``

    @property
    def tokens(self) -> list[int]:
        return self.request.prompts[self.prompt_index]

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class Row:
    request: Request
    output: SequenceOutput
    generator: torch.Generator | None


def row_generator(params: SamplingParams, sample_index: int, device: torch.device) -> torch.Generator | None:
    if params.seed is None or params.greedy:
        return None
    # vLLM gives the i-th of n parallel samples the seed `seed + i` (vllm/v1/engine/parallel_sampling.py).
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed + sample_index)
    return generator


def sample_and_record(
    rows: list[Row],
    logits: torch.Tensor,
    *,
    logprobs_mode: LogprobsMode,
    eos_token_ids: frozenset[int],
    device: torch.device,
) -> torch.Tensor:
    """Sample one token per row from logits (B, V), append it and its log-prob to each output; returns (B,)."""
    params = [row.request.params for row in rows]
    dev = device
    temperature = torch.tensor([p.temperature for p in params], device=dev)  # (B,)
    # Stages nobody in the batch asked for are skipped (decided here, on the host: no device sync).
    scaled = any(p.temperature != 1.0 and not p.greedy for p in params)
    top_k = torch.tensor([p.top_k for p in params], device=dev) if any(p.top_k > 0 for p in params) else None
    top_p = torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None
    drawn_from = sampling.processed_logprobs(logits, temperature if scaled else None, top_k, top_p)  # (B, V)
    reported = drawn_from if logprobs_mode == "processed_logprobs" else sampling.raw_logprobs(logits)
    tokens = sampling.sample(drawn_from, temperature < sampling.GREEDY_EPS, [row.generator for row in rows])
    chosen = reported.gather(1, tokens.unsqueeze(1))  # (B, 1)
    k_max = max((p.logprobs or 0 for p in params), default=0)
    top_values, top_ids = sampling.top_logprobs(reported, k_max)  # (B, k) each
    # One device-to-host copy per step: float64 holds token ids and float32 log-probs exactly.
    host = torch.cat([tokens.unsqueeze(1).double(), chosen.double(), top_ids.double(), top_values.double()], 1)
    host_rows = host.cpu().tolist()  # (B, 2 + 2k)
    for row, p, values in zip(rows, params, host_rows, strict=True):
        out, token, logprob = row.output, int(values[0]), values[1]
        out.token_ids.append(token)
        out.logprobs.append(logprob)
        if p.logprobs is not None:
            ids, lps = values[2 : 2 + p.logprobs], values[2 + k_max : 2 + k_max + p.logprobs]
            out.top_logprobs.append([(token, logprob), *((int(t), lp) for t, lp in zip(ids, lps, strict=True))])
        # vLLM's order (vllm/v1/core/sched/utils.py check_stop): eos, then stop_token_ids, then length.
        if token in eos_token_ids and not p.ignore_eos:
            out.finish_reason = "stop"
        elif token in p.stop_token_ids:
            out.finish_reason, out.stop_reason = "stop", token
        elif len(out.token_ids) >= p.max_tokens:
            out.finish_reason = "length"
    return tokens


def cache_sequences(prefix_cache: PrefixCache, batch: KVBatch, finished: list[int]) -> None:
    """Put the full blocks of finished sequences (prompt + answer but its last token, which was never fed)
    into the prefix cache: the next call of an agent rollout starts with exactly these tokens."""
    layers = cache_layers(batch.cache)
    width = batch.mask.shape[1]
    for i in finished:
        row = batch.rows[i]
        tokens = row.request.prompts[row.output.prompt_index] + row.output.token_ids[:-1]
        length = len(tokens)  # == batch.positions[i]: the row's real columns are the last `length`
        if length // prefix_cache.block_size <= len(row.request.prompts[row.output.prompt_index]) // (
            prefix_cache.block_size
        ):
            continue  # no full block beyond the prompt's, which are cached already
        prefix_cache.insert(
            tokens, [(k[i : i + 1, :, width - length :], v[i : i + 1, :, width - length :]) for k, v in layers]
        )
