"""Synthetic agent demonstrations: a scripted correct episode per task of the built-in CPU suite, in both dialects.

For every task of the CPU suite (``producers.tasks.cpu``) the canonical solution is derived from its grader's
``checks.json`` (:func:`solution_calls`), and a *scripted* policy that emits exactly those tool calls in the chat
template's own markup drives the real agent loop through ``warmstart.episodes.run_episode``. The recorded
(prompt ids, generated ids) turns are the SFT targets. Also the task splits: training tasks never share a prompt with
the held-out tasks the evaluation uses.

Topics: none (offline). Not run on its own: ``python -m warmstart.sft`` trains on these demonstrations.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from producers.harnesses import builtin_loop as agentloop
from producers.proxy.render import TemplateRenderer
from producers.tasks.cpu import generate
from producers.tasks.model import Task
from warmstart.episodes import DIALECTS, EpisodeResult, Policy, run_episode

_TOOLS = {"openai": agentloop.OPENAI_TOOLS, "anthropic": agentloop.ANTHROPIC_TOOLS}
FINISH_ARGUMENT = "done"
# Held-out prompts the SFT data must never contain: the first this-many of the suite's held-out split (a held-out
# split of any smaller size is a prefix of it, so every evaluation up to this size is on unseen prompts).
HELDOUT_RESERVE = 256
TRAIN_CHUNK = 400  # <= 8 templates x (132 - HELDOUT_RESERVE / 8) distinct prompts, with room to spare
SUITE_TRAIN = 96  # cpu_suite's default train size: its held-out split excludes exactly these prompts


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the policy must generate for one tool call: the template's own markup (the scripted policy
    appends the model's end-of-turn token, ``<|im_end|>`` for the tiny model)."""
    args = json.dumps(arguments, ensure_ascii=False)  # the template's `tojson`: ", " / ": " separators
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def solution_calls(task: Task, dialect: str) -> list[tuple[str, dict[str, Any]]]:
    """A correct (name, arguments) sequence for a task, derived from its ``checks.json`` (CPU suite graders).

    Read every input file first (unless the task only deletes), then write each file whose expected content
    differs from what is there, remove each file that must be absent, then finish.
    """
    checks = json.loads(task.grader.files["checks.json"])
    by_role = {t[0]: (name, t[3]) for name, t in _TOOLS[dialect].items()}

    def call(role: str, *values: Any) -> tuple[str, dict[str, Any]]:
        name, arg_names = by_role[role]
        return name, dict(zip(arg_names, values, strict=False))

    current = {rel: data.decode() for rel, data in task.files.items()}
    absent = [c["path"] for c in checks if c["kind"] == "absent"]
    out = [] if absent else [call("read", rel) for rel in current]
    for c in checks:
        if c["kind"] in ("equals", "lines"):
            want = c["text"] if c["kind"] == "equals" else "\n".join(c["lines"])
            if current.get(c["path"], "").strip() != want.strip():
                out.append(call("write", c["path"], want))
                current[c["path"]] = want
    out += [call("run", f"rm {path}") for path in absent]
    out.append(call("finish", FINISH_ARGUMENT))
    return out


def scripted_policy(tokenizer: Any, texts: list[str], eos: int | None = None) -> Policy:
    """A policy returning ``texts`` one per call, each ended by ``eos`` (default: the end-of-turn token the chat
    template ends an assistant turn with), then a bare ``eos``: an answer without a tool call."""
    if eos is None:
        eos = TemplateRenderer(tokenizer).end_of_turn_id
    queue = [[*tokenizer.encode(t, add_special_tokens=False), eos] for t in texts]
    return lambda _prompt: queue.pop(0) if queue else [eos]


def train_tasks(n_tasks: int, seed: int = 0) -> list[Task]:
    """``n_tasks`` training tasks; never a prompt of the first ``HELDOUT_RESERVE`` held-out tasks.

    Several templates have only 132 distinct prompts (a pair of file names; the contents vary), so the tasks come
    in chunks of ``TRAIN_CHUNK`` with seeds ``seed``, ``seed + 1000``, ...: prompts are distinct within a chunk and
    may repeat across chunks with other file contents. The first chunk starts with the suite's train split.
    """
    reserved = {t.prompt for t in heldout_tasks(HELDOUT_RESERVE, seed)}
    out: list[Task] = []
    for chunk in range((n_tasks + TRAIN_CHUNK - 1) // TRAIN_CHUNK):
        k = min(TRAIN_CHUNK, n_tasks - len(out))
        out += [
            replace(t, task_id=f"{t.task_id}-c{chunk}") if chunk else t
            for t in generate("train", k, seed + 1000 * chunk, exclude=set(reserved))
        ]
    return out


def heldout_tasks(n: int, seed: int = 0) -> list[Task]:
    """The CPU suite's held-out split (``cpu_suite(seed=seed)``), extended to ``n`` tasks."""
    return generate("heldout", n, seed + 1, exclude={t.prompt for t in generate("train", SUITE_TRAIN, seed)})


def build_episodes(tokenizer: Any, tasks: list[Task], dialects: tuple[str, ...] = DIALECTS) -> list[EpisodeResult]:
    """One scripted (correct) episode per task and dialect, through the real agent loop (ungraded, fast)."""
    renderer = TemplateRenderer(tokenizer)
    out = []
    for task in tasks:
        for dialect in dialects:
            texts = [tool_call_text(n, a) for n, a in solution_calls(task, dialect)]
            policy = scripted_policy(tokenizer, texts, renderer.end_of_turn_id)
            out.append(run_episode(task, dialect, policy, renderer, grade=False))
    return out


def build_demonstrations(
    tokenizer_dir: str | Path, split: str = "train", n_tasks: int = 1024, seed: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) for every assistant turn of a correct episode of each task, in both dialects."""
    from transformers import AutoTokenizer  # heavy: imported only when demonstrations are built

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tasks = train_tasks(n_tasks, seed) if split == "train" else heldout_tasks(n_tasks, seed)
    return [turn for ep in build_episodes(tokenizer, tasks) for turn in ep.turns]
