"""Grading rules, pure: how a task's grader is invoked and how its output becomes a reward; the LLM-judge call.

This is the one place that knows a grader's contract; ``producers.sandbox.run_grader`` runs it inside a rollout's
sandbox (a fresh one for ``clawstream tasks grade``), through :func:`grader_invocation` and
:func:`parse_grader_output`. The grader files go to a grader directory outside the workspace, the task's hard-coded
mount dir rewritten to the workspace path where the task asks for it. The command runs out of the rollout's reach:
HOME and cwd an empty directory of the grader dir (cwd the workspace for ClawGym-Bench, as its harness runs it),
every Python isolated (``-I``, added for shell graders by a ``python3`` shim first on PATH; ``PYTHONSAFEPATH=1``),
``WORKSPACE`` / ``CLAWGYM_WORKSPACE`` set. Outputs: ``subscores_json``: the last stdout line that is a JSON object →
sub-scores, reward = their mean; ``reward_float``: the last stdout line that is a number → reward, any dict line
(JSON or Python literal) → sub-scores.

ClawGym-Bench, as its own harness grades (``Grader.workspace_folder`` / ``subscores_script`` / ``reward_payload``):
the files go to ``<workspace>/reward/`` (cleared first: nothing the agent put there survives), the run payload
``{final_message, metadata, transcript}`` to ``<workspace>/.openclaw_reward_payload.json`` ($OPENCLAW_REWARD_PAYLOAD),
``bash <workspace>/reward/reward.sh`` prints the reward; ``check.py``'s sub-scores, which ``reward.sh`` pipes into
its averaging one-liner, are captured by the shim (:data:`PYTHON_SHIM`), which tees that script's stdout; reward
folder and payload are removed after grading.

Every score must lie in [0, 1]. A grader that exits non-zero, times out, prints nothing usable or out-of-range
values is a :class:`GraderFailure` (the runner's :class:`GraderRunFailure`: a graded 0 flagged
``grader_error_by_rollout`` when the grader grades the task's untouched workspace, else an infrastructure failure).
LLM judge (PinchBench ``llm_judge`` / ``hybrid``): an OpenAI-compatible chat call (``judge_url``) read as the
benchmark reads the reply (:func:`judge_score`); without a judge URL such tasks are UNGRADED.
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

from clawbase.errors import ClawstreamError
from producers.tasks import pinchbench
from producers.tasks.model import Task
from schemas.events import RewardStatus


class GraderFailure(ClawstreamError):
    """The grader or the judge crashed, timed out or gave nothing usable."""


class GraderRunFailure(GraderFailure):
    """The grader failed on a rollout's workspace (exit, timeout, output unusable or not a regular file): the
    rollout's doing when the grader grades the task's untouched workspace, the infrastructure's otherwise."""


@dataclass
class GradeResult:
    status: RewardStatus
    grader: str
    reward: float | None
    sub_scores: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    by_rollout: bool = False  # a graded 0: the grader failed on what the rollout left


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
    """The harness's machine-readable output as a list of dicts (JSON lines, or one JSON document). Harness-written:
    graders get it only when the proxy reported no conversation (``producers.sandbox.run_grader.run_transcript``)."""
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
    """What to lay out and run for one grading, as paths inside the sandbox.

    ``files`` go under ``files_dir`` (the grader dir, or a folder inside the workspace); ``support_files`` under the
    grader dir; the command ``argv`` runs in ``cwd`` (an empty directory, created by the runner) with ``env`` and
    ``extra_path`` in front of PATH.
    ``workspace_entries`` (names relative to the workspace) are what grading puts into the workspace: cleared before
    (so nothing the agent left under those names survives) and removed after. ``capture_path`` is where the
    sub-scores script's own stdout is kept, ``payload_path`` where the run payload goes (both None when unused).
    """

    files: dict[str, bytes]
    argv: list[str]
    env: dict[str, str]
    transcript_path: str
    files_dir: str = ""
    cwd: str = ""
    support_files: dict[str, bytes] = field(default_factory=dict)
    extra_path: str = ""
    workspace_entries: tuple[str, ...] = ()
    capture_path: str | None = None
    payload_path: str | None = None


# Stands in for python3 (and python) first on a grader's PATH: it runs the real one (the next on PATH) isolated
# (-I: no script dir, cwd, PYTHON* variable or user site-packages on sys.path), whatever a shell grader calls. When
# the script is the sub-scores script (ClawGym-Bench's reward.sh: `python3 …/reward/check.py … | python3 -c
# '<mean>'`), it also appends that script's stdout to a capture file.
PYTHON_SHIM = """#!/usr/bin/env bash
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
IFS=: read -r -a dirs <<< "$PATH"
rest=""
for d in "${dirs[@]}"; do [ "$d" = "$here" ] || rest="${rest:+$rest:}$d"; done
export PATH="$rest"
py="$(basename "$0")"
if [ -n "${CLAWSTREAM_SUBSCORES_SCRIPT:-}" ] && [ "${1:-}" = "$CLAWSTREAM_SUBSCORES_SCRIPT" ]; then
  set -o pipefail
  "$py" -I "$@" | tee -a "$CLAWSTREAM_SUBSCORES_OUT"
  exit $?
fi
exec "$py" -I "$@"
"""
SHIMS = ("bin/python3", "bin/python")


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
    if g.argv[:1] == ("${python}",):
        # Isolated: neither the workspace (a planted json.py), PYTHON* variables nor HOME's user site-packages
        # (a planted .pth or usercustomize.py) reach the grader's Python; the shims do the same for shell graders.
        argv[1:1] = ["-I"]
    # cwd and HOME: an empty directory (nothing the rollout wrote is read from where a grader starts, no dotfile of
    # the rollout's HOME configures a tool it runs); created by the runner.
    empty = inside(grader_dir, "cwd")
    env = {
        "WORKSPACE": workspace,
        "CLAWGYM_WORKSPACE": workspace,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONSAFEPATH": "1",
        "PYTHONNOUSERSITE": "1",
        "HOME": empty,
    }
    support = {rel: PYTHON_SHIM.encode() for rel in SHIMS}
    extra_path = inside(grader_dir, "bin")
    if not g.workspace_folder:
        return GraderInvocation(files, argv, env, transcript_path, grader_dir, empty, support, extra_path)
    entries = [g.workspace_folder]
    capture_path, payload_path = None, None
    if g.subscores_script:
        capture_path = inside(grader_dir, "subscores.out")
        env["CLAWSTREAM_SUBSCORES_SCRIPT"] = inside(workspace, g.workspace_folder, g.subscores_script)
        env["CLAWSTREAM_SUBSCORES_OUT"] = capture_path
    if g.reward_payload:
        entries.append(g.reward_payload)
        payload_path = inside(workspace, g.reward_payload)
        env["OPENCLAW_REWARD_PAYLOAD"] = payload_path
    return GraderInvocation(
        files,
        argv,
        env,
        transcript_path,
        files_dir=inside(workspace, g.workspace_folder),
        cwd=workspace,  # as the benchmark runs reward.sh (check.py may read relative paths); -I keeps it off sys.path
        support_files=support,
        extra_path=extra_path,
        workspace_entries=tuple(entries),
        capture_path=capture_path,
        payload_path=payload_path,
    )


