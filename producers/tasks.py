"""Task suites: the task model, the native directory format, and the suite catalog the sandbox worker resolves.

A :class:`Task` is pure data: prompt, wall-clock timeout, workspace files (relative path → bytes), where a
container backend mounts the workspace (``mount_dir``), and a :class:`Grader` (its files, its command line and how
to read its output). Graders always run *inside the sandbox* as a subprocess (``producers.grading``), never in
the worker's process.

Native format (one directory per task, under a suite directory)::

    my_suite/
      write_notes/
        task.json | task.toml   {"prompt": "...", "timeout_s": 120, "split": "train", "mount_dir": "/workspace"}
        workspace/...           copied into the sandbox workspace before the harness starts
        grade.py                run as ``python grade.py <workspace>``; prints a JSON dict of sub-scores in [0, 1]
        (any other file)        grader data, laid out next to grade.py (the harness never sees them)

The reward is the mean of the sub-scores. Other layouts: ``producers.task_loaders`` (ClawGym-Bench, PinchBench);
the built-in CPU suite: ``producers.task_cpu``.

Suite specs (:func:`load_suite`): ``builtin:cpu`` | ``native:DIR`` | ``clawgym:DIR`` | ``pinchbench:DIR`` | a bare
``DIR`` (layout detected). Run ``python -m producers.tasks SPEC`` to list a suite's tasks.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clawstream.errors import ClawstreamError

GraderOutput = Literal["subscores_json", "reward_float"]
GradingType = Literal["automated", "llm_judge", "hybrid"]
DEFAULT_MOUNT_DIR = "/workspace"


class TaskError(ClawstreamError):
    """A task or suite could not be found or loaded (bad layout, missing prompt, unknown suite)."""


@dataclass(frozen=True)
class Grader:
    """How a task is graded. ``argv`` is templated (``string.Template``) with ``python``, ``grader_dir``,
    ``workspace`` and ``transcript`` (a JSON file of the harness's parsed stdout) by ``producers.grading``."""

    name: str
    files: Mapping[str, bytes]
    argv: tuple[str, ...]
    output: GraderOutput = "subscores_json"
    grading_type: GradingType = "automated"
    # Text that the grader files hard-code for the workspace location; replaced by the real workspace path in the
    # sandbox's copies of the files (ClawGym-Bench scripts hard-code /root/.openclaw/workspace).
    mount_dir_rewrite: str | None = None
    judge_rubric: str = ""  # llm_judge / hybrid: what the judge is told to check


@dataclass(frozen=True)
class Task:
    suite: str
    task_id: str
    prompt: str
    timeout_s: float
    files: Mapping[str, bytes]
    grader: Grader
    mount_dir: str = DEFAULT_MOUNT_DIR
    split: str = "train"
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.suite}/{self.task_id}"


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: Mapping[str, Task]

    def split(self, split: str) -> list[Task]:
        return [t for t in self.tasks.values() if t.split == split]

    def get(self, task_id: str) -> Task:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise TaskError(f"suite {self.name!r} has no task {task_id!r}") from None


def read_tree(root: Path) -> dict[str, bytes]:
    """All regular files under ``root`` as relative POSIX path → bytes (empty when ``root`` does not exist)."""
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_tree(root: Path, files: Mapping[str, bytes]) -> None:
    """Write ``files`` under ``root``, refusing paths that would escape it."""
    base = root.resolve()
    for rel, data in files.items():
        target = (root / rel).resolve()
        if base != target and base not in target.parents:
            raise TaskError(f"file path {rel!r} escapes the directory it is written to")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


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
        rel: data for rel, data in read_tree(task_dir).items()
        if rel not in ("task.json", "task.toml") and not rel.startswith("workspace/")
    }  # fmt: skip
    grader = Grader(
        name=str(conf.get("grader", "native")), files=grader_files,
        argv=("${python}", "${grader_dir}/grade.py", "${workspace}"),
    )  # fmt: skip
    return Task(
        suite=suite, task_id=task_dir.name, prompt=conf["prompt"], timeout_s=float(conf.get("timeout_s", 300)),
        files=read_tree(task_dir / "workspace"), grader=grader, mount_dir=str(conf.get("mount_dir", DEFAULT_MOUNT_DIR)),
        split=str(conf.get("split", "train")), metadata={k: str(v) for k, v in (conf.get("metadata") or {}).items()},
    )  # fmt: skip


