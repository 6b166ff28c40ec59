"""Build a random-weight model directory of any architecture: the project's one model builder.

No model hub is reachable from the development machines, so CPU runs use models built here from nothing. Every
architecture takes the same steps: a byte-level BPE tokenizer trained on the synthetic agent corpus
(``policy.corpus``) with the family's control tokens and chat template, a seeded random init in float32,
untruncated sampling defaults, safetensors weights and a ``clawstream_model.json`` record. What differs between
the architectures is one row of ``FAMILIES``:

* ``qwen3``: the project's tiny model (``policy.tiny_model``), a ``Qwen3ForCausalLM`` with the Qwen3-style template
  with ``<think>`` (``policy.chat_template``);
* ``qwen2.5``: a ``Qwen2ForCausalLM`` with a ChatML template (tool calls in ``<tool_call>`` tags, default system);
* ``llama``: a ``LlamaForCausalLM`` (untied LM head) with a Llama-3 style template (``<|begin_of_text|>``, header
  tokens, ``<|eot_id|>`` ends a turn and is the eos).

Each directory loads through ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly like a real checkpoint, so every
stage takes the same code path for it and a real one: the test matrix that every service runs any causal LM
(tests/integration/test_architectures.py). The other families' templates: ``policy.family_templates``.

Run::

    clawstream model init --out models/llama --arch llama      # or: python -m policy.architectures --arch llama ...

Everything is deterministic in ``seed``: two builds with the same seed write identical files. Pointing the
services at a model directory: docs/models.md.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from policy.chat_template import (
    ASSISTANT_TURN_SUFFIX,
    CHAT_TEMPLATE,
    ENDOFTEXT,
    GENERATION_PROMPT,
    IM_END,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
)
from policy.corpus import iter_corpus
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

# Everything here is built from local files; never let transformers try to reach the (unreachable) hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Position range of the model (``max_position_embeddings``) and the tokenizer's ``model_max_length``: real harness
# prompts reach ~40k tokens with this tokenizer (docs/harnesses.md), so 128k leaves room for long rollouts. The
# inference engine's default ``max_model_len`` is the model's ``max_position_embeddings``.
MAX_POSITIONS = 131072

# Qwen2/Qwen3's pre-tokenizer split: letters keep one leading non-letter (so `"name` and ` name` differ), digits
# are single tokens, newline runs group together. Copied so the built models tokenize like the real family.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


class ModelInitError(ClawstreamError):
    """A model directory could not be built (bad settings, or the ML stack is missing or misbehaves)."""


@dataclass(frozen=True)
class Family:
    """What differs between the architectures: classes, control tokens, template, which tokens end a generation,
    and what a built directory records about its builder."""

    model_class: str
    config_class: str
    special_tokens: tuple[str, ...]  # added after the BPE vocabulary, then the markup tokens: the last ids
    markup_tokens: tuple[str, ...]  # added tokens that survive decoding with skip_special_tokens
    chat_template: str
    eos_tokens: tuple[str, ...]  # the first is the tokenizer's eos (the end of an assistant turn); one is an int
    pad_token: str
    bos_token: str | None  # None: nothing is prepended and the pad token's id is the config's bos
    tie_word_embeddings: bool
    rms_norm_eps: float
    extra_config: tuple[tuple[str, Any], ...]
    # ``builder`` and ``builder_version`` go into clawstream_model.json. The version is bumped whenever a build with
    # the same seed would differ; caches of built models (the quickstart's) compare it and rebuild when stale.
    builder: str
    builder_version: int
    records_architecture: bool = True  # the tiny model's record names no architecture: its builder implies it
    turn_markers: tuple[str, str] | None = None  # recorded (generation prompt, assistant turn suffix), if fixed


FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        SPECIAL_TOKENS,
        MARKUP_TOKENS,
        CHAT_TEMPLATE,
        (IM_END,),
        ENDOFTEXT,
        None,
        True,
        1e-6,
        (("use_sliding_window", False), ("attention_bias", False)),
        "policy.tiny_model.init_tiny_model",
        2,  # 2: 131072 positions
        records_architecture=False,
        turn_markers=(GENERATION_PROMPT, ASSISTANT_TURN_SUFFIX),
    ),
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
        1e-5,
        (("use_sliding_window", False),),
        "policy.architectures.init_model",
        1,
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
        1e-5,
        (("attention_bias", False), ("mlp_bias", False)),
        "policy.architectures.init_model",
        1,
    ),
}
ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


def build_tokenizer(seed: int, vocab_size: int, num_documents: int, family: Family) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with ``family``'s template.

    The added tokens (special, then markup) take the last ids, after the BPE vocabulary, as in Qwen3. With a
    ``bos_token``, encoding with special tokens prepends it, as Llama tokenizers do (the chat template writes it
    itself, so renderers encode with ``add_special_tokens=False``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe_size = vocab_size - len(family.special_tokens) - len(family.markup_tokens)
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
    tok.decoder = decoders.ByteLevel()  # decoding maps byte symbols back: it takes no options
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
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.markup_tokens])
    bos = family.bos_token
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=family.eos_tokens[0],
        pad_token=family.pad_token,
        bos_token=bos,
        unk_token=None,
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        split_special_tokens=False,
    )


def _family(arch: str, hidden_size: int, num_heads: int, num_kv_heads: int) -> Family:
    """``arch``'s row, once the shapes fit it and the ML stack is installed."""
    if arch not in FAMILIES:
        raise ModelInitError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ModelInitError(
            f"hidden_size={hidden_size} must divide by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )
    try:  # the `ml` extra is optional for the rest of the project
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ModelInitError("the ML stack is missing: pip install 'clawstream[ml]'") from exc
    return FAMILIES[arch]


def _config(family: Family, ids: dict[str, int], sizes: dict[str, Any], rope_theta: float) -> Any:
    import transformers

    config_class = getattr(transformers, family.config_class)
    accepted = inspect.signature(config_class.__init__).parameters
    kwargs: dict[str, Any] = {
        **sizes,
        "rms_norm_eps": family.rms_norm_eps,
        "tie_word_embeddings": family.tie_word_embeddings,
        **dict(family.extra_config),
    }
    # transformers 5 moved rope settings into `rope_parameters`; 4.x takes `rope_theta`.
    if "rope_parameters" in accepted:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        kwargs["rope_theta"] = rope_theta
    if "head_dim" not in accepted:
        kwargs.pop("head_dim")
    eos = [ids[t] for t in family.eos_tokens]
    config = config_class(
        **kwargs,
        bos_token_id=ids[family.bos_token or family.pad_token],
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=ids[family.pad_token],
    )
    config.architectures = [family.model_class]
    return config


def _random_model(family: Family, config: Any, seed: int) -> Any:
    """The seeded random init, with untruncated sampling defaults: RL needs the logprobs of the plain distribution,
    so top_k and top_p are off explicitly (transformers would otherwise apply its own top_k=50 default)."""
    import torch
    import transformers

    # Seeded init on CPU in float32 is bit-reproducible; fork_rng keeps the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config).to(torch.float32)
    model.eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    return model


def _record(arch: str, family: Family, tokenizer: Any, ids: dict[str, int], **build: Any) -> dict[str, Any]:
    """``clawstream_model.json``: deterministic (no timings), so two builds with one seed write identical files."""
    info: dict[str, Any] = {"builder": family.builder, "builder_version": family.builder_version}
    if family.records_architecture:
        info["architecture"] = arch
    info.update(build)
    info["added_token_ids"] = ids
    if family.turn_markers is not None:
        prompt, suffix = family.turn_markers
        info["generation_prompt"] = prompt
        info["assistant_turn_suffix"] = suffix
        info["assistant_turn_suffix_ids"] = tokenizer.encode(suffix, add_special_tokens=False)
    info["chat_template_sha256"] = hashlib.sha256(family.chat_template.encode()).hexdigest()
    return info


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
    head_dim: int | None = None,
    max_position_embeddings: int = MAX_POSITIONS,
    rope_theta: float = 1_000_000.0,
    num_documents: int = 6000,
    progress: Callable[[str], None] | None = print,
) -> Path:
    """Build a random-weight ``arch`` model directory (tokenizer, template, config, weights) into ``out_dir``.

    The defaults are the tiny model's sizes. ``num_documents`` sizes the synthetic tokenizer corpus (it must yield
    the BPE part of ``vocab_size``). ``progress`` receives one line per stage (``None`` silences it).
    """
    family = _family(arch, hidden_size, num_heads, num_kv_heads)
    say, t0 = progress or (lambda _line: None), time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    say(f"[model-init] {arch}: training byte-level BPE (vocab {vocab_size}, {num_documents} documents, seed {seed})")
    tokenizer = build_tokenizer(seed, vocab_size, num_documents, family)
    tokenizer.save_pretrained(out_dir)
    ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in family.special_tokens + family.markup_tokens}
    say(f"[model-init] tokenizer: {len(tokenizer)} tokens, eos {tokenizer.eos_token}={tokenizer.eos_token_id}")

    sizes: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
    }
    model = _random_model(family, _config(family, ids, sizes, rope_theta), seed)
    save_kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        save_kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(out_dir, **save_kwargs)
    n_params = sum(p.numel() for p in model.parameters())
    shape = f"{num_layers} layers, hidden {hidden_size}"
    say(f"[model-init] {family.model_class}: {n_params / 1e6:.2f}M parameters, {shape}")

    info = _record(arch, family, tokenizer, ids, seed=seed, num_documents=num_documents, num_parameters=n_params)
    (out_dir / "clawstream_model.json").write_text(json.dumps(info, indent=2) + "\n")
    say(f"[model-init] wrote {out_dir} in {time.perf_counter() - t0:.1f}s")
    return out_dir


def is_current(model_dir: Path, arch: str = "qwen3") -> bool:
    """Whether ``model_dir`` holds an ``arch`` model built by this version of the builder (a cache can be reused)."""
    family = FAMILIES[arch]
    try:
        info = json.loads((Path(model_dir) / "clawstream_model.json").read_text())
    except (OSError, ValueError):
        return False
    recorded = (info.get("builder"), info.get("builder_version"))
    return recorded == (family.builder, family.builder_version) and (Path(model_dir) / "config.json").is_file()


def main(
    argv: list[str] | None = None,
    *,
    prog: str = "python -m policy.architectures",
    description: str = "Build a random-weight qwen3, qwen2.5 or llama model directory with its family's chat template.",
    arch: str | None = None,
) -> int:
    """The command line: ``--out DIR [--arch A] [--seed N]``; with ``arch`` given (the tiny model's), no ``--arch``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
    if arch is None:
        parser.add_argument("--arch", choices=ARCHITECTURES, default="qwen3", help="model family")
    parser.add_argument("--seed", type=int, default=0, help="seed for the corpus, tokenizer and weights")
    args = parser.parse_args(argv)
    try:
        init_model(args.out, arch or args.arch, seed=args.seed)
    except ModelInitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
