"""Grading a finished rollout in its sandbox: the task's grader runs *inside* the sandbox, or an LLM judge is asked.

The grader files are copied into the sandbox's grader directory only now (after the harness ended, so the harness
never sees them). The command runs with the same backend and isolation as the harness, with
``grader_timeout_s``. The grading rules themselves (invocation, output parsing, judge) are
``producers.tasks.grading``; a grader that fails is a :class:`GraderFailure` (an infrastructure failure of the
attempt, never a 0).
"""

from __future__ import annotations

import json
from typing import Any

from producers.sandbox.base import Sandbox, SandboxSettings
from producers.tasks.grading import (
    GradeResult,
    GraderFailure,
    Judge,
    ask_judge,
    grader_invocation,
    judge_prompt,
    parse_grader_output,
    transcript_from_stdout,
)
from producers.tasks.model import Task
from schemas.events import RewardStatus


async def run_grader(task: Task, box: Sandbox, transcript: list[dict[str, Any]], timeout_s: float) -> GradeResult:
    inv = grader_invocation(task, python=box.python, grader_dir=box.grader_dir, workspace=box.workspace)
    box.write_files(box.grader_dir, inv.files)
    box.write_text(inv.transcript_path, json.dumps(transcript))
    result = await box.run(inv.argv, inv.env, box.grader_dir, timeout_s)
    if result.timed_out:
        raise GraderFailure(f"grader {task.grader.name} timed out after {timeout_s:.0f}s")
    return parse_grader_output(task, result.exit_code, result.stdout, result.stderr)


def workspace_listing(box: Sandbox, limit: int = 4000) -> str:
    root = box.host_path(box.workspace)
    parts = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            body = p.read_bytes()[:limit].decode(errors="replace")
            parts.append(f"## {p.relative_to(root)}\n{body}")
    return "\n".join(parts) or "(empty)"


async def grade(task: Task, box: Sandbox, stdout: str, settings: SandboxSettings) -> GradeResult:
    """Grade a rollout (raises :class:`GraderFailure` on a grader/judge crash)."""
    transcript = transcript_from_stdout(stdout)
    g = task.grader
    auto = None
    if g.grading_type != "llm_judge":
        auto = await run_grader(task, box, transcript, settings.grader_timeout_s)
        if g.grading_type == "automated":
            return auto
    subs = dict(auto.sub_scores) if auto else {}
    if not settings.judge_url:
        return GradeResult(RewardStatus.UNGRADED, g.name, None, subs, f"{g.grading_type} task and no judge_url")
    judge = Judge(settings.judge_url, settings.judge_model, settings.judge_api_key, settings.grader_timeout_s)
    score = await ask_judge(judge, judge_prompt(task, transcript, workspace_listing(box)))
    subs["llm_judge"] = score
    if auto is None:
        return GradeResult(RewardStatus.OK, g.name, score, subs)
    w_auto = float(task.metadata.get("weight_automated", 0.5))
    w_judge = float(task.metadata.get("weight_llm_judge", 0.5))
    reward = (w_auto * (auto.reward or 0.0) + w_judge * score) / ((w_auto + w_judge) or 1.0)
    return GradeResult(RewardStatus.OK, g.name, reward, subs)
