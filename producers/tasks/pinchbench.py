"""PinchBench (github.com/pinchbench/skill, MIT): its task files → :class:`Task`, graded as the benchmark grades.

Reads ``tasks/task_*.md`` (YAML front matter + ``## `` sections) and ``assets/`` as the benchmark's
``scripts/lib_tasks.py`` does; a task with a per-task problem is listed in ``Suite.unavailable`` with the reason.
Grading as ``scripts/lib_grading.py``: automated checks run in the sandbox through :data:`RUNNER`, the LLM judge gets
:func:`judge_prompt` and its reply is read by :func:`parse_judge_reply`, hybrid tasks are combined by :func:`combine`.
Departure: a check that raises or a judge that gives no score is a ``GraderFailure``, never a 0. The layout, the
grading and the departures in full: docs/task_suites.md#pinchbench-module-notes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from producers.tasks.model import Grader, Suite, Task, TaskError

log = logging.getLogger("clawstream.tasks.pinchbench")

DEFAULT_TIMEOUT_S = 120  # lib_tasks.py: timeout_seconds defaults to 120
DEFAULT_WEIGHTS = {"automated": 0.5, "llm_judge": 0.5}

# Runs inside the sandbox: python pinch_runner.py <transcript.json> <workspace>. As lib_grading._grade_automated:
# exec the block in a fresh namespace, call grade(transcript, workspace), average its numeric values. The check's
# own prints go to stderr, so the last two stdout lines are the breakdown and the score.
RUNNER = r"""import contextlib, json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "automated_checks.py")) as f:
    code = f.read()
with open(sys.argv[1]) as f:
    transcript = json.load(f)
namespace = {}
with contextlib.redirect_stdout(sys.stderr):
    exec(compile(code, "automated_checks.py", "exec"), namespace)
    grade = namespace.get("grade")
    if not callable(grade):
        sys.exit("the automated checks define no grade(transcript, workspace_path)")
    scores = grade(transcript, sys.argv[2])
if not isinstance(scores, dict):
    scores = {}
values = [float(v) for v in scores.values() if isinstance(v, (int, float))]
breakdown = {}
for key, value in scores.items():
    try:
        breakdown[str(key)] = float(value)
    except (TypeError, ValueError):
        continue
print(json.dumps(breakdown))
print(repr(sum(values) / len(values) if values else 0.0))
"""

_FRONT = re.compile(r"^---\s*\n(.*?)\n---\s*\n(.*)$", re.DOTALL)
_SECTION = re.compile(r"^##\s+(.+)$")
_PYTHON_BLOCK = re.compile(r"```python\s*(.*?)\s*```", re.DOTALL)
_CRITERION = re.compile(r"^-\s+\[[ x]\]\s+(.+)$")


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """YAML front matter and body, as ``lib_tasks.py`` splits them; copies without ``---`` delimiters are read up to
    the first ``## `` heading."""
    m = _FRONT.match(text)
    if m:
        front, body = m.group(1), m.group(2)
    else:
        idx = text.find("\n## ")
        if idx < 0:
            raise TaskError("no YAML front matter (between '---' lines) and no '## ' sections")
        front, body = text[:idx], text[idx:]
    try:
        meta = yaml.safe_load(front) or {}
    except yaml.YAMLError as exc:
        raise TaskError(f"invalid YAML front matter: {exc}") from exc
    if not isinstance(meta, dict):
        raise TaskError("the front matter is not a mapping")
    return meta, body


def sections(body: str) -> dict[str, str]:
    """``## Title`` → its text up to the next ``## `` heading, stripped (``lib_tasks._parse_sections``)."""
    out: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []
    for line in body.split("\n"):
        m = _SECTION.match(line)
        if m:
            if current:
                out[current] = "\n".join(lines).strip()
            current, lines = m.group(1), []
        elif current:
            lines.append(line)
    if current:
        out[current] = "\n".join(lines).strip()
    return out


def grading_criteria(text: str) -> list[str]:
    """The ``- [ ]`` / ``- [x]`` items of a Grading Criteria section."""
    return [m.group(1) for line in text.split("\n") if (m := _CRITERION.match(line.strip()))]


