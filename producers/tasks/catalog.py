"""The suite catalog: suite specs → loaded suites, as the sandbox worker and the scheduler resolve them.

Suite specs (:func:`load_suite`): ``builtin:cpu`` | ``native:DIR`` | ``clawgym:DIR`` | ``pinchbench:DIR`` | a bare
``DIR`` (layout detected); ``builtin:cpu?train_grader=partial`` (``producers.tasks.cpu.suite_for``). ``python -m
producers.tasks list SPEC`` lists a suite's tasks (``producers.tasks.describe``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from producers.tasks import cpu, loaders
from producers.tasks.model import Suite, Task, TaskError
from producers.tasks.native import _task_config, load_native_suite


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
        rest, _, options = rest.partition("?")  # builtin:cpu?train_grader=partial
        if rest != "cpu":
            raise TaskError(f"unknown built-in suite {rest!r}; known: cpu")
        suite = cpu.suite_for(options)
        return Suite(name, {k: _renamed(t, name) for k, t in suite.tasks.items()}) if name else suite
    path = Path(rest).expanduser()
    if not path.is_dir():
        raise TaskError(f"suite directory {path} does not exist")
    if kind == "auto":
        kind = detect_layout(path)
    if kind == "native":
        return load_native_suite(path, name)
    loader = loaders.load_clawgym_suite if kind == "clawgym" else loaders.load_pinchbench_suite
    return loader(path, name)


def _renamed(task: Task, suite: str) -> Task:
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
