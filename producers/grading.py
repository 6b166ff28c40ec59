"""Grading a finished rollout: run the task's grader inside the sandbox, or ask an LLM judge.

The grader files are copied into the sandbox's grader directory only now (after the harness ended), with the
task's hard-coded mount dir rewritten to the sandbox's workspace path where the task asks for it (ClawGym-Bench).
The command runs *in the sandbox* (same backend, same isolation) with cwd = the grader dir, ``WORKSPACE`` /
``CLAWGYM_WORKSPACE`` set, and ``grader_timeout_s``. Outputs:

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
from typing import Any

import aiohttp

from clawstream.errors import ClawstreamError
from producers.sandbox import Sandbox, SandboxSettings, inside
from producers.tasks import Task
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


async def run_grader(task: Task, box: Sandbox, transcript: list[dict[str, Any]], timeout_s: float) -> GradeResult:
    g = task.grader
    files = dict(g.files)
    if g.mount_dir_rewrite and g.mount_dir_rewrite != box.workspace:
        old, new = g.mount_dir_rewrite.encode(), box.workspace.encode()
        files = {k: v.replace(old, new) for k, v in files.items()}
    box.write_files(box.grader_dir, files)
    transcript_path = inside(box.grader_dir, "transcript.json")
    box.write_text(transcript_path, json.dumps(transcript))
    values = {"python": box.python, "grader_dir": box.grader_dir, "workspace": box.workspace,
              "transcript": transcript_path}  # fmt: skip
    argv = [string.Template(a).substitute(values) for a in g.argv]
    env = {"WORKSPACE": box.workspace, "CLAWGYM_WORKSPACE": box.workspace, "PYTHONDONTWRITEBYTECODE": "1"}
    result = await box.run(argv, env, box.grader_dir, timeout_s)
    if result.timed_out:
        raise GraderFailure(f"grader {g.name} timed out after {timeout_s:.0f}s")
    if result.exit_code != 0:
        raise GraderFailure(f"grader {g.name} exited {result.exit_code}: {result.stderr[-500:]}")
    parse = parse_subscores if g.output == "subscores_json" else parse_reward_float
    reward, subs = parse(result.stdout)
    return GradeResult(RewardStatus.OK, g.name, reward, subs)


def judge_prompt(task: Task, transcript: list[dict[str, Any]], workspace_listing: str) -> str:
    return (
        "You grade an AI agent's work. Reply with a JSON object {\"score\": x} with x in [0, 1] and nothing else.\n\n"
        f"# Task\n{task.prompt}\n\n# Rubric\n{task.grader.judge_rubric}\n\n"
        f"# Workspace after the run\n{workspace_listing[:20000]}\n\n# Transcript\n{json.dumps(transcript)[-20000:]}"
    )


def workspace_listing(box: Sandbox, limit: int = 4000) -> str:
    root = box.host_path(box.workspace)
    parts = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            body = p.read_bytes()[:limit].decode(errors="replace")
            parts.append(f"## {p.relative_to(root)}\n{body}")
    return "\n".join(parts) or "(empty)"


async def ask_judge(settings: SandboxSettings, prompt: str) -> float:
    assert settings.judge_url
    url = settings.judge_url.rstrip("/") + "/chat/completions"
    body = {"model": settings.judge_model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    headers = {"Authorization": f"Bearer {settings.judge_api_key}"} if settings.judge_api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=settings.grader_timeout_s)) as http:
            async with http.post(url, json=body, headers=headers) as resp:
                if resp.status >= 400:
                    raise GraderFailure(f"judge answered {resp.status}: {(await resp.text())[:300]}")
                text = (await resp.json())["choices"][0]["message"]["content"] or ""
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, ValueError) as exc:
        raise GraderFailure(f"judge at {settings.judge_url} failed: {exc!r}") from exc
    start, end = text.find("{"), text.rfind("}")
    found = _dict_line(text[start : end + 1]) if start >= 0 else None
    if not found or "score" not in found:
        raise GraderFailure(f"judge gave no {{'score': x}}: {text[:200]!r}")
    return _score(found["score"], "judge score")


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
    score = await ask_judge(settings, judge_prompt(task, transcript, workspace_listing(box)))
    subs["llm_judge"] = score
    if auto is None:
        return GradeResult(RewardStatus.OK, g.name, score, subs)
    w_auto = float(task.metadata.get("weight_automated", 0.5))
    w_judge = float(task.metadata.get("weight_llm_judge", 0.5))
    reward = (w_auto * (auto.reward or 0.0) + w_judge * score) / ((w_auto + w_judge) or 1.0)
    return GradeResult(RewardStatus.OK, g.name, reward, subs)
