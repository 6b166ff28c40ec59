"""Measure a model's per-family solve rates on the CPU suite's TRAINING tasks and print a curriculum spec.

Each task of ``builtin:cpu``'s train split (the first ``--per-family`` of each template) runs through the real
agent loop in both dialects (``warmstart.evaluate``, offline: in-process proxy, the task's own grader): once
greedily and ``--samples`` times sampled at temperature 1 (seeded per task, dialect and sample, so a rerun draws
the same). Per family: greedy solve rate, sampled solve rate, the probability that a GRPO group of ``--group-size``
is informative; the spec weighs each family by (1 − greedy) × that probability
(``producers.scheduler.curriculum.weights_from_rates``), the form ``clawstream demo --curriculum`` and
``CLAWSTREAM_SCHEDULER_CURRICULUM`` read.

Topics: none (offline). Run::

    clawstream model curriculum --model models/warmstart [--per-family 4 --samples 4]
    .venv/bin/python -m warmstart.curriculum --model models/warmstart
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.proxy.render import TemplateRenderer
from producers.scheduler.curriculum import family, format_spec, informative, weights_from_rates
from producers.tasks.cpu import cpu_suite
from producers.tasks.model import Task
from warmstart.episodes import DIALECTS, Policy, run_episode
from warmstart.evaluate import greedy_policy


def sampled_policy(model: Any, eos_id: int, seed: int, temperature: float = 1.0, max_new_tokens: int = 96) -> Policy:
    """The model sampling at ``temperature`` (no top-k/top-p), its noise seeded by ``seed`` (each call reseeds with
    the seed and the call's number)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True,
        temperature=temperature,
        top_k=0,  # explicit (docs/method.md#library-gotchas): the policy's own distribution at ``temperature``
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    calls = [0]

    def policy(prompt: list[int]) -> list[int]:
        torch.manual_seed(seed * 1000 + calls[0])
        calls[0] += 1
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return policy


def _seed(task: Task, dialect: str, sample: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{task.task_id}|{dialect}|{sample}".encode()).digest()[:3], "big")


def training_tasks(per_family: int) -> list[Task]:
    """The first ``per_family`` tasks of each family of builtin:cpu's train split (what the scheduler trains on)."""
    out: list[Task] = []
    count: dict[str, int] = {}
    for t in cpu_suite().split("train"):
        if count.get(family(t), 0) < per_family:
            count[family(t)] = count.get(family(t), 0) + 1
            out.append(t)
    return out


def measure(
    model_dir: Path,
    per_family: int,
    samples: int,
    temperature: float = 1.0,
    threads: int = 1,
    each: Callable[[dict[str, dict[str, float]]], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Family → {greedy, sampled, n}: solve rates (reward ≥ 1) over the tasks × dialects (× samples); ``each`` gets
    the rates so far after every task (the tasks go round the families, so a cut-short run is still balanced)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)  # a tiny model: more threads on a shared CPU only contend
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    renderer = TemplateRenderer(tokenizer)
    eos = renderer.end_of_turn_id
    greedy = greedy_policy(model, eos)
    solved: dict[str, dict[str, list[float]]] = {}
    for i, task in enumerate(tasks := training_tasks(per_family)):
        print(f"[{i + 1}/{len(tasks)}] {task.task_id}", file=sys.stderr, flush=True)
        cell = solved.setdefault(family(task), {"greedy": [], "sampled": []})
        for d in DIALECTS:
            cell["greedy"].append(float((run_episode(task, d, greedy, renderer).reward or 0.0) >= 1.0))
            for k in range(samples):
                policy = sampled_policy(model, eos, _seed(task, d, k), temperature)
                cell["sampled"].append(float((run_episode(task, d, policy, renderer).reward or 0.0) >= 1.0))
        if each is not None:
            each(_rates(solved))
    return _rates(solved)


def _rates(solved: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    return {
        fam: {
            "greedy": sum(c["greedy"]) / len(c["greedy"]),
            "sampled": sum(c["sampled"]) / max(len(c["sampled"]), 1),
            "n": float(len(c["greedy"])),
        }
        for fam, c in sorted(solved.items())
    }


def report(rates: dict[str, dict[str, float]], group_size: int) -> tuple[str, str]:
    """(a markdown table per family, the curriculum spec)."""
    weights = weights_from_rates({f: (r["greedy"], r["sampled"]) for f, r in rates.items()}, group_size)
    lines = [
        f"| family | greedy episodes | greedy solved | sampled solved | P(informative, G={group_size}) | weight |",
        "|---|---|---|---|---|---|",
    ]
    for fam, r in rates.items():
        p = informative(r["sampled"], group_size)
        lines.append(f"| {fam} | {r['n']:.0f} | {r['greedy']:.2f} | {r['sampled']:.2f} | {p:.2f} | {weights[fam]:g} |")
    return "\n".join(lines), format_spec(weights)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m warmstart.curriculum", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="model directory (e.g. models/warmstart)")
    p.add_argument("--per-family", type=int, default=4, help="training tasks per family (%(default)s)")
    p.add_argument("--samples", type=int, default=4, help="sampled episodes per task and dialect (%(default)s)")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled episodes (%(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="GRPO group size the weights assume (%(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (%(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write the rates and the spec here (after each task)")
    a = p.parse_args(argv)

    def save(rates: dict[str, dict[str, float]]) -> None:
        if a.json:
            spec = report(rates, a.group_size)[1]
            a.json.write_text(json.dumps({"rates": rates, "spec": spec, "group_size": a.group_size}, indent=1))

    rates = measure(a.model, a.per_family, a.samples, a.temperature, a.threads, each=save)
    table, spec = report(rates, a.group_size)
    print(table)
    print(f"curriculum: {spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
