"""Grading rules, pure: how a task's grader is invoked and how its output becomes a reward; the LLM-judge call.

This is the one place that knows a grader's contract; ``producers.sandbox.grade`` runs it inside a rollout's
sandbox and the warm start (``learner.warmstart``) runs it in a temporary directory, both through
:func:`grader_invocation` and :func:`parse_grader_output`. The grader files are laid out in a grader directory,
with the task's hard-coded mount dir rewritten to the workspace path where the task asks for it (ClawGym-Bench);
the command runs with cwd = the grader dir and ``WORKSPACE`` / ``CLAWGYM_WORKSPACE`` set. Outputs:

* ``subscores_json``: the last stdout line that is a JSON object → sub-scores; reward = their mean.
* ``reward_float``: the last stdout line that is a number → reward; any dict line (JSON or Python literal, as
  ClawGym's ``check.py`` prints) → sub-scores.

Every score must lie in [0, 1]. A grader that exits non-zero, times out, prints nothing usable or out-of-range
values raises :class:`GraderFailure` — the attempt is then an infrastructure failure, never a 0.
LLM judge (PinchBench ``llm_judge`` / ``hybrid``): an OpenAI-compatible chat call (``judge_url``) asked for
``{"score": x}``; without a judge URL such tasks are UNGRADED (hybrid keeps the automated sub-scores for reference).
"""

from __future__ import annotations

import ast
import json
import math
import string
from dataclasses import dataclass, field
from posixpath import join as inside
from typing import Any

import aiohttp

from clawstream.errors import ClawstreamError
from producers.tasks.model import Task
from schemas.events import RewardStatus


class GraderFailure(ClawstreamError):
    """The grader crashed, timed out or printed nothing usable (infrastructure failure of the attempt)."""


@dataclass
class GradeResult:
    status: RewardStatus
    grader: str
    reward: float | None
    sub_scores: dict[str, float] = field(default_factory=dict)
    reason: str | None = None


def _score(value: Any, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError) as exc:
        raise GraderFailure(f"{what} is not a number: {value!r}") from exc
    if math.isnan(x) or not 0.0 <= x <= 1.0:
        raise GraderFailure(f"{what} = {x} is outside [0, 1]")
    return x


def _dict_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not (line.startswith("{") and line.endswith("}")):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, dict):
            return value
    return None


def parse_subscores(stdout: str) -> tuple[float, dict[str, float]]:
    for line in reversed(stdout.strip().splitlines()):
        found = _dict_line(line)
        if found is not None:
            if not found:
                raise GraderFailure("the grader printed an empty dict of sub-scores")
            scores = {str(k): _score(v, f"sub-score {k!r}") for k, v in found.items()}
            return sum(scores.values()) / len(scores), scores
    raise GraderFailure(f"no JSON dict of sub-scores in the grader's output: {stdout[-300:]!r}")


def parse_reward_float(stdout: str) -> tuple[float, dict[str, float]]:
    lines = stdout.strip().splitlines()
    reward = None
    for line in reversed(lines):
        try:
            reward = _score(float(line.strip()), "reward")
            break
        except ValueError:
            continue
    if reward is None:
        raise GraderFailure(f"no reward number in the grader's output: {stdout[-300:]!r}")
    subs: dict[str, float] = {}
    for line in lines:
        found = _dict_line(line)
        if found:
            subs.update({str(k): float(v) for k, v in found.items() if isinstance(v, int | float)})
    return reward, subs


def transcript_from_stdout(stdout: str) -> list[dict[str, Any]]:
    """The harness's machine-readable output as a list of dicts (JSON lines, or one JSON document)."""
    try:
        whole = json.loads(stdout)
        return [x for x in whole if isinstance(x, dict)] if isinstance(whole, list) else [whole]
    except ValueError:
        pass
    out = []
    for line in stdout.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


@dataclass(frozen=True)
class GraderInvocation:
    """What to lay out and run for one grading: files for the grader dir, the command line, its environment."""

    files: dict[str, bytes]
    argv: list[str]
    env: dict[str, str]
    transcript_path: str


def grader_invocation(task: Task, *, python: str, grader_dir: str, workspace: str) -> GraderInvocation:
    """The grader's files (mount dir rewritten to ``workspace``), argv and env, for paths as the grader sees them."""
    g = task.grader
    files = dict(g.files)
    if g.mount_dir_rewrite and g.mount_dir_rewrite != workspace:
        old, new = g.mount_dir_rewrite.encode(), workspace.encode()
        files = {k: v.replace(old, new) for k, v in files.items()}
    transcript_path = inside(grader_dir, "transcript.json")
    values = {"python": python, "grader_dir": grader_dir, "workspace": workspace, "transcript": transcript_path}
    argv = [string.Template(a).substitute(values) for a in g.argv]
    env = {"WORKSPACE": workspace, "CLAWGYM_WORKSPACE": workspace, "PYTHONDONTWRITEBYTECODE": "1"}
    return GraderInvocation(files, argv, env, transcript_path)


def parse_grader_output(task: Task, exit_code: int, stdout: str, stderr: str) -> GradeResult:
    """The grade a finished grader process reports (raises :class:`GraderFailure` when it reports none)."""
    g = task.grader
    if exit_code != 0:
        raise GraderFailure(f"grader {g.name} exited {exit_code}: {stderr[-500:]}")
    parse = parse_subscores if g.output == "subscores_json" else parse_reward_float
    reward, subs = parse(stdout)
    return GradeResult(RewardStatus.OK, g.name, reward, subs)


def judge_prompt(task: Task, transcript: list[dict[str, Any]], workspace_listing: str) -> str:
    return (
        "You grade an AI agent's work. Reply with a JSON object {\"score\": x} with x in [0, 1] and nothing else.\n\n"
        f"# Task\n{task.prompt}\n\n# Rubric\n{task.grader.judge_rubric}\n\n"
        f"# Workspace after the run\n{workspace_listing[:20000]}\n\n# Transcript\n{json.dumps(transcript)[-20000:]}"
    )


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible chat endpoint asked for ``{"score": x}``."""

    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0


async def ask_judge(judge: Judge, prompt: str) -> float:
    url = judge.url.rstrip("/") + "/chat/completions"
    body = {"model": judge.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    headers = {"Authorization": f"Bearer {judge.api_key}"} if judge.api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=judge.timeout_s)) as http:
            async with http.post(url, json=body, headers=headers) as resp:
                if resp.status >= 400:
                    raise GraderFailure(f"judge answered {resp.status}: {(await resp.text())[:300]}")
                text = (await resp.json())["choices"][0]["message"]["content"] or ""
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise GraderFailure(f"judge at {judge.url} failed: {exc!r}") from exc
    start, end = text.find("{"), text.rfind("}")
    found = _dict_line(text[start : end + 1]) if start >= 0 else None
    if not found or "score" not in found:
        raise GraderFailure(f"judge gave no {{'score': x}}: {text[:200]!r}")
    return _score(found["score"], "judge score")
