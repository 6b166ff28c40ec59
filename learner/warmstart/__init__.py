"""Warm start: supervised fine-tuning of the policy on demonstrations produced by the real built-in agent loop,
and an offline evaluation that grades through the one set of grading rules (``producers.tasks.grading``).

Topics: none (offline). Run: ``clawstream model sft --model-dir DIR --out DIR`` or ``python -m learner.warmstart``.
"""
