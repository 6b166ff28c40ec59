"""The project's tiny Qwen3-architecture policy model: the ``qwen3`` row of the model builder at its default sizes.

No model hub is reachable from the development machines, so CPU runs use a model built from nothing
(``policy.architectures``): a synthetic corpus that looks like agent traffic (prose about files and tasks, JSON tool
calls, file names, digits, code, chat markup) trains a byte-level BPE tokenizer; a Qwen3-style chat template with
tool calls is attached; a randomly initialised ``Qwen3ForCausalLM`` is saved next to it in Hugging Face format. The
output directory loads through ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly like a real Qwen3 checkpoint, so
every other stage (CPU engine, proxy, learner) takes the same code path for the tiny model and a real one. No SFT
happens here; the warm start is a separate step.

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python -m policy.tiny_model --out models/tiny [--seed 0]

Everything is deterministic in ``seed``: two builds with the same seed write an identical ``tokenizer.json`` and
identical weights. Its ``clawstream_model.json`` names this function as the builder, with the version the
quickstart's cache compares (``policy.architectures.is_current``).

The chat template and its contract: ``policy.chat_template``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from policy.architectures import init_model
from policy.architectures import main as build_main


def init_tiny_model(out_dir: Path, **options: Any) -> Path:
    """Build the tiny Qwen3 model into ``out_dir`` and return it: ``policy.architectures.init_model`` for ``qwen3``.

    The options are ``init_model``'s (``seed``, the sizes, ``num_documents``, ``progress``); its defaults are the
    tiny model's: vocab 2048, hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads, 131072 positions.
    """
    return init_model(out_dir, "qwen3", **options)


def main(argv: list[str] | None = None) -> int:
    description = "Build the tiny Qwen3-architecture model for CPU runs."
    return build_main(argv, prog="python -m policy.tiny_model", description=description, arch="qwen3")


if __name__ == "__main__":
    sys.exit(main())
