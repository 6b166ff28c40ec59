"""A few-kilobyte random Qwen3 (no tokenizer) for engine and weight tests: builds in milliseconds.

``initializer_range`` is raised so the next-token distributions are peaked enough that greedy decoding has no
near-ties, which keeps batched-vs-unbatched comparisons exact.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

VOCAB = 96
EOS = 95


def tiny_lm(seed: int = 0) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        pad_token_id=0,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).eval()


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
