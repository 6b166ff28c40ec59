"""Offline greedy evaluation of a policy on the CPU suite: mean reward and solve rate, per dialect and template.

Each task runs through the real agent loop against the in-process proxy (``warmstart.episodes``) with the
model decoding greedily, and the task's own grader scores the workspace. The held-out split never shares a prompt
with the SFT training tasks (``warmstart.demos``).

Topics: none (offline). Run::

    .venv/bin/python -m warmstart.sft --model-dir models/tiny-sft --eval-only [--eval-tasks 64]
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.proxy.render import TemplateRenderer
from producers.tasks.model import Task
from warmstart.demos import heldout_tasks, train_tasks
from warmstart.episodes import DIALECTS, Policy, run_episode
from warmstart.progress import progress_bar


def greedy_policy(model: Any, eos_id: int, max_new_tokens: int = 96) -> Policy:
    """The model as a policy: greedy decoding of up to ``max_new_tokens`` tokens, stopping at ``eos_id``."""
    import torch  # heavy: imported only when a model is evaluated
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        top_k=None,
        top_p=None,
        temperature=None,
    )

    def policy(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])  # (1, L)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return policy


def evaluate_policy(
    make_policy: Callable[[Task, str], Policy],
    tokenizer: Any,
    tasks: list[Task],
    dialects: tuple[str, ...] = DIALECTS,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Run every task in every dialect with the policy ``make_policy(task, dialect)``; mean reward + solve rate."""
    renderer = TemplateRenderer(tokenizer)
    bar = progress_bar(len(tasks) * len(dialects), "held-out eval", "episode", enabled=progress)
    results = []
    for t in tasks:
        for d in dialects:
            results.append(run_episode(t, d, make_policy(t, d), renderer))
            bar.update(1)
    bar.close()
    report: dict[str, Any] = {"episodes": len(results)}
    for name, subset in [("all", results), *((d, [r for r in results if r.dialect == d]) for d in dialects)]:
        rewards = [r.reward or 0.0 for r in subset]
        n = max(len(rewards), 1)
        report[name] = {
            "mean_reward": sum(rewards) / n,
            "solve_rate": sum(x >= 1.0 for x in rewards) / n,
            "n": len(subset),
        }
    templates = {t.task_id: t.metadata.get("template", "?") for t in tasks}
    by_template: dict[str, list[float]] = {}
    for r in results:
        by_template.setdefault(templates[r.task_id], []).append(r.reward or 0.0)
    report["by_template"] = {k: round(sum(v) / len(v), 3) for k, v in sorted(by_template.items())}
    return report


def evaluate_model(
    model: Any, tokenizer: Any, n: int = 64, seed: int = 0, split: str = "heldout", progress: bool = False
) -> dict[str, Any]:
    """Greedy evaluation of an in-memory model on ``n`` tasks of ``split`` in both dialects."""
    tasks = heldout_tasks(n, seed) if split == "heldout" else train_tasks(n, seed)
    policy = greedy_policy(model, TemplateRenderer(tokenizer).end_of_turn_id)
    return evaluate_policy(lambda _t, _d: policy, tokenizer, tasks, progress=progress)


def evaluate(
    model_dir: str | Path, split: str = "heldout", n: int = 64, seed: int = 0, progress: bool = False
) -> dict[str, Any]:
    """Greedy offline evaluation of a saved model on ``n`` tasks of ``split`` in both dialects."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return evaluate_model(model, tokenizer, n=n, seed=seed, split=split, progress=progress)


def format_report(report: dict[str, Any]) -> str:
    """One log line of an evaluation report: reward and solve rate overall and per dialect, reward per template."""
    parts = [
        f"{k} reward {v['mean_reward']:.3f} solved {v['solve_rate']:.3f}"
        for k, v in report.items()
        if isinstance(v, dict) and "mean_reward" in v
    ]
    return "; ".join(parts) + f"; by template {report['by_template']}"
