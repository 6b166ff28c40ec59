"""The tiny test model: a few-kilobyte random Qwen3 (no tokenizer) that builds in milliseconds, plus two references.

One definition for every in-memory model the tests use (engine, weights, packing). The defaults raise
``initializer_range`` so the next-token distributions are peaked enough that greedy decoding has no near-ties, which
keeps batched-vs-unbatched comparisons exact. Callers that need a different model (the packing checks: their own
vocabulary, an untied head, a larger init) override ``Qwen3Config`` fields by keyword.

Checkpoints on disk (with a tokenizer) come from the project's own builder, ``policy.tiny_model.init_tiny_model``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96
EOS = 95

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "eos_token_id": EOS,
    "pad_token_id": 0,
    "initializer_range": 0.2,
}


def tiny_model(seed: int = 0, attn_implementation: str | None = None, **config: Any) -> Qwen3ForCausalLM:
    """A float32 tiny Qwen3 in eval mode, its weights a function of ``seed`` and the config alone.

    ``attn_implementation`` (e.g. "eager", "sdpa") is set and checked to have taken effect; ``None`` keeps the
    transformers default. ``config`` overrides fields of ``DEFAULT_CONFIG``. The caller's global RNG is untouched.
    """
    kwargs = {**DEFAULT_CONFIG, **config}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs)).to(torch.float32).eval()
    if attn_implementation is not None:
        assert model.config._attn_implementation == attn_implementation
    return model


def greedy_reference(model: Qwen3ForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate(do_sample=False)`` continuation of exactly ``max_new_tokens`` tokens, eos not stopping it.

    (``min_new_tokens`` would not do: it masks eos out of the distribution instead of just not stopping.)
    """
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0)
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long), generation_config=config
    )
    return out[0, len(prompt) :].tolist()


def full_logprobs(model: Qwen3ForCausalLM, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the logits predicting each generated token, from one unbatched forward: (N_gen, V)."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (L, V)
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)], dim=-1)
