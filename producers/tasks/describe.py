"""Suites and tasks for people: finding one task by path or id, and the text of ``tasks list`` / ``tasks show``.

A task is named either by its path — a task directory (ClawGym-Bench ``data_entry.json``, native ``task.json`` /
``task.toml``) or a PinchBench ``tasks/task_*.md`` file, whose suite is the directory around it — or by its id with a
suite spec (``builtin:cpu`` | ``native:DIR`` | ``clawgym:DIR`` | ``pinchbench:DIR`` | ``DIR``). Used by
``python -m producers.tasks`` and ``clawstream tasks``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from producers.tasks import loaders, pinchbench
from producers.tasks.catalog import load_suite
from producers.tasks.model import Suite, Task, TaskError
from producers.tasks.native import _task_config, load_native_task, write_native_task


def find_task(task: str, suite: str | None = None) -> Task:
    """The task ``task`` names: an id in suite spec ``suite``, or (without one) a task directory or task file."""
    if suite:
        return load_suite(suite).get(task)
    path = Path(task).expanduser()
    if path.is_file() and path.suffix == ".md" and path.parent.name == "tasks":
        root = path.parent.parent
        return pinchbench.load_pinchbench_task(root.name, root, path)
    if path.is_dir() and (path / "data_entry.json").is_file():
        return loaders.load_clawgym_task(path.parent.name, path)
    if path.is_dir() and _task_config(path) is not None:
        return load_native_task(path.parent.name, path)
    if path.exists():
        raise TaskError(f"{path} is not a task directory (data_entry.json, task.json, task.toml) or tasks/task_*.md")
    raise TaskError(f"no task {task!r}: give a task directory or PinchBench task file, or a task id with --suite SPEC")


def title(task: Task, width: int = 72) -> str:
    """A one-line title: the task's name where the suite gives one, else the prompt's start."""
    name = task.metadata.get("name")
    text = name if name and name != task.task_id else " ".join(task.prompt.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def suite_table(suite: Suite) -> str:
    """One row per task — id, split, timeout, availability, title — then the unavailable ones with the reason."""
    rows = [("id", "split", "timeout", "available", "title")]
    rows += [(t.task_id, t.split, f"{t.timeout_s:.0f}s", "yes", title(t)) for t in suite.tasks.values()]
    rows += [(task_id, "-", "-", "no", why) for task_id, why in sorted(suite.unavailable.items())]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
    lines.append(f"{len(suite.tasks)} available, {len(suite.unavailable)} unavailable (suite {suite.name})")
    return "\n".join(lines)


def _where(task: Task) -> str:
    g = task.grader
    if g.workspace_folder:
        return f"{task.mount_dir}/{g.workspace_folder}/ (inside the workspace, copied in after the agent finished)"
    return "the sandbox's grader dir (outside the workspace, copied in after the agent finished)"


def task_details(task: Task) -> str:
    """Everything about a task: metadata, the prompt, the workspace files and the grader."""
    g = task.grader
    head = [
        ("task", task.ref),
        ("split", task.split),
        ("timeout", f"{task.timeout_s:.0f}s"),
        ("mount dir", task.mount_dir),
    ]
    head += [(k, v) for k, v in sorted(task.metadata.items()) if v and k not in ("task_id", "metadata")]
    grader = [
        ("name", g.name),
        ("type", g.grading_type),
        ("command", " ".join(g.argv)),
        ("output", g.output + (f" (sub-scores: what {g.subscores_script} prints)" if g.subscores_script else "")),
        ("files at", _where(task)),
        ("transcript", g.transcript),
    ]
    if g.mount_dir_rewrite:
        grader.append(("rewrites", f"{g.mount_dir_rewrite} → the real workspace path (prompt and grader files)"))
    if g.reward_payload:
        grader.append(("payload", f"{task.mount_dir}/{g.reward_payload} ($OPENCLAW_REWARD_PAYLOAD)"))
    width = max(len(k) for k, _ in head + grader)
    out = [f"{k:<{width}}  {v}" for k, v in head]
    out += ["", "## prompt", task.prompt.rstrip(), "", f"## workspace files ({len(task.files)})"]
    out += [f"{len(data):>9}  {rel}" for rel, data in sorted(task.files.items())] or ["(none)"]
    out += ["", "## grader"] + [f"{k:<{width}}  {v}" for k, v in grader]
    out += [f"{len(data):>9}  {rel}" for rel, data in sorted(g.files.items())]
    if g.judge_rubric:
        out += ["", "## judge rubric", g.judge_rubric.rstrip()]
    return "\n".join(out)


def task_json(task: Task) -> str:
    """The same, as JSON (file contents left out: their sizes instead)."""
    g = task.grader
    return json.dumps(
        {
            "suite": task.suite,
            "task_id": task.task_id,
            "split": task.split,
            "timeout_s": task.timeout_s,
            "mount_dir": task.mount_dir,
            "metadata": dict(task.metadata),
            "prompt": task.prompt,
            "files": {rel: len(data) for rel, data in sorted(task.files.items())},
            "grader": {
                "name": g.name,
                "grading_type": g.grading_type,
                "argv": list(g.argv),
                "output": g.output,
                "workspace_folder": g.workspace_folder,
                "subscores_script": g.subscores_script,
                "reward_payload": g.reward_payload,
                "mount_dir_rewrite": g.mount_dir_rewrite,
                "transcript": g.transcript,
                "files": {rel: len(data) for rel, data in sorted(g.files.items())},
                "judge_rubric": g.judge_rubric,
            },
        },
        indent=2,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m producers.tasks``: list a suite, show a task (grading a workspace: ``clawstream tasks grade``)."""
    parser = argparse.ArgumentParser(
        prog="python -m producers.tasks",
        description="List a task suite or show one task. Suite specs: builtin:cpu | native:DIR | clawgym:DIR | "
        "pinchbench:DIR | DIR (layout detected). Grading a workspace runs in a sandbox: clawstream tasks grade.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="the suite's tasks: id, split, timeout, availability, title")
    ls.add_argument("spec", help="suite spec")
    ls.add_argument("--export", type=Path, help="also write the suite's tasks in the native format under this dir")
    show = sub.add_parser("show", help="one task: prompt, workspace files, grader")
    show.add_argument("task", help="task directory, PinchBench tasks/task_*.md, or a task id with --suite")
    show.add_argument("--suite", help="suite spec the task id belongs to")
    show.add_argument("--json", action="store_true", help="print JSON")
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] not in ("list", "show") and not argv[0].startswith("-"):
        argv = ["list", *argv]  # `python -m producers.tasks SPEC`, as before
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            suite = load_suite(args.spec)
            print(suite_table(suite))
            for task in suite.tasks.values() if args.export else ():
                write_native_task(task, args.export / task.task_id)
        else:
            task = find_task(args.task, args.suite)
            print(task_json(task) if args.json else task_details(task))
    except TaskError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
