"""Build the project's tiny Qwen3-architecture policy model, with its own BPE tokenizer and chat template.

No model hub is reachable from the development machines, so CPU runs use a model this module creates from
nothing: a synthetic corpus that looks like agent traffic (prose about files and tasks, JSON tool calls, file
names, digits, code, chat markup) trains a byte-level BPE tokenizer; a Qwen3-style chat template with tool calls
is attached; a randomly initialised ``Qwen3ForCausalLM`` is saved next to it in Hugging Face format. The output
directory loads through ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly like a real Qwen3 checkpoint, so
every other stage (CPU engine, proxy, learner) takes the same code path for the tiny model and a real one.
No SFT happens here; the warm start is a separate step.

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python -m policy.tiny_model --out models/tiny [--seed 0]

Everything is deterministic in ``seed``: two builds with the same seed write an identical ``tokenizer.json`` and
identical weights.

The chat template and its contract: ``policy.chat_template``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from policy.chat_template import (
    ADDED_TOKENS,
    ASSISTANT_TURN_SUFFIX,
    CHAT_TEMPLATE,
    ENDOFTEXT,
    GENERATION_PROMPT,
    IM_END,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    assistant_turn_suffix_ids,
)
from policy.corpus import iter_corpus

# Everything here is built from local files; never let transformers try to reach the (unreachable) hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# Position range of the model (``max_position_embeddings``) and the tokenizer's ``model_max_length``: real harness
# prompts reach ~40k tokens with this tokenizer (docs/harnesses.md), so 128k leaves room for long rollouts. The
# inference engine's default ``max_model_len`` is the model's ``max_position_embeddings``.
MAX_POSITIONS = 131072
# Bumped whenever a build with the same seed would differ (2: 131072 positions, was 32768); caches of built models
# (the quickstart's) compare it with the ``builder_version`` in ``clawstream_model.json`` and rebuild when stale.
BUILDER_VERSION = 2


class ModelInitError(ClawstreamError):
    """The tiny model could not be built (bad settings, or the ML stack is missing or misbehaves)."""


# Qwen2/Qwen3's pre-tokenizer split: letters keep one leading non-letter (so `"name` and ` name` differ), digits
# are single tokens, newline runs group together. Copied so the tiny model tokenizes like the real family.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)

# --- synthetic corpus -----------------------------------------------------------------------------------------


def build_tokenizer(
    seed: int,
    vocab_size: int,
    num_documents: int,
    *,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    markup_tokens: tuple[str, ...] = MARKUP_TOKENS,
    eos_token: str = IM_END,
    pad_token: str = ENDOFTEXT,
    bos_token: str | None = None,
    chat_template: str = CHAT_TEMPLATE,
) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with the chat template.

    The added tokens (special, then markup) take the last ids, after the BPE vocabulary, as in Qwen3. The defaults
    are the tiny Qwen3 model's; ``policy.architectures`` passes other families' tokens and templates. With a
    ``bos_token``, encoding with special tokens prepends it, as Llama tokenizers do (the chat template writes it
    itself, so renderers encode with ``add_special_tokens=False``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe_size = vocab_size - len(special_tokens) - len(markup_tokens)
    if bpe_size < 256 + 16:
        raise ModelInitError(f"vocab_size={vocab_size} is too small: need room for 256 bytes, merges and added tokens")
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    # No normalizer: Qwen2 applies NFC, but that would break the exact byte round trip TITO depends on.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(iter_corpus(seed, num_documents), trainer=trainer)
    learned = tok.get_vocab_size()
    if learned < bpe_size:
        # The corpus ran out of pairs with count >= 2; the gap would leave the added tokens at unexpected ids.
        raise ModelInitError(f"BPE learned only {learned} of {bpe_size} tokens; raise num_documents")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in markup_tokens])
    if bos_token is not None:
        bos_id = tok.token_to_id(bos_token)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, bos_id)]
        )

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        unk_token=None,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        split_special_tokens=False,
    )


def _config_kwargs(
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_position_embeddings: int,
    rope_theta: float,
) -> dict[str, Any]:
    from transformers import Qwen3Config

    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_bias": False,
    }
    # transformers 5 moved rope settings into `rope_parameters`; 4.x takes `rope_theta`.
    if "rope_parameters" in inspect.signature(Qwen3Config.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        kwargs["rope_theta"] = rope_theta
    return kwargs


def init_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 256,
    intermediate_size: int = 768,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = MAX_POSITIONS,
    rope_theta: float = 1_000_000.0,
    num_documents: int = 6000,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Build tokenizer + randomly initialised Qwen3 model into ``out_dir`` and return it.

    ``num_documents`` sizes the synthetic tokenizer corpus (it must yield at least ``vocab_size`` - 9 BPE tokens).
    ``progress`` receives one line per stage (``None`` silences it).
    """
    say = progress or (lambda _line: None)
    t0 = time.perf_counter()
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ModelInitError(
            f"hidden_size={hidden_size} must divide by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )
    head_dim = head_dim or hidden_size // num_heads
    try:
        import torch
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    except ImportError as exc:  # the `ml` extra is optional for the rest of the project
        raise ModelInitError("the ML stack is missing: pip install 'clawstream[ml]'") from exc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    say(f"[model-init] training byte-level BPE tokenizer (vocab {vocab_size}, {num_documents} documents, seed {seed})")
    tokenizer = build_tokenizer(seed, vocab_size, num_documents)
    tokenizer.save_pretrained(out_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ADDED_TOKENS}
    elapsed = time.perf_counter() - t0
    say(f"[model-init] tokenizer: {len(tokenizer)} tokens, eos {IM_END}={ids[IM_END]} ({elapsed:.1f}s)")

    config = Qwen3Config(
        **_config_kwargs(
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings,
            rope_theta,
        ),
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )
    config.architectures = ["Qwen3ForCausalLM"]
    # Seeded init on CPU in float32 is bit-reproducible; fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.eval()
    # Sampling defaults for RL: the rollout log-probs must be those of the untruncated distribution, so top_k and
    # top_p are disabled explicitly (transformers would otherwise apply its own top_k=50 default).
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    save_kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out_dir, **save_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"[model-init] Qwen3ForCausalLM: {n_params / 1e6:.2f}M parameters, {num_layers} layers, hidden {hidden_size} "
        f"({time.perf_counter() - t0:.1f}s)"
    )

    # Deterministic (no timings) so two builds with one seed produce identical directories.
    info = {
        "builder": "policy.tiny_model.init_tiny_model",
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "num_documents": num_documents,
        "num_parameters": n_params,
        "added_token_ids": ids,
        "generation_prompt": GENERATION_PROMPT,
        "assistant_turn_suffix": ASSISTANT_TURN_SUFFIX,
        "assistant_turn_suffix_ids": assistant_turn_suffix_ids(tokenizer),
        "chat_template_sha256": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest(),
    }
    (out_dir / "clawstream_model.json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"[model-init] wrote {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir


def is_current(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds a tiny model built by this version of the builder (a cache can be reused)."""
    try:
        info = json.loads((Path(model_dir) / "clawstream_model.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("builder_version") == BUILDER_VERSION and (Path(model_dir) / "config.json").is_file()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m policy.tiny_model", description="Build the tiny Qwen3-architecture model for CPU runs."
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the corpus, tokenizer and weights")
    args = parser.parse_args(argv)
    try:
        init_tiny_model(args.out, seed=args.seed)
    except ModelInitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
