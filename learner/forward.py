"""Running a causal LM on packed micro-batch rows: the forward pass with the tree mask, and per-token logprobs.

``packed_forward`` runs a Hugging Face causal LM on one ``learner.pack.MicroBatch`` with its tree attention mask and
depth position ids (a row that is one chain passes no mask: the model's own causal path, SDPA's causal kernel);
``packed_hidden`` runs only the model's body (its decoder) the same way: the last hidden state, no logits.
A token's logprob comes from its predictor's logits under the token's own sampling settings (temperature, then
top-k, then top-p, renormalised: the engine's transform, ``policy.sampling``), so the learner's π_old is the same
distribution as the rollout's π_rollout; a token outside the learner's top-k/top-p support is floored at
``MIN_LOGPROB`` (zero gradient, TIS weight 0).

Memory (docs/method.md#chunked-logprobs): ``packed_logprobs`` never materialises the row's (T, V) logits. It projects
only the wanted positions through the LM head, ``chunk`` at a time, each chunk under activation checkpointing, so the
backward pass recomputes a chunk's (chunk, V) logits instead of keeping them: extra memory ≈ c × chunk × V × 4 bytes
(c ≈ 5 with temperature only, ≈ 9 with top-k/top-p: their sort), whatever the row's length; T × H hidden states
remain. ``gather_token_logprobs`` is the same maths on full logits (``packed_forward(...).logits``): the reference.

Attention: the 4D additive float mask (0 allowed, ``finfo(dtype).min`` not) is applied as given by transformers'
``eager`` and ``sdpa`` implementations only; others are refused (docs/method.md#tree-packing).
Pure torch, no Kafka; used by ``learner.step`` and ``learner.value``.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch.utils.checkpoint import checkpoint

from learner.pack import MicroBatch, PackError
from policy.sampling import MIN_REPORTED_LOGPROB, apply_temperature, apply_top_k, apply_top_p

__all__ = [
    "DEFAULT_LOGPROB_CHUNK",
    "MIN_LOGPROB",
    "SUPPORTED_ATTN_IMPLEMENTATIONS",
    "gather_token_logprobs",
    "head_logprobs",
    "packed_forward",
    "packed_hidden",
    "packed_logprobs",
]

# The attention implementations whose transformers code path applies a custom dense 4D mask as given.
SUPPORTED_ATTN_IMPLEMENTATIONS: frozenset[str] = frozenset({"eager", "sdpa"})

# Floor of a token's logprob: a sampled token outside the learner's top-k/top-p support (-inf) gets this instead.
MIN_LOGPROB = MIN_REPORTED_LOGPROB

# Positions projected through the LM head at once. At a 151,936-token vocabulary one (256, V) fp32 tensor is 156 MB;
# a chunk's forward + backward holds about 5 of them (9 with top-k/top-p) (bench/results/logprob_memory.md).
DEFAULT_LOGPROB_CHUNK = 256

# Config fields of architectures whose logits are not just ``lm_head(last hidden state)``: the chunked path refuses
# them rather than compute another distribution (Gemma 2/3 soft-capping, Cohere's and Granite's logit scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class _CausalLM(Protocol):
    """What this module calls on a transformers ``PreTrainedModel`` (``nn.Module.__getattr__`` types it as Tensor)."""

    def get_decoder(self) -> torch.nn.Module: ...

    def get_output_embeddings(self) -> torch.nn.Module: ...


def _model_dtype_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(model.parameters())
    return param.dtype, param.device


def _packed_inputs(model: torch.nn.Module, batch: MicroBatch, past: Any = None) -> dict[str, Any]:
    """The model's keyword arguments for one row: ids, the tree mask (or None for one chain), depth positions;
    ``past``: a cache of the keys and values before the row (a chain row's shared prefix: ``learner.kv_share``)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise PackError(
            f"attention implementation {impl!r} does not apply a custom 4D mask; load the model with "
            f"attn_implementation in {sorted(SUPPORTED_ATTN_IMPLEMENTATIONS)}"
        )
    dtype, device = _model_dtype_device(model)
    if batch.is_chain:
        # One chain (an append-only rollout alone in its row): the tree mask IS the causal mask, so let the model use
        # its own causal path (SDPA's is_causal kernel) instead of materialising a (T, T) float mask.
        mask = None
    else:
        mask = batch.attention_mask(dtype=dtype, device=device)  # (1, 1, T, T)
    return {
        "input_ids": batch.input_ids.to(device)[None],  # (1, T)
        "attention_mask": mask,
        "position_ids": batch.position_ids.to(device)[None],  # (1, T)
        "use_cache": past is not None,
        **({"past_key_values": past} if past is not None else {}),
    }


