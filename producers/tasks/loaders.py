"""Loaders for external task layouts: ClawGym-Bench and PinchBench → :class:`producers.tasks.model.Task`.

ClawGym-Bench (one directory per task)::

    task_0001/data_entry.json   {"user_query": "...", "input_mount_dir": "/root/.openclaw/workspace", ...}
    task_0001/input_files/...   → the workspace
    task_0001/reward/reward.sh  prints a float in [0, 1] (last line); it calls reward/check.py (a dict of sub-scores)

The scripts hard-code the mount dir. Mapping: the grader files are copied into the sandbox's grader directory with
every occurrence of ``input_mount_dir`` rewritten to the sandbox's real workspace path (``Grader.mount_dir_rewrite``,
applied by ``producers.tasks.grading``), and ``reward.sh`` runs with its own directory as cwd and
``CLAWGYM_WORKSPACE`` /
``WORKSPACE`` set. The prompt's mentions of the mount dir are rewritten the same way at launch. A container backend
mounts the workspace at ``input_mount_dir`` itself, so there the rewrite is a no-op. Sub-scores: any line of the
output that is a dict (JSON or a Python literal, as ``check.py`` prints) is reported as sub-scores.

PinchBench (``tasks/task_NN_name.md``): YAML front matter (``id``, ``name``, ``category``, ``grading_type``
automated | llm_judge | hybrid, ``timeout_seconds``, ``workspace_files``, optional ``grading_weights``), then
``## Prompt``, ``## Expected Behavior``, ``## Grading Criteria``, ``## Automated Checks`` (Python defining
``grade(transcript, workspace_path) -> dict[str, float]``, fenced or not) and optionally ``## LLM Judge Rubric``.
``workspace_files`` entries: ``"name"`` (from ``tasks/<task stem>/`` or ``assets/``), ``{source, dest}`` (source under
``assets/``, ``tasks/<task stem>/`` or the suite root) or ``{path, content}`` (inline). The automated check runs in the
sandbox through a small runner script (``pinch_runner.py``) given the transcript file and the workspace. LLM-judge
grading (rubric + criteria) goes to a judge endpoint (``producers.tasks.grading``); without one the task is UNGRADED.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from producers.tasks.model import Grader, Suite, Task, TaskError, read_tree

CLAWGYM_MOUNT_DIR = "/root/.openclaw/workspace"


def load_clawgym_task(suite: str, task_dir: Path) -> Task:
    entry = json.loads((task_dir / "data_entry.json").read_text())
    query = entry.get("user_query")
    if not isinstance(query, str) or not query.strip():
        raise TaskError(f"{task_dir}/data_entry.json: no user_query")
    if not (task_dir / "reward" / "reward.sh").is_file():
        raise TaskError(f"{task_dir}: no reward/reward.sh")
    mount = str(entry.get("input_mount_dir") or CLAWGYM_MOUNT_DIR).rstrip("/")
    grader = Grader(
        name="clawgym_reward_sh", files=read_tree(task_dir / "reward"), argv=("bash", "${grader_dir}/reward.sh"),
        output="reward_float", mount_dir_rewrite=mount,
    )  # fmt: skip
    timeout = float(entry.get("timeout_s") or entry.get("timeout") or 600)
    meta = {k: str(v) for k, v in entry.items() if k not in ("user_query",) and isinstance(v, str | int | float)}
    return Task(suite=suite, task_id=task_dir.name, prompt=query, timeout_s=timeout,
                files=read_tree(task_dir / "input_files"), grader=grader, mount_dir=mount,
                split=str(entry.get("split", "test")), metadata=meta)  # fmt: skip


def load_clawgym_suite(path: Path, name: str | None = None) -> Suite:
    name = name or path.name
    tasks = {d.name: load_clawgym_task(name, d) for d in sorted(path.iterdir()) if (d / "data_entry.json").is_file()}
    if not tasks:
        raise TaskError(f"{path}: no task_*/data_entry.json")
    return Suite(name, tasks)


# --- PinchBench ---------------------------------------------------------------------------------------------------

# Runs inside the sandbox: python pinch_runner.py <transcript.json> <workspace>; prints the grade() dict as JSON.
PINCH_RUNNER = r'''import json, os, sys
ns = {"__name__": "pinch_check"}
here = os.path.dirname(os.path.abspath(__file__))
exec(compile(open(os.path.join(here, "automated_checks.py")).read(), "automated_checks.py", "exec"), ns)
transcript = json.load(open(sys.argv[1]))
scores = ns["grade"](transcript, sys.argv[2])
print(json.dumps({str(k): float(v) for k, v in scores.items()}))
'''

_FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """YAML front matter (between ``---`` lines, or — as some copies have it — up to the first ``## `` heading)."""
    if text.startswith("---"):
        _, front, body = text.split("---", 2)
    else:
        idx = text.find("\n## ")
        if idx < 0:
            raise TaskError("no front matter and no '## ' sections")
        front, body = text[:idx], text[idx:]
    meta = yaml.safe_load(front) or {}
    if not isinstance(meta, dict):
        raise TaskError("front matter is not a mapping")
    return meta, body


def sections(body: str) -> dict[str, str]:
    """``## Title`` → section text (stripped, trailing ``---`` rules removed)."""
    out: dict[str, str] = {}
    parts = re.split(r"^## +(.+?)\s*$", body, flags=re.MULTILINE)
    for title, text in zip(parts[1::2], parts[2::2], strict=True):
        out[title.strip()] = re.sub(r"\n-{3,}\s*$", "", text.strip()).strip()
    return out


def _workspace_files(root: Path, stem: str, entries: list[Any]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for entry in entries or []:
        if isinstance(entry, dict) and "content" in entry:
            files[str(entry.get("path") or entry.get("dest"))] = str(entry["content"]).encode()
            continue
        source = entry if isinstance(entry, str) else entry.get("source") or entry.get("path")
        dest = entry if isinstance(entry, str) else entry.get("dest") or Path(str(source)).name
        for base in (root / "tasks" / stem, root / "assets", root):
            if (base / str(source)).is_file():
                files[str(dest)] = (base / str(source)).read_bytes()
                break
        else:
            raise TaskError(f"{stem}: workspace file {source!r} not found under tasks/{stem}/, assets/ or the root")
    return files


def load_pinchbench_task(suite: str, root: Path, md: Path) -> Task:
    try:
        meta, body = split_front_matter(md.read_text())
    except (TaskError, yaml.YAMLError) as exc:
        raise TaskError(f"{md}: {exc}") from exc
    secs = sections(body)
    prompt = secs.get("Prompt", "")
    if not prompt:
        raise TaskError(f"{md}: no '## Prompt' section")
    grading_type = str(meta.get("grading_type", "automated"))
    if grading_type not in ("automated", "llm_judge", "hybrid"):
        raise TaskError(f"{md}: grading_type {grading_type!r} is not automated | llm_judge | hybrid")
    checks = secs.get("Automated Checks", "")
    fenced = _FENCE.search(checks)
    code = fenced.group(1) if fenced else checks
    if grading_type != "llm_judge" and "def grade" not in code:
        raise TaskError(f"{md}: '## Automated Checks' defines no grade(transcript, workspace_path)")
    rubric = "\n\n".join(f"## {k}\n{secs[k]}" for k in ("Expected Behavior", "Grading Criteria", "LLM Judge Rubric")
                         if secs.get(k))  # fmt: skip
    weights = meta.get("grading_weights") or {}
    grader = Grader(
        name=f"pinchbench_{grading_type}",
        files={"automated_checks.py": code.encode(), "pinch_runner.py": PINCH_RUNNER.encode()}
        if "def grade" in code else {},
        argv=("${python}", "${grader_dir}/pinch_runner.py", "${transcript}", "${workspace}"),
        grading_type=grading_type,  # type: ignore[arg-type]
        judge_rubric=rubric,
    )  # fmt: skip
    task_id = str(meta.get("id") or md.stem)
    metadata = {"name": str(meta.get("name", task_id)), "category": str(meta.get("category", "")),
                "weight_automated": str(weights.get("automated", 0.5)),
                "weight_llm_judge": str(weights.get("llm_judge", 0.5))}  # fmt: skip
    return Task(suite=suite, task_id=task_id, prompt=prompt, timeout_s=float(meta.get("timeout_seconds", 300)),
                files=_workspace_files(root, md.stem, meta.get("workspace_files") or []), grader=grader,
                split=str(meta.get("split", "test")), metadata=metadata)  # fmt: skip


def load_pinchbench_suite(path: Path, name: str | None = None) -> Suite:
    name = name or path.name
    tasks = {}
    for md in sorted((path / "tasks").glob("task_*.md")):
        task = load_pinchbench_task(name, path, md)
        tasks[task.task_id] = task
    if not tasks:
        raise TaskError(f"{path}: no tasks/task_*.md")
    return Suite(name, tasks)
