"""Warm start: supervised fine-tuning of the policy on demonstrations produced by the real built-in agent loop,
and an offline evaluation that grades through the one set of grading rules (``producers.tasks.grading_rules``).

Topics: none (offline). Run: ``clawstream model sft --model-dir DIR --out DIR`` or ``python -m warmstart``.
Modules: ``episodes`` (the agent loop against an in-process proxy, graded), ``demos`` (scripted correct episodes,
task splits), ``sft`` (training bounded by steps and seeded, CLI), ``evaluate`` (greedy offline evaluation),
``progress`` (the progress bars with ETA that the warm start, ``clawstream eval`` and the demo show).
"""

import os

# Before any submodule pulls in transformers / huggingface_hub (they read it at import): the models are local
# directories (policy.tiny_model output), so never reach for the Hub, not even to check for updates.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