def packed_forward(model: torch.nn.Module, batch: MicroBatch, **model_kwargs: Any) -> Any:
    """Run a HF causal LM on one micro-batch with the tree mask and depth position ids; returns the model output.

    ``model_kwargs`` go to the model (e.g. ``output_hidden_states=True``). The batch is moved to the model's device;
    the mask is built in the model's dtype, which ``sdpa`` requires of a float mask. Materialises (1, T, V) logits:
    training uses :func:`packed_logprobs`.
    """
    return model(**_packed_inputs(model, batch), **model_kwargs)


def packed_hidden(model: torch.nn.Module, batch: MicroBatch, past: Any = None) -> torch.Tensor:
    """The last hidden state of a HF causal LM's body (after its final norm) on one micro-batch: (T, H), no logits."""
    body = cast(_CausalLM, model).get_decoder()
    return body(**_packed_inputs(model, batch, past)).last_hidden_state[0]


def _wanted(batch: MicroBatch, device: torch.device, only_trainable: bool) -> torch.Tensor:
    """Positions whose logprob is asked for: a predictor, and trainable when ``only_trainable``. (K,) indices."""
    wanted = batch.predictor.to(device) >= 0  # (T,)
    if only_trainable:
        wanted &= batch.loss_mask.to(device)
    return wanted.nonzero(as_tuple=True)[0]


def _sampled_logprobs(
    scaled: torch.Tensor,  # (K, V) fp32 logits already divided by each row's temperature
    targets: torch.Tensor,  # (K,)
    top_k: torch.Tensor | None,  # (K,); None: no token of the row asked for top-k
    top_p: torch.Tensor | None,  # (K,)
) -> torch.Tensor:
    if top_k is not None:
        scaled = apply_top_k(scaled, top_k)
    if top_p is not None:
        scaled = apply_top_p(scaled, top_p)
    token_lp = scaled.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)  # (K,)
    return token_lp.clamp(min=MIN_LOGPROB)  # -inf (cut by top-k/top-p) -> floor, with zero gradient


def gather_token_logprobs(logits: torch.Tensor, batch: MicroBatch, *, only_trainable: bool = False) -> torch.Tensor:
    """Per-token logprobs from a micro-batch's full logits under each token's own sampling distribution.

    ``log q_t(token[t])`` with ``q_t = softmax(top_p(top_k(logits[predictor[t]] / temperature[t])))``, the
    transform the engine sampled with (``policy.sampling``; greedy rows are divided by 1, as there);
    top-k and top-p run only when a token of the row asked for them. logits: (T, V) or (1, T, V). Returns (T,) in
    float32, 0.0 where a token has no predictor (or is not trainable when ``only_trainable``), floored at
    ``MIN_LOGPROB`` where the token is outside the support. The unchunked reference of :func:`head_logprobs`.
    """
    if logits.dim() == 3:
        logits = logits[0]
    device = logits.device
    rows = _wanted(batch, device, only_trainable)  # (K,)
    scaled = apply_temperature(logits[batch.predictor.to(device)[rows]], batch.temperature.to(device)[rows])  # (K, V)
    top_k = batch.top_k.to(device)[rows] if batch.uses_top_k else None
    top_p = batch.top_p.to(device)[rows] if batch.uses_top_p else None
    token_lp = _sampled_logprobs(scaled, batch.input_ids.to(device)[rows], top_k, top_p)  # (K,)
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)  # (T,)
    return out.index_put((rows,), token_lp)


