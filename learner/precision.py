"""Loading the policy for training: fp32 master weights whatever dtype the checkpoint was saved in.

transformers loads a checkpoint in its own dtype by default, so a user's bf16 Qwen or Llama directory would train in
pure bf16: bf16 weights, gradients and AdamW moments, where an update smaller than a weight's bf16 spacing (2^-8 of
its size) is lost. The learner keeps every weight in float32 instead; on CUDA the step computes in bf16 under autocast
(``learner.step``), the master weights and optimizer state stay fp32. Published versions are the fp32 weights (an
exact resume needs them); the engines cast them to their own dtype on load (``policy.weight_store.load_checked``,
vLLM's weight loaders).

Pure torch + transformers, no Kafka; used by ``learner.train`` and ``learner.value``.
"""

from __future__ import annotations

from pathlib import Path

import torch

# The learner's attention: the implementations that apply its tree mask as given (learner/forward.py).
ATTN_IMPLEMENTATION = "sdpa"
MASTER_DTYPE = torch.float32


def load_policy(model_dir: Path | str) -> torch.nn.Module:
    """A HF causal LM from ``model_dir`` with fp32 weights and SDPA attention, on the CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ATTN_IMPLEMENTATION, dtype=MASTER_DTYPE)
