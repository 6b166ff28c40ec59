"""Running a causal LM on packed micro-batch rows: the forward pass with the tree mask, and per-token logprobs.

``packed_forward`` runs a Hugging Face causal LM on one ``learner.pack.MicroBatch`` with its tree attention mask and
depth position ids (a row that is one chain passes no mask: the model's own causal path, SDPA's causal kernel).
``gather_token_logprobs`` takes each token's logprob from the logits of its predictor under the token's own sampling
settings (temperature, then top-k, then top-p, renormalised: the engine's transform, ``policy.sampling``), so the
learner's π_old is the same distribution as the rollout's π_rollout; a token outside the learner's top-k/top-p support
is floored at ``MIN_LOGPROB`` (zero gradient, TIS weight 0). ``packed_logprobs`` does both.

Attention: the 4D additive float mask (0 allowed, ``finfo(dtype).min`` not) is applied as given by transformers'
``eager`` and ``sdpa`` implementations only; others are refused (docs/method.md#tree-packing).
Pure torch, no Kafka; used by ``learner.step`` and ``learner.value``.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.pack import MicroBatch, PackError
from policy.sampling import MIN_REPORTED_LOGPROB, apply_temperature, apply_top_k, apply_top_p

__all__ = [
    "MIN_LOGPROB",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "gather_token_logprobs",
    "packed_forward",
    "packed_logprobs",
]

# The attention implementations whose transformers code path applies a custom dense 4D mask as given.
SUPPORTED_ATTN_IMPLEMENTATIONS: frozenset[str] = frozenset({"eager", "sdpa"})

# Floor of a token's logprob: a sampled token outside the learner's top-k/top-p support (-inf) gets this instead.
MIN_LOGPROB = MIN_REPORTED_LOGPROB


def _model_dtype_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device


def packed_forward(model: torch.nn.Module, batch: MicroBatch, **model_kwargs: Any) -> Any:
    """Run a HF causal LM on one micro-batch with the tree mask and depth position ids; returns the model output.

    ``model_kwargs`` go to the model (e.g. ``output_hidden_states=True`` for a value head). The batch is moved to the
    model's device; the mask is built in the model's dtype, which ``sdpa`` requires of a float mask.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise PackError(
            f"attention implementation {impl!r} does not apply a custom 4D mask; load the model with "
            f"attn_implementation in {sorted(SUPPORTED_ATTN_IMPLEMENTATIONS)}"
        )
    dtype, device = _model_dtype_device(model)
    anc = batch.segment_ancestors  # (S, S)
    if torch.equal(anc, torch.ones_like(anc).tril()):
        # One chain (an append-only rollout alone in its row): the tree mask IS the causal mask, so let the model use
        # its own causal path (SDPA's is_causal kernel) instead of materialising a (T, T) float mask.
        mask = None
    else:
        mask = batch.attention_mask(dtype=dtype, device=device)  # (1, 1, T, T)
    return model(
        input_ids=batch.input_ids.to(device)[None],  # (1, T)
        attention_mask=mask,
        position_ids=batch.position_ids.to(device)[None],  # (1, T)
        use_cache=False,
        **model_kwargs,
    )


def gather_token_logprobs(logits: torch.Tensor, batch: MicroBatch, *, only_trainable: bool = False) -> torch.Tensor:
    """Per-token logprobs from a micro-batch's logits under each token's own sampling distribution.

    ``log q_t(token[t])`` with ``q_t = softmax(top_p(top_k(logits[predictor[t]] / temperature[t])))``, the
    transform the engine sampled with (``policy.sampling``; greedy rows are divided by 1, as there);
    top-k and top-p run only when a token of the row asked for them. logits: (T, V) or (1, T, V). Returns (T,) in
    float32, 0.0 where a token has no predictor (or is not trainable when ``only_trainable``), floored at
    ``MIN_LOGPROB`` where the token is outside the support; only the needed rows are normalised, in fp32, to bound
    memory at large vocabularies.
    """
    if logits.dim() == 3:
        logits = logits[0]
    device = logits.device
    predictor = batch.predictor.to(device)  # (T,)
    wanted = predictor >= 0  # (T,)
    if only_trainable:
        wanted &= batch.loss_mask.to(device)
    rows = wanted.nonzero(as_tuple=True)[0]  # (K,)
    picked = apply_temperature(logits[predictor[rows]], batch.temperature.to(device)[rows])  # (K, V) fp32
    if batch.uses_top_k:
        picked = apply_top_k(picked, batch.top_k.to(device)[rows])
    if batch.uses_top_p:
        picked = apply_top_p(picked, batch.top_p.to(device)[rows])
    targets = batch.input_ids.to(device)[rows]  # (K,)
    token_lp = picked.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(picked, dim=-1)  # (K,)
    token_lp = token_lp.clamp(min=MIN_LOGPROB)  # -inf (cut by top-k/top-p) -> floor, with zero gradient
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)  # (T,)
    return out.index_put((rows,), token_lp)


def packed_logprobs(model: torch.nn.Module, batch: MicroBatch, *, only_trainable: bool = False) -> torch.Tensor:
    """Logprob of every token of ``batch`` under ``model`` (one forward pass; differentiable). Returns (T,) float32."""
    if batch.num_tokens == 0:
        return torch.zeros(0, dtype=torch.float32, device=_model_dtype_device(model)[1])
    out = packed_forward(model, batch)
    return gather_token_logprobs(out.logits, batch, only_trainable=only_trainable)