class _EntropyOnce:
    """Adds a chunk's entropy (nats, at the sampling temperature, before top-k/top-p) at its trainable positions to
    ``into`` = [sum, count], on the chunk's first run only: checkpointing runs the chunk again in backward."""

    def __init__(self, into: list, trainable: torch.Tensor) -> None:  # trainable: (C,) bool
        self.into, self.trainable, self.done = into, trainable, False

    def add(self, scaled: torch.Tensor) -> None:  # scaled: (C, V) fp32
        if self.done:
            return
        self.done = True
        with torch.no_grad():
            logq = torch.log_softmax(scaled.detach()[self.trainable], dim=-1)  # (C', V)
            self.into[0] += float(-(logq.exp() * logq).sum())
            self.into[1] += int(logq.shape[0])


def _chunk_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,  # (C, H) the predictors' hidden states
    targets: torch.Tensor,  # (C,)
    temperature: torch.Tensor,  # (C,)
    top_k: torch.Tensor | None,  # (C,)
    top_p: torch.Tensor | None,  # (C,)
    entropy: _EntropyOnce | None,
) -> torch.Tensor:
    scaled = apply_temperature(head(hidden), temperature)  # (C, V) fp32
    if entropy is not None:
        entropy.add(scaled)
    return _sampled_logprobs(scaled, targets, top_k, top_p)  # (C,)


def head_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    batch: MicroBatch,
    *,
    only_trainable: bool = False,
    chunk: int = DEFAULT_LOGPROB_CHUNK,
    entropy: list | None = None,
) -> torch.Tensor:
    """Per-token logprobs (T,) float32 from the body's last hidden state ``hidden`` (T, H), ``chunk`` wanted positions
    at a time through ``model``'s LM head (module docstring: memory); equal to :func:`gather_token_logprobs` of the
    full logits. ``entropy`` = [sum, count]: adds the entropy at the trainable positions among the wanted ones."""
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1.0):
            raise PackError(f"{type(model).__name__} transforms its logits ({name}); chunked logprobs do not")
    head = cast(_CausalLM, model).get_output_embeddings()
    device = hidden.device
    rows = _wanted(batch, device, only_trainable)  # (K,)
    predictor = batch.predictor.to(device)[rows]  # (K,)
    targets = batch.input_ids.to(device)[rows]  # (K,)
    temperature = batch.temperature.to(device)[rows]  # (K,)
    top_k = batch.top_k.to(device)[rows] if batch.uses_top_k else None
    top_p = batch.top_p.to(device)[rows] if batch.uses_top_p else None
    trainable = batch.loss_mask.to(device)[rows]  # (K,)
    # Checkpoint only when a backward pass will follow: then each chunk keeps its (C, H) input, not its (C, V) logits.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    pieces = []
    for start in range(0, int(rows.numel()), max(1, chunk)):
        part = slice(start, start + max(1, chunk))
        sink = _EntropyOnce(entropy, trainable[part]) if entropy is not None else None
        args = (
            hidden[predictor[part]],  # (C, H)
            targets[part],
            temperature[part],
            None if top_k is None else top_k[part],
            None if top_p is None else top_p[part],
            sink,
        )
        if recompute:  # nothing random in the head: no RNG state to keep for the recomputation
            pieces.append(checkpoint(_chunk_logprobs, head, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            pieces.append(_chunk_logprobs(head, *args))
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)  # (T,)
    if not pieces:
        return out
    return out.index_put((rows,), torch.cat(pieces))


def packed_logprobs(
    model: torch.nn.Module,
    batch: MicroBatch,
    *,
    only_trainable: bool = False,
    chunk: int = DEFAULT_LOGPROB_CHUNK,
    entropy: list | None = None,
    past: Any = None,
) -> torch.Tensor:
    """Logprob of every token of ``batch`` under ``model`` (one forward pass, chunked LM head; differentiable).
    Returns (T,) float32; ``entropy`` as in :func:`head_logprobs`; ``past`` as in :func:`packed_hidden`."""
    if batch.num_tokens == 0:
        return torch.zeros(0, dtype=torch.float32, device=_model_dtype_device(model)[1])
    hidden = packed_hidden(model, batch, past)  # (T, H)
    return head_logprobs(model, hidden, batch, only_trainable=only_trainable, chunk=chunk, entropy=entropy)