def automated_code(checks: str) -> str:
    """The check's code: the ``python`` block (as the benchmark extracts it), else — in a section without any
    fence, as some copies have it — the section itself when it defines ``grade``."""
    m = _PYTHON_BLOCK.search(checks)
    if m:
        return m.group(1)
    return checks if "```" not in checks and "def grade" in checks else ""


def _workspace_files(root: Path, stem: str, entries: Any) -> dict[str, bytes]:
    if entries is None:
        return {}
    if not isinstance(entries, list):
        raise TaskError(f"workspace_files is not a list: {entries!r}")
    files: dict[str, bytes] = {}
    for entry in entries:
        if isinstance(entry, dict) and "content" in entry:
            dest = entry.get("path") or entry.get("dest")
            if not dest:
                raise TaskError(f"inline workspace file without a path: {entry!r}")
            files[str(dest)] = str(entry["content"]).encode()
            continue
        if isinstance(entry, str):
            source, dest = entry, entry
        elif isinstance(entry, dict) and (entry.get("source") or entry.get("path")):
            source = str(entry.get("source") or entry.get("path"))
            dest = str(entry.get("dest") or Path(source).name)
        else:
            raise TaskError(f"workspace file entry {entry!r} is neither {{path, content}} nor {{source, dest}}")
        for base in (root / "assets", root / "tasks" / stem, root):
            if (base / source).is_file():
                files[dest] = (base / source).read_bytes()
                break
        else:
            raise TaskError(f"asset missing: assets/{source} (workspace file {dest!r}) does not exist")
    return files


def load_pinchbench_task(suite: str, root: Path, md: Path) -> Task:
    """One task file (raises :class:`TaskError` naming the file and the problem)."""
    try:
        return _load_task(suite, root, md)
    except TaskError as exc:
        raise TaskError(f"{md.relative_to(root) if md.is_relative_to(root) else md}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"{md}: {exc}") from None


def _load_task(suite: str, root: Path, md: Path) -> Task:
    meta, body = split_front_matter(md.read_text(encoding="utf-8"))
    secs = sections(body)
    prompt = secs.get("Prompt", "").strip()
    if not prompt:
        raise TaskError("no '## Prompt' section")
    grading_type = str(meta.get("grading_type", "automated"))
    if grading_type not in ("automated", "llm_judge", "hybrid"):
        raise TaskError(f"grading_type {grading_type!r} is not automated | llm_judge | hybrid")
    code = automated_code(secs.get("Automated Checks", ""))
    if grading_type != "llm_judge" and "def grade" not in code:
        raise TaskError("'## Automated Checks' has no ```python block defining grade(transcript, workspace_path)")
    criteria = grading_criteria(secs.get("Grading Criteria", ""))
    rubric = secs.get("LLM Judge Rubric") or "\n".join(f"- {c}" for c in criteria)
    weights = meta.get("grading_weights") or DEFAULT_WEIGHTS
    if not isinstance(weights, Mapping):
        raise TaskError(f"grading_weights is not a mapping: {weights!r}")
    try:
        w_auto, w_judge = float(weights.get("automated", 0.5)), float(weights.get("llm_judge", 0.5))
        timeout = float(meta.get("timeout_seconds") or DEFAULT_TIMEOUT_S)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"grading_weights / timeout_seconds: {exc}") from exc
    task_id = str(meta.get("id") or md.stem)
    files = _workspace_files(root, md.stem, meta.get("workspace_files"))
    uses_code = grading_type != "llm_judge"
    grader = Grader(
        name=f"pinchbench_{grading_type}",
        files={"automated_checks.py": code.encode(), "pinch_runner.py": RUNNER.encode()} if uses_code else {},
        argv=("${python}", "${grader_dir}/pinch_runner.py", "${transcript}", "${workspace}") if uses_code else (),
        output="reward_float",
        grading_type=grading_type,  # type: ignore[arg-type]
        judge_rubric=rubric,
        judge_context=secs.get("Expected Behavior", "").strip(),
        transcript="openclaw_session",
    )
    metadata = {
        "name": str(meta.get("name", "")),
        "category": str(meta.get("category", "")),
        "file": md.name,
        "weight_automated": repr(w_auto),
        "weight_llm_judge": repr(w_judge),
    }
    return Task(
        suite=suite,
        task_id=task_id,
        prompt=prompt,
        timeout_s=timeout,
        files=files,
        grader=grader,
        split=str(meta.get("split", "test")),
        metadata=metadata,
    )


