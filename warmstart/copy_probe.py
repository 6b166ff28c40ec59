"""Does a policy copy the task's names through a real harness? A teacher-forced probe of its first call.

A recorded first call of the harness (the first MAIN call of a demonstration on ``PREFIX``'s calls topic: the
harness's own system prompt, tools and rendering) is the template. Each probed task's prompt replaces the recorded
task's in its user turn, as the harness sent it (raw or JSON-quoted: opencode quotes its argv), and the scripted
teacher's first call for that task (``warmstart.teacher``) is scored token by token under the policy: argmax accuracy
on the tokens that spell the task's file name and on the rest, how many calls have every name token right, and how
many are right entirely. No harness, sandbox or engine runs: a forward pass per task (~2-5 s for opencode's 13k-token
prompt on 2 cores) instead of an evaluation's minutes, and the held-out split is never trained on
(``warmstart.demos.heldout_tasks``).

Topics: ``PREFIX.clawstream.calls`` in (read to its end, no consumer group) → a JSON line on stdout. Run::

    clawstream model probe --model DIR --prefix demos1. [--tasks 32 --split heldout --harness opencode]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings
from producers.tasks.model import Task
from schemas.events import CallEvent, CallKind
from schemas.topics import CALLS
from warmstart.demos import heldout_tasks, train_tasks
from warmstart.scripted_engine import tool_call_text
from warmstart.sft_topics import read_records
from warmstart.teacher import TOOLS, plan, workspace_regex

USER = "<|im_start|>user\n"
END = "<|im_end|>"


@dataclass(frozen=True)
class Template:
    """A recorded first-call prompt, split around its task prompt (``quoted``: the harness JSON-quoted it)."""

    head: str
    tail: str
    quoted: bool

    def prompt(self, task: Task) -> str:
        return self.head + (json.dumps(task.prompt) if self.quoted else task.prompt) + self.tail


def split_template(prompt_text: str) -> Template:
    """The last user turn's content is the task prompt; raise when the text has no user turn."""
    start = prompt_text.rfind(USER)
    end = prompt_text.find(END, start)
    if start < 0 or end < 0:
        raise ValueError("the recorded call has no user turn to put a task in (is it a harness's first call?)")
    start += len(USER)
    content = prompt_text[start:end]
    return Template(prompt_text[:start], prompt_text[end:], content.startswith('"') and content.endswith('"'))


def first_call_text(calls: Sequence[CallEvent], tokenizer: Any) -> str:
    """The prompt of the first MAIN call that opens a conversation (no parent: its new tokens are the whole prompt)."""
    for call in sorted(calls, key=lambda c: (c.timestamp_ms, c.seq)):
        if call.call_kind == CallKind.MAIN and call.parent_call_id is None and call.shared_prefix_len == 0:
            return str(tokenizer.decode([int(t) for t in call.new_tokens]))
    raise ValueError("no first MAIN call on the topic: record demonstrations first (clawstream model demos)")


def name_spans(target: str, rel: str) -> list[tuple[int, int]]:
    """Character spans of the file name's stem in the target (`todo` of `todo.txt`: the part only the prompt gives)."""
    stem = rel.rsplit(".", 1)[0]
    return [(m.start(), m.end()) for m in re.finditer(re.escape(stem), target)]


def probe(model: Any, tokenizer: Any, template: Template, tasks: Sequence[Task], harness: str) -> dict[str, Any]:
    """Teacher-forced first calls of ``tasks`` under ``model``: accuracies and counts (pure but for the model)."""
    import torch

    counts = {"tasks": 0, "name_tokens": 0, "name_right": 0, "other_tokens": 0, "other_right": 0}
    counts |= {"names_all_right": 0, "calls_all_right": 0}
    ws_re = workspace_regex("/nonexistent")
    prompt_tokens = 0
    for task in tasks:
        prompt = template.prompt(task)
        found = ws_re.search(prompt)
        if found is None:
            raise ValueError("the recorded prompt names no sandbox workspace (recorded with isolation off?)")
        action = plan(task)[0]
        name, args = TOOLS[harness](found.group(0), action)
        target = tool_call_text(name, args) + END
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        enc = tokenizer(target, add_special_tokens=False, return_offsets_mapping=True)
        t_ids, offsets = enc["input_ids"], enc["offset_mapping"]
        with torch.no_grad():
            logits = model(torch.tensor([p_ids + t_ids])).logits[0, len(p_ids) - 1 : -1]  # (T, V)
        right = (logits.argmax(-1) == torch.tensor(t_ids)).tolist()  # (T,)
        spans = name_spans(target, action[1])
        in_name = [any(a < e and b > s for s, e in spans) for a, b in offsets]
        names = [r for r, n in zip(right, in_name, strict=True) if n]
        counts["tasks"] += 1
        counts["name_tokens"] += len(names)
        counts["name_right"] += sum(names)
        counts["other_tokens"] += len(right) - len(names)
        counts["other_right"] += sum(right) - sum(names)
        counts["names_all_right"] += all(names)
        counts["calls_all_right"] += all(right)
        prompt_tokens = max(prompt_tokens, len(p_ids))
    return {
        **counts,
        "name_accuracy": round(counts["name_right"] / max(1, counts["name_tokens"]), 4),
        "other_accuracy": round(counts["other_right"] / max(1, counts["other_tokens"]), 4),
        "prompt_tokens": prompt_tokens,
    }


def read_calls(kafka: KafkaSettings, timeout: float = 60.0) -> list[CallEvent]:
    return read_records(kafka, CALLS, CallEvent, timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clawstream model probe", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the policy's model directory (HF format)")
    p.add_argument("--prefix", required=True, help="topic prefix of recorded demonstrations (clawstream model demos)")
    p.add_argument("--harness", choices=sorted(TOOLS), default="opencode", help="the harness recorded (%(default)s)")
    p.add_argument("--tasks", type=int, default=32, help="tasks probed (%(default)s)")
    p.add_argument(
        "--split", choices=("heldout", "train"), default="heldout", help="held-out or training tasks (%(default)s)"
    )
    add_kafka_arguments(p)
    a = p.parse_args(argv)
    if a.tasks < 1:
        p.error(f"--tasks must be >= 1, got {a.tasks}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = kafka_settings(a)
    calls = read_calls(base.model_copy(update={"topic_prefix": a.prefix}))
    tokenizer = AutoTokenizer.from_pretrained(str(a.model))
    try:
        template = split_template(first_call_text(calls, tokenizer))
    except ValueError as exc:
        p.error(f"--prefix {a.prefix!r}: {exc}")
    model = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=torch.float32).eval()
    tasks = heldout_tasks(a.tasks) if a.split == "heldout" else train_tasks(a.tasks)
    t0 = time.perf_counter()
    try:
        out = probe(model, tokenizer, template, tasks, a.harness)
    except ValueError as exc:
        p.error(str(exc))
    out = {"model": str(a.model), "prefix": a.prefix, "split": a.split, **out, "s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
