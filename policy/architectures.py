"""Random-weight model directories of three architectures, each with its family's own chat template.

``qwen3`` is the project's tiny model (``policy.tiny_model``, Qwen3 template with ``<think>``); ``qwen2.5`` is a
``Qwen2ForCausalLM`` with a ChatML template (tool calls in ``<tool_call>`` tags, a default system turn); ``llama``
is a ``LlamaForCausalLM`` (untied LM head) with a Llama-3 style template (``<|begin_of_text|>``, header tokens,
``<|eot_id|>`` ends a turn and is the eos). All three train the same byte-level BPE on the same synthetic corpus
(``policy.tiny_model.build_tokenizer``) with their family's control tokens added, and load through ``AutoTokenizer``
/ ``AutoModelForCausalLM`` like a real checkpoint: the test matrix that every service runs any causal LM
(tests/integration/test_architectures.py). The templates: ``policy.family_templates``. No model hub is needed.

Run::

    clawstream model init --out models/llama --arch llama      # or: python -m policy.architectures --arch llama ...

Deterministic in ``seed``, like the tiny model. Pointing the services at a model directory: docs/models.md.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy.family_templates import (
    CHATML_ENDOFTEXT,
    CHATML_MARKUP_TOKENS,
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    LLAMA3_BEGIN,
    LLAMA3_END,
    LLAMA3_EOT,
    LLAMA3_PAD,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_TEMPLATE,
)
from policy.tiny_model import MAX_POSITIONS, ModelInitError, build_tokenizer, init_tiny_model

ARCHITECTURES: tuple[str, ...] = ("qwen3", "qwen2.5", "llama")
BUILDER_VERSION = 1


@dataclass(frozen=True)
class Family:
    """What differs between the families: classes, control tokens, template, which tokens end a generation."""

    model_class: str
    config_class: str
    special_tokens: tuple[str, ...]
    markup_tokens: tuple[str, ...]
    chat_template: str
    eos_tokens: tuple[str, ...]  # the first is the tokenizer's eos (the end of an assistant turn)
    pad_token: str
    bos_token: str | None
    tie_word_embeddings: bool
    extra_config: tuple[tuple[str, Any], ...] = ()


FAMILIES: dict[str, Family] = {
    "qwen2.5": Family(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        CHATML_SPECIAL_TOKENS,
        CHATML_MARKUP_TOKENS,
        CHATML_TEMPLATE,
        ("<|im_end|>", CHATML_ENDOFTEXT),
        CHATML_ENDOFTEXT,
        None,
        True,  # as the small Qwen2.5 checkpoints
        (("use_sliding_window", False),),
    ),
    "llama": Family(
        "LlamaForCausalLM",
        "LlamaConfig",
        LLAMA3_SPECIAL_TOKENS,
        (),
        LLAMA3_TEMPLATE,
        (LLAMA3_EOT, LLAMA3_END),
        LLAMA3_PAD,
        LLAMA3_BEGIN,
        False,  # an untied LM head, as Llama-3-8B: the weight store and the swap see a separate lm_head.weight
        (("attention_bias", False), ("mlp_bias", False)),
    ),
}


def _config(family: Family, ids: dict[str, int], sizes: dict[str, Any], rope_theta: float) -> Any:
    import transformers

    config_class = getattr(transformers, family.config_class)
    accepted = inspect.signature(config_class.__init__).parameters
    kwargs: dict[str, Any] = {**sizes, "rms_norm_eps": 1e-5, "tie_word_embeddings": family.tie_word_embeddings}
    kwargs.update(family.extra_config)
    # transformers 5 moved rope settings into `rope_parameters`; 4.x takes `rope_theta`.
    if "rope_parameters" in accepted:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        kwargs["rope_theta"] = rope_theta
    if "head_dim" not in accepted:
        kwargs.pop("head_dim")
    eos = [ids[t] for t in family.eos_tokens]
    bos = ids[family.bos_token] if family.bos_token else ids[family.pad_token]
    config = config_class(**kwargs, bos_token_id=bos, eos_token_id=eos, pad_token_id=ids[family.pad_token])
    config.architectures = [family.model_class]
    return config


def init_model(
    out_dir: Path,
    arch: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 256,
    intermediate_size: int = 768,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = MAX_POSITIONS,
    rope_theta: float = 1_000_000.0,
    num_documents: int = 6000,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Build a random-weight ``arch`` model directory (tokenizer, template, config, weights) into ``out_dir``.

    ``qwen3`` is exactly ``policy.tiny_model.init_tiny_model`` with the same sizes."""
    sizes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // max(num_heads, 1),
        "max_position_embeddings": max_position_embeddings,
    }
    if arch == "qwen3":
        return init_tiny_model(
            out_dir,
            seed=seed,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            max_position_embeddings=max_position_embeddings,
            rope_theta=rope_theta,
            num_documents=num_documents,
            progress=progress,
        )
    if arch not in FAMILIES:
        raise ModelInitError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ModelInitError(f"hidden_size={hidden_size} must divide by num_heads={num_heads}, and that by kv heads")
    family = FAMILIES[arch]
    say = progress or (lambda _line: None)
    try:
        import torch
        import transformers
        from transformers import GenerationConfig
    except ImportError as exc:  # the `ml` extra is optional for the rest of the project
        raise ModelInitError("the ML stack is missing: pip install 'clawstream[ml]'") from exc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    say(f"[model-init] {arch}: training byte-level BPE tokenizer (vocab {vocab_size}, seed {seed})")
    tokenizer = build_tokenizer(
        seed,
        vocab_size,
        num_documents,
        special_tokens=family.special_tokens,
        markup_tokens=family.markup_tokens,
        eos_token=family.eos_tokens[0],
        pad_token=family.pad_token,
        bos_token=family.bos_token,
        chat_template=family.chat_template,
    )
    tokenizer.save_pretrained(out_dir)
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in family.special_tokens + family.markup_tokens}
    config = _config(family, ids, sizes, rope_theta)
    # Seeded init on CPU in float32 is bit-reproducible; fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config).to(torch.float32)
    model.eval()
    # As the tiny model: untruncated sampling by default (RL needs the logprobs of the plain distribution).
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_id),
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    model.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "builder": "policy.architectures.init_model",
        "builder_version": BUILDER_VERSION,
        "architecture": arch,
        "seed": seed,
        "num_documents": num_documents,
        "num_parameters": n_params,
        "added_token_ids": ids,
        "chat_template_sha256": hashlib.sha256(family.chat_template.encode()).hexdigest(),
    }
    (out_dir / "clawstream_model.json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"[model-init] {family.model_class}: {n_params / 1e6:.2f}M parameters; wrote {out_dir}")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m policy.architectures",
        description="Build a random-weight qwen3, qwen2.5 or llama model directory with its family's chat template.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3", help="model family")
    parser.add_argument("--seed", type=int, default=0, help="seed for the corpus, tokenizer and weights")
    args = parser.parse_args(argv)
    try:
        init_model(args.out, args.arch, seed=args.seed)
    except ModelInitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