def load_pinchbench_suite(path: Path, name: str | None = None) -> Suite:
    """Every task of ``path/tasks`` that loads; the others in ``Suite.unavailable`` (id, or file stem when the file
    does not parse → reason)."""
    name = name or path.name
    mds = sorted((path / "tasks").glob("task_*.md"))
    if not mds:
        raise TaskError(f"{path}: no tasks/task_*.md")
    tasks: dict[str, Task] = {}
    unavailable: dict[str, str] = {}
    for md in mds:
        try:
            task = load_pinchbench_task(name, path, md)
        except TaskError as exc:
            unavailable[_declared_id(md)] = str(exc)
            continue
        if task.task_id in tasks:
            first = tasks[task.task_id].metadata["file"]
            unavailable[f"{task.task_id} ({md.name})"] = f"tasks/{md.name}: id {task.task_id} is taken by {first}"
            continue
        tasks[task.task_id] = task
    for task_id, why in unavailable.items():
        log.warning("PinchBench suite %s: task %s unavailable: %s", name, task_id, why)
    if not tasks:
        raise TaskError(f"{path}: no PinchBench task could be loaded: " + "; ".join(unavailable.values()))
    return Suite(name, tasks, unavailable)


def _declared_id(md: Path) -> str:
    """The id a task file declares, when its front matter can be read at all; else the file stem."""
    try:
        meta, _ = split_front_matter(md.read_text(encoding="utf-8"))
        return str(meta.get("id") or md.stem)
    except (TaskError, OSError, UnicodeDecodeError):
        return md.stem


# --- the LLM judge, as lib_grading.py asks and reads it ---------------------------------------------------------


def summarize_transcript(transcript: list[dict[str, Any]]) -> str:
    """The transcript as the judge sees it (``lib_grading._summarize_transcript``): tool calls, tool results (first
    content item, 200 chars) and user messages (first content item)."""
    parts: list[str] = []
    for event in transcript:
        if not isinstance(event, dict) or event.get("type") != "message":
            continue
        msg = event.get("message", {})
        role = msg.get("role")
        if role == "assistant":
            for item in msg.get("content", []):
                if isinstance(item, dict) and item.get("type") == "toolCall":
                    parts.append(f"Tool: {item.get('name')}({json.dumps(item.get('arguments', {}))})")
        elif role == "toolResult":
            content = msg.get("content", [])
            if content:
                parts.append(f"Result: {str(content[0])[:200]}")
        elif role == "user":
            content = msg.get("content", [])
            if content:
                parts.append(f"User: {content[0]}")
    return "\n".join(parts)


def judge_prompt(task: Task, transcript: list[dict[str, Any]]) -> str:
    """The benchmark's judge prompt (``lib_grading._build_judge_prompt``), word for word."""
    return (
        "You are a grading function. Your ONLY job is to output a single JSON object.\n\n"
        "CRITICAL RULES:\n"
        "- Do NOT use any tools (no Read, Write, exec, or any other tool calls)\n"
        "- Do NOT create files or run commands\n"
        "- Do NOT write any prose, explanation, or commentary outside the JSON\n"
        "- Respond with ONLY a JSON object — nothing else\n\n"
        "Be a strict evaluator. Reserve 1.0 for genuinely excellent performance. "
        "An average acceptable completion should score around 0.6-0.7. "
        "Deduct points for unnecessary steps, verbose output, and inefficient tool usage.\n\n"
        "## Task\n"
        f"{task.prompt}\n\n"
        "## Expected Behavior\n"
        f"{task.grader.judge_context}\n\n"
        "## Agent Transcript (summarized)\n"
        f"{summarize_transcript(transcript)}\n\n"
        "## Grading Rubric\n"
        f"{task.grader.judge_rubric}\n\n"
        "Score each criterion from 0.0 to 1.0.\n\n"
        "Respond with ONLY this JSON structure (no markdown, no code fences, no extra text):\n"
        '{"scores": {"criterion_name": 0.0}, "total": 0.0, "notes": "brief justification"}'
    )


