"""Loaders for external task layouts: ClawGym-Bench and PinchBench → :class:`producers.tasks.model.Task`.

ClawGym-Bench (one directory per task; the public ClawGym-Agents ``RL/data/clawgym_{train,eval}`` layout)::

    task_0001/data_entry.json   {"task_id", "user_query", "input_mount_dir": "/root/.openclaw/workspace", "metadata"}
    task_0001/input_files/...   → the workspace (at input_mount_dir, which lies in /root/.openclaw/workspace)
    task_0001/reward/reward.sh  python3 /root/.openclaw/workspace/reward/check.py /root/.openclaw/workspace | <mean>
    task_0001/reward/check.py   prints a JSON dict of sub-scores (numbers or booleans)

Graded as the benchmark's own harness grades: after the agent finished, ``reward/`` is copied to
``<workspace>/reward/`` (replacing anything the agent left there), the run payload to
``<workspace>/.openclaw_reward_payload.json`` ($OPENCLAW_REWARD_PAYLOAD), then ``bash <workspace>/reward/reward.sh``
runs in the workspace; its last stdout line is the reward, and ``check.py``'s own stdout (which ``reward.sh`` pipes
away) is captured for the sub-scores; both are removed afterwards (``producers.tasks.grading_rules``). The scripts
hard-code the mount dir: every occurrence of it in the grader files and the prompt is rewritten to the sandbox's
real workspace path (``Grader.mount_dir_rewrite``); a container backend that mounts the workspace there makes that
a no-op.

PinchBench: ``producers.tasks.pinchbench`` (its loaders are re-exported here).
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from producers.tasks.model import Grader, Suite, Task, TaskError, read_tree
from producers.tasks.pinchbench import load_pinchbench_suite, load_pinchbench_task

# --- ClawGym-Bench ------------------------------------------------------------------------------------------------

CLAWGYM_MOUNT_DIR = "/root/.openclaw/workspace"  # the workspace every published task's scripts hard-code
CLAWGYM_REWARD_FOLDER = "reward"  # where reward.sh expects itself and check.py: inside the workspace
CLAWGYM_PAYLOAD = ".openclaw_reward_payload.json"  # the benchmark's name for the run payload in the workspace


def _clawgym_files(task_dir: Path, input_mount_dir: str | None) -> dict[str, bytes]:
    """``input_files/`` as workspace files, placed at ``input_mount_dir`` relative to the workspace (the harness
    copies them there; it is the workspace root in every published task)."""
    files = read_tree(task_dir / "input_files")
    if input_mount_dir is None:
        return files
    mount = PurePosixPath(input_mount_dir)
    root = PurePosixPath(CLAWGYM_MOUNT_DIR)
    if mount != root and root not in mount.parents:
        raise TaskError(f"{task_dir}/data_entry.json: input_mount_dir {input_mount_dir} is outside {root}")
    sub = mount.relative_to(root)
    return files if str(sub) == "." else {f"{sub}/{rel}": data for rel, data in files.items()}


def load_clawgym_task(suite: str, task_dir: Path) -> Task:
    try:
        entry = json.loads((task_dir / "data_entry.json").read_text())
    except ValueError as exc:
        raise TaskError(f"{task_dir}/data_entry.json: {exc}") from exc
    query = entry.get("user_query")
    if not isinstance(query, str) or not query.strip():
        raise TaskError(f"{task_dir}/data_entry.json: no user_query")
    if not (task_dir / "reward" / "reward.sh").is_file():
        raise TaskError(f"{task_dir}: no reward/reward.sh")
    input_mount_dir = entry.get("input_mount_dir")
    grader = Grader(
        name="clawgym_reward_sh",
        files=read_tree(task_dir / "reward"),
        argv=("bash", f"${{workspace}}/{CLAWGYM_REWARD_FOLDER}/reward.sh"),
        output="reward_float",
        mount_dir_rewrite=CLAWGYM_MOUNT_DIR,
        workspace_folder=CLAWGYM_REWARD_FOLDER,
        subscores_script="check.py" if (task_dir / "reward" / "check.py").is_file() else None,
        reward_payload=CLAWGYM_PAYLOAD,
        transcript="openclaw_session",
    )
    timeout = float(entry.get("timeout_s") or entry.get("timeout") or 600)
    meta = {k: str(v) for k, v in entry.items() if k != "user_query" and isinstance(v, str | int | float)}
    extra = entry.get("metadata")
    if isinstance(extra, dict):  # {"category", "grading_type"}: flat for tables, whole for the reward payload
        meta.update({k: str(v) for k, v in extra.items() if isinstance(v, str | int | float) and k not in meta})
        meta["metadata"] = json.dumps(extra)
    return Task(
        suite=suite,
        task_id=str(entry.get("task_id") or task_dir.name),
        prompt=query,
        timeout_s=timeout,
        files=_clawgym_files(task_dir, input_mount_dir),
        grader=grader,
        mount_dir=CLAWGYM_MOUNT_DIR,
        split=str(entry.get("split", "test")),
        metadata=meta,
    )


def load_clawgym_suite(path: Path, name: str | None = None) -> Suite:
    """Every ``*/data_entry.json`` task; one that does not load is listed in ``Suite.unavailable`` with the reason."""
    name = name or path.name
    tasks, unavailable = {}, {}
    dirs = [d for d in sorted(path.iterdir()) if (d / "data_entry.json").is_file()]
    for d in dirs:
        try:
            task = load_clawgym_task(name, d)
        except TaskError as exc:
            unavailable[d.name] = str(exc)
            continue
        tasks[task.task_id] = task
    if not dirs:
        raise TaskError(f"{path}: no task_*/data_entry.json")
    return Suite(name, tasks, unavailable)


# PinchBench lives in producers.tasks.pinchbench; its loaders are re-exported for existing callers.
__all__ = ["load_clawgym_suite", "load_clawgym_task", "load_pinchbench_suite", "load_pinchbench_task"]
