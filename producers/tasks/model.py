"""The task model: what a task is (prompt, workspace files, timeout, grader), as pure data.

A :class:`Task` holds a prompt, a wall-clock timeout, its workspace files (relative path → bytes), where a
container backend mounts the workspace (``mount_dir``), and a :class:`Grader` (its files, its command line and how
to read its output). Graders always run *inside the sandbox* as a subprocess (``producers.sandbox.run_grader``),
never in the worker's process. Suite formats: ``producers.tasks.native``, ``producers.tasks.loaders`` (ClawGym-Bench,
PinchBench), ``producers.tasks.cpu`` (built-in); ``producers.tasks.catalog`` resolves a suite spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clawbase.errors import ClawstreamError

GraderOutput = Literal["subscores_json", "reward_float"]
GradingType = Literal["automated", "llm_judge", "hybrid"]
TranscriptFormat = Literal["stdout", "openclaw_session"]
DEFAULT_MOUNT_DIR = "/workspace"


class TaskError(ClawstreamError):
    """A task or suite could not be found or loaded (bad layout, missing prompt, unknown suite)."""


@dataclass(frozen=True)
class Grader:
    """How a task is graded. ``argv`` is templated (``string.Template``) with ``python``, ``grader_dir``,
    ``workspace`` and ``transcript`` (a JSON file of the run's transcript, see ``transcript``) by
    ``producers.tasks.grading_rules``."""

    name: str
    files: Mapping[str, bytes]
    argv: tuple[str, ...]
    output: GraderOutput = "subscores_json"
    grading_type: GradingType = "automated"
    # Text that the grader files hard-code for the workspace location; replaced by the real workspace path in the
    # sandbox's copies of the files (ClawGym-Bench scripts hard-code /root/.openclaw/workspace).
    mount_dir_rewrite: str | None = None
    judge_rubric: str = ""  # llm_judge / hybrid: what the judge is told to check
    judge_context: str = ""  # llm_judge / hybrid: what the agent was expected to do (PinchBench: Expected Behavior)
    # What ${transcript} holds: "stdout" → the harness's machine-readable stdout as a list of dicts; "openclaw_session"
    # → the run as OpenClaw session records (OpenClaw's own session file, else built from the conversation the proxy
    # saw: producers.tasks.transcript), the transcript PinchBench's checks and judge read.
    transcript: TranscriptFormat = "stdout"
    # Where the files are laid out for grading: None → the sandbox's grader dir, outside the workspace; a relative
    # folder → that folder *inside* the workspace (ClawGym-Bench: "reward", where its reward.sh calls check.py).
    # Either way only after the harness ended; a folder inside the workspace is first cleared of whatever the agent
    # left under that name, and removed again after grading.
    workspace_folder: str | None = None
    # One of the files whose own stdout carries the sub-scores when the command prints only the reward
    # (ClawGym-Bench: "check.py", which reward.sh pipes into an averaging one-liner); captured as it prints them.
    subscores_script: str | None = None
    # A file the grader reads the run from, written into the workspace under this name for grading only and named
    # by $OPENCLAW_REWARD_PAYLOAD (ClawGym-Bench: ".openclaw_reward_payload.json" = final_message, metadata,
    # transcript).
    reward_payload: str | None = None


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
    # Tasks of the suite's directory that could not be loaded: task id → why (the rest of the suite still loads).
    unavailable: Mapping[str, str] = field(default_factory=dict)

    def split(self, split: str) -> list[Task]:
        return [t for t in self.tasks.values() if t.split == split]

    def get(self, task_id: str) -> Task:
        try:
            return self.tasks[task_id]
        except KeyError:
            if task_id in self.unavailable:
                raise TaskError(
                    f"task {task_id!r} of suite {self.name!r} is unavailable: {self.unavailable[task_id]}"
                ) from None
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