def _json_objects(text: str) -> list[str]:
    """Top-level ``{…}`` spans of ``text``, by brace depth (as the benchmark finds them)."""
    found, depth, current = [], 0, []
    for ch in text:
        if ch == "{":
            if depth == 0:
                current = []
            depth += 1
        if depth > 0:
            current.append(ch)
        if ch == "}" and depth > 0:
            depth -= 1
            if depth == 0 and current:
                found.append("".join(current))
    return found


def _judge_dict(text: str) -> dict[str, Any]:
    """``lib_grading._parse_judge_response`` on the reply text: a ```json block, else the last JSON object with
    ``scores``, else the last JSON object, else a ``total: x`` in prose."""
    text = text.strip()
    if not text:
        return {}
    block = re.search(r"```json\s*(.*?)\s*```", text, re.DOTALL)
    if block:
        try:
            parsed = json.loads(block.group(1))
            if isinstance(parsed, dict):
                return parsed
        except ValueError:
            pass
    candidates = _json_objects(text)
    for want_scores in (True, False):
        for candidate in reversed(candidates):
            try:
                parsed = json.loads(candidate)
            except ValueError:
                continue
            if isinstance(parsed, dict) and (not want_scores or "scores" in parsed):
                return parsed
    m = re.search(r"(?:total|overall|final)\s*(?:score)?[:\s]*(0\.\d+|1\.0+)", text, re.IGNORECASE)
    if m:
        return {"scores": {}, "total": float(m.group(1)), "notes": "Score extracted from prose (JSON parse failed)"}
    return {}


def _number(value: Any, *, text: bool = False) -> float | None:
    """A number (booleans count, as in the benchmark); numeric text only where the benchmark converts it."""
    if isinstance(value, int | float) or (text and isinstance(value, str)):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def parse_judge_reply(text: str) -> tuple[float | None, dict[str, float], str]:
    """(total, per-criterion scores, notes) from a judge's reply, read as ``lib_grading`` reads it
    (``_parse_judge_response`` + ``_normalize_judge_response``); total None when the reply gives none."""
    parsed = _judge_dict(text)
    raw = parsed.get("scores") if isinstance(parsed.get("scores"), dict) else parsed.get("criteria_scores")
    scores: dict[str, float] = {}
    for key, value in (raw if isinstance(raw, dict) else {}).items():
        x = _number(value.get("score"), text=True) if isinstance(value, dict) else _number(value)
        if x is not None:
            scores[str(key)] = x
    total: float | None = None
    if parsed.get("total") is not None:
        total = float(parsed["total"]) if isinstance(parsed["total"], int | float) else None
    elif isinstance(parsed.get("score"), int | float):
        total = float(parsed["score"])
    elif scores:
        total = sum(scores.values()) / len(scores)
    notes = next((str(parsed[k]) for k in ("notes", "justification", "reasoning") if k in parsed), "")
    return total, scores, notes


def combine(
    task: Task, auto: float, auto_breakdown: Mapping[str, float], judge: float, judge_breakdown: Mapping[str, float]
) -> tuple[float, dict[str, float]]:
    """A hybrid task's score and breakdown (``lib_grading._combine_grades``), weights as the task states."""
    w_auto = float(task.metadata.get("weight_automated", 0.5))
    w_judge = float(task.metadata.get("weight_llm_judge", 0.5))
    if w_auto + w_judge <= 0:
        w_auto = w_judge = 0.5
    score = (auto * w_auto + judge * w_judge) / (w_auto + w_judge)
    breakdown = {
        **{f"automated.{k}": v for k, v in auto_breakdown.items()},
        **{f"llm_judge.{k}": v for k, v in judge_breakdown.items()},
    }
    return score, breakdown
