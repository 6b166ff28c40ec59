"""The native task-suite format: one directory per task, under a suite directory.

::

    my_suite/
      write_notes/
        task.json | task.toml   {"prompt": "...", "timeout_s": 120, "split": "train", "mount_dir": "/workspace"}
        workspace/...           copied into the sandbox workspace before the harness starts
        grade.py                run as ``python grade.py <workspace>``; prints a JSON dict of sub-scores in [0, 1]
        (any other file)        grader data, laid out next to grade.py (the harness never sees them)

The reward is the mean of the sub-scores.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from producers.tasks.model import DEFAULT_MOUNT_DIR, Grader, Suite, Task, TaskError, read_tree, write_tree

# --- native format ------------------------------------------------------------------------------------------------


def _task_config(task_dir: Path) -> dict | None:
    if (task_dir / "task.json").is_file():
        return json.loads((task_dir / "task.json").read_text())
    if (task_dir / "task.toml").is_file():
        return tomllib.loads((task_dir / "task.toml").read_text())
    return None


def load_native_task(suite: str, task_dir: Path) -> Task:
    conf = _task_config(task_dir)
    if conf is None:
        raise TaskError(f"{task_dir}: no task.json or task.toml")
    if not isinstance(conf.get("prompt"), str) or not conf["prompt"].strip():
        raise TaskError(f"{task_dir}: task config needs a non-empty 'prompt'")
    if not (task_dir / "grade.py").is_file():
        raise TaskError(f"{task_dir}: no grade.py")
    grader_files = {
        rel: data
        for rel, data in read_tree(task_dir).items()
        if rel not in ("task.json", "task.toml") and not rel.startswith("workspace/")
    }
    grader = Grader(
        name=str(conf.get("grader", "native")),
        files=grader_files,
        argv=("${python}", "${grader_dir}/grade.py", "${workspace}"),
    )
    return Task(
        suite=suite,
        task_id=task_dir.name,
        prompt=conf["prompt"],
        timeout_s=float(conf.get("timeout_s", 300)),
        files=read_tree(task_dir / "workspace"),
        grader=grader,
        mount_dir=str(conf.get("mount_dir", DEFAULT_MOUNT_DIR)),
        split=str(conf.get("split", "train")),
        metadata={k: str(v) for k, v in (conf.get("metadata") or {}).items()},
    )


def load_native_suite(path: Path, name: str | None = None) -> Suite:
    name = name or path.name
    tasks = {d.name: load_native_task(name, d) for d in sorted(path.iterdir()) if _task_config(d) is not None}
    if not tasks:
        raise TaskError(f"{path}: no task directories (each needs task.json or task.toml)")
    return Suite(name, tasks)


def write_native_task(task: Task, task_dir: Path) -> None:
    """Materialize a task (e.g. a generated one) in the native format."""
    conf = {
        "prompt": task.prompt,
        "timeout_s": task.timeout_s,
        "split": task.split,
        "mount_dir": task.mount_dir,
        "grader": task.grader.name,
        "metadata": dict(task.metadata),
    }
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "task.json").write_text(json.dumps(conf, indent=2) + "\n")
    write_tree(task_dir / "workspace", task.files)
    write_tree(task_dir, task.grader.files)