def load_native_suite(path: Path, name: str | None = None) -> Suite:
    name = name or path.name
    tasks = {d.name: load_native_task(name, d) for d in sorted(path.iterdir()) if _task_config(d) is not None}
    if not tasks:
        raise TaskError(f"{path}: no task directories (each needs task.json or task.toml)")
    return Suite(name, tasks)


def write_native_task(task: Task, task_dir: Path) -> None:
    """Materialize a task (e.g. a generated one) in the native format."""
    conf = {"prompt": task.prompt, "timeout_s": task.timeout_s, "split": task.split, "mount_dir": task.mount_dir,
            "grader": task.grader.name, "metadata": dict(task.metadata)}  # fmt: skip
    task_dir.mkdir(parents=True, exist_ok=True)
    (task_dir / "task.json").write_text(json.dumps(conf, indent=2) + "\n")
    write_tree(task_dir / "workspace", task.files)
    write_tree(task_dir, task.grader.files)


# --- catalog ------------------------------------------------------------------------------------------------------


def detect_layout(path: Path) -> str:
    if (path / "tasks").is_dir() and any((path / "tasks").glob("task_*.md")):
        return "pinchbench"
    if any(path.glob("*/data_entry.json")):
        return "clawgym"
    if any(_task_config(d) is not None for d in path.iterdir() if d.is_dir()):
        return "native"
    raise TaskError(f"{path}: not a native, ClawGym-Bench or PinchBench suite directory")


def load_suite(spec: str, name: str | None = None) -> Suite:
    """Load a suite from a spec string (see the module docstring); ``name`` overrides the suite's name."""
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in ("builtin", "native", "clawgym", "pinchbench"):
        kind, rest = "auto", spec
    if kind == "builtin":
        if rest != "cpu":
            raise TaskError(f"unknown built-in suite {rest!r}; known: cpu")
        from producers.task_cpu import cpu_suite

        suite = cpu_suite()
        return Suite(name, {k: _renamed(t, name) for k, t in suite.tasks.items()}) if name else suite
    path = Path(rest).expanduser()
    if not path.is_dir():
        raise TaskError(f"suite directory {path} does not exist")
    if kind == "auto":
        kind = detect_layout(path)
    if kind == "native":
        return load_native_suite(path, name)
    from producers import task_loaders

    loader = task_loaders.load_clawgym_suite if kind == "clawgym" else task_loaders.load_pinchbench_suite
    return loader(path, name)


def _renamed(task: Task, suite: str) -> Task:
    from dataclasses import replace

    return replace(task, suite=suite)


class SuiteCatalog:
    """Suite name → spec, loaded lazily once (the worker resolves every request's ``suite`` / ``task_id`` here)."""

    def __init__(self, specs: Mapping[str, str]) -> None:
        self.specs = dict(specs)
        self._loaded: dict[str, Suite] = {}

    def suite(self, name: str) -> Suite:
        if name not in self._loaded:
            if name not in self.specs:
                raise TaskError(f"unknown suite {name!r}; configured: {', '.join(self.specs) or 'none'}")
            self._loaded[name] = load_suite(self.specs[name], name)
        return self._loaded[name]

    def task(self, suite: str, task_id: str) -> Task:
        return self.suite(suite).get(task_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.tasks", description="List a suite or export it.")
    parser.add_argument("spec", help="builtin:cpu | native:DIR | clawgym:DIR | pinchbench:DIR | DIR")
    parser.add_argument("--export", type=Path, help="write the suite's tasks in the native format under this dir")
    args = parser.parse_args(argv)
    suite = load_suite(args.spec)
    for task in suite.tasks.values():
        print(f"{task.split:8} {task.task_id:28} {task.timeout_s:6.0f}s  {task.prompt[:70]!r}")
        if args.export:
            write_native_task(task, args.export / task.task_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