def final_message(transcript: list[dict[str, Any]]) -> str:
    """The agent's last answer in a transcript: a ``result`` record (Claude Code, Qwen Code, and the stream records
    built from the proxy's conversation, whose ``result`` is the model's last answer) or the last assistant
    message's text (OpenClaw session lines, OpenAI/Anthropic-shaped messages); "" when none is found."""
    for record in reversed(transcript):
        if isinstance(record.get("result"), str):
            return record["result"]
        msg = record.get("message") if isinstance(record.get("message"), dict) else record
        if msg.get("role") != "assistant":
            continue
        content = msg.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):
            text = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
            if text:
                return text
    return ""


def reward_payload(task: Task, transcript: list[dict[str, Any]]) -> bytes:
    """The run payload ClawGym-Bench's harness hands ``reward.sh`` (``{final_message, metadata, transcript}``); both
    read from ``transcript``, the one the proxy recorded whenever it reported one (``run_transcript``)."""
    try:
        metadata = json.loads(task.metadata.get("metadata", "{}"))
    except ValueError:
        metadata = {}
    body = {"final_message": final_message(transcript), "metadata": metadata, "transcript": transcript}
    return json.dumps(body).encode()


def parse_captured_subscores(text: str) -> dict[str, float]:
    """Sub-scores from what a sub-scores script printed: the last JSON object in it (one line or indented over
    several); numbers and booleans become floats, other values (notes, lists) are left out."""
    decoder = json.JSONDecoder()
    found: dict[str, Any] | None = None
    for i, ch in enumerate(text):
        if ch != "{" or (i and text[i - 1] not in "\n"):
            continue
        try:
            value, _ = decoder.raw_decode(text, i)
        except ValueError:
            continue
        if isinstance(value, dict):
            found = value
    if found is None:  # a Python literal (print(dict)) on one line
        found = next((d for d in map(_dict_line, reversed(text.splitlines())) if d is not None), None)
    if found is None:
        return {}
    return {str(k): float(v) for k, v in found.items() if isinstance(v, int | float) and not math.isnan(float(v))}


def parse_grader_output(
    task: Task, exit_code: int | None, stdout: str, stderr: str, *, captured: str | None = None
) -> GradeResult:
    """The grade a finished grader process reports (raises :class:`GraderFailure` when it reports none).
    ``captured``: what the sub-scores script printed (when the grader has one); its dict gives the sub-scores."""
    g = task.grader
    if exit_code != 0:
        raise GraderFailure(f"grader {g.name} exited {exit_code}: {stderr[-500:]}")
    parse = parse_subscores if g.output == "subscores_json" else parse_reward_float
    reward, subs = parse(stdout)
    if captured:
        subs = parse_captured_subscores(captured) or subs
    return GradeResult(RewardStatus.OK, g.name, reward, subs)


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible chat endpoint (any server: a hosted model, a local vLLM, this project's engine)."""

    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0


async def ask_judge(judge: Judge, prompt: str) -> str:
    """The judge's reply to ``prompt`` (one user message, temperature 0); :class:`GraderFailure` when it gives none."""
    url = judge.url.rstrip("/") + "/chat/completions"
    body = {"model": judge.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0}
    headers = {"Authorization": f"Bearer {judge.api_key}"} if judge.api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=judge.timeout_s)) as http:
            async with http.post(url, json=body, headers=headers) as resp:
                if resp.status >= 400:
                    raise GraderFailure(f"judge answered {resp.status}: {(await resp.text())[:300]}")
                return str((await resp.json())["choices"][0]["message"]["content"] or "")
    except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise GraderFailure(f"judge at {judge.url} failed: {exc!r}") from exc


async def judge_score(judge: Judge, task: Task, transcript: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """The judge's score of a run and its per-criterion scores, asked and read as PinchBench asks and reads them
    (``producers.tasks.pinchbench``); a reply without a score in [0, 1] is a :class:`GraderFailure`."""
    reply = await ask_judge(judge, pinchbench.judge_prompt(task, transcript))
    total, scores, _notes = pinchbench.parse_judge_reply(reply)
    if total is None:
        raise GraderFailure(f"the judge gave no score: {reply[:300]!r}")
    return _score(total, "judge total"), scores
