"""One agent-loop episode without serving, Kafka or sandbox: the real built-in loop against an in-process proxy.

Both the demonstrations (``warmstart.demos``) and the offline evaluation (``warmstart.evaluate``)
run the *real* agent loop (``producers.harnesses.builtin_loop.run_openai`` / ``run_anthropic``) through
:func:`run_episode`. The loop talks to :class:`InProcessProxy`, handed to it as its transport (``post=``): every
request body the loop builds is parsed with ``producers.proxy.dialects``, rendered with
``producers.proxy.render.RolloutRenderer`` (TITO, exactly as the proxy does), answered by a *policy* (a callable
``prompt ids -> generated ids``), parsed back with ``producers.proxy.tool_parse`` and returned in the dialect's JSON
(``producers.proxy.emit``). The loop's tools run against a temporary copy of the task's workspace, and the task's own
grader scores it through the one set of grading rules (``producers.tasks.grading_rules``).

Topics: none (offline). Not run on its own: ``python -m warmstart.sft`` (training, or ``--eval-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producers.harnesses import builtin_loop as agentloop
from producers.proxy import emit
from producers.proxy.conversation import Message, ToolCall
from producers.proxy.dialects import PARSERS
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from producers.proxy.tool_parse import parse_turn
from producers.tasks.grading_rules import GraderFailure, grader_invocation, parse_grader_output
from producers.tasks.model import Task
from schemas.events import Dialect

DIALECTS = ("openai", "anthropic")
_WIRE = {"openai": Dialect.OPENAI_CHAT, "anthropic": Dialect.ANTHROPIC_MESSAGES}

Policy = Callable[[list[int]], list[int]]  # prompt ids -> generated ids (ending with eos when it stopped)


class InProcessProxy:
    """The serving proxy without HTTP/Kafka: dialect parse -> TITO render -> policy -> parse_turn -> dialect JSON.

    Mirrors ``producers.proxy.app.Proxy._call`` (same renderer calls, same answer message, same emit functions).
    :meth:`post` has the agent loop's transport signature (``builtin_loop.Post``).
    """

    def __init__(self, renderer: TemplateRenderer, dialect: str, policy: Policy) -> None:
        self.r = renderer
        self.dialect = _WIRE[dialect]
        self.policy = policy
        self.rollout = RolloutRenderer(renderer)
        self.turns: list[tuple[list[int], list[int]]] = []  # (prompt ids, generated ids) per call

    def post(self, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
        # Through JSON like the real wire, so nothing of the loop's Python objects leaks into the conversation.
        body = json.loads(json.dumps(body))
        parsed = PARSERS[self.dialect](body)
        rendered = self.rollout.render(parsed.conversation)
        gen = list(self.policy(rendered.prompt_ids))
        turn = parse_turn(self.r.decode(gen))
        seq = len(self.turns)
        emitter = emit.EMITTERS[self.dialect]
        ids = [f"{emitter.tool_call_prefix}{seq:012d}{i:012d}" for i in range(len(turn.tool_calls))]
        calls = tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, turn.tool_calls, strict=True))
        self.rollout.record(f"call{seq}", seq, rendered, gen, Message("assistant", turn.text, turn.reasoning, calls))
        self.turns.append((rendered.prompt_ids, gen))
        finish = "stop" if gen and gen[-1] == self.r.end_of_turn_id else "length"
        answer = emit.Answer(turn, finish, len(rendered.prompt_ids), len(gen), parsed.model, f"r{seq}", 0, ids)
        return emitter.body(answer)


@dataclass
class EpisodeResult:
    task_id: str
    dialect: str
    why: str  # how the loop ended: finished | answered without a tool call | max turns
    turns: list[tuple[list[int], list[int]]]
    reward: float | None = None
    sub_scores: dict[str, float] = field(default_factory=dict)


def grade_workspace(task: Task, workspace: Path, timeout_s: float = 60.0) -> tuple[float, dict[str, float]]:
    """(reward, sub-scores) of the task's grader run as a local subprocess in a temporary grader directory.

    Invocation and output parsing come from ``producers.tasks.grading_rules``, the same rules the sandbox's grading
    uses; raises :class:`GraderFailure` when the grader crashes, times out or reports nothing usable.
    """
    with tempfile.TemporaryDirectory(prefix="sft-grader-") as gdir:
        inv = grader_invocation(task, python=sys.executable, grader_dir=gdir, workspace=str(workspace))
        for rel, data in inv.files.items():
            path = Path(gdir, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        Path(inv.transcript_path).write_text(json.dumps([]))  # no harness transcript offline: an empty one
        # This process's environment underneath (PATH, the venv's Python): the grader is our own trusted code here,
        # not a sandboxed rollout, so no scrubbing.
        env = {**os.environ, **inv.env}
        try:
            proc = subprocess.run(inv.argv, cwd=gdir, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise GraderFailure(f"grader {task.grader.name} timed out after {timeout_s:g}s") from exc
    result = parse_grader_output(task, proc.returncode, proc.stdout, proc.stderr)
    if result.reward is None:  # parse_grader_output never returns an ungraded result; keeps the type honest
        raise GraderFailure(f"grader {task.grader.name} reported no reward")
    return result.reward, result.sub_scores


def run_episode(
    task: Task,
    dialect: str,
    policy: Policy,
    renderer: TemplateRenderer,
    *,
    max_turns: int = 8,
    grade: bool = True,
) -> EpisodeResult:
    """One agent-loop episode on a fresh copy of the task's workspace; graded with the task's grader."""
    proxy = InProcessProxy(renderer, dialect, policy)
    with tempfile.TemporaryDirectory(prefix="sft-ws-") as ws:
        root = Path(ws)
        for rel, data in task.files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        args = argparse.Namespace(
            prompt=task.prompt,
            base_url="http://in-process",
            model="policy",
            max_turns=max_turns,
            max_tokens=1024,
            http_timeout=60.0,
        )
        loop = agentloop.run_openai if dialect == "openai" else agentloop.run_anthropic
        why = loop(args, agentloop.Tools(root, run_timeout=10.0), "", post=proxy.post)
        result = EpisodeResult(task.task_id, dialect, why, proxy.turns)
        if grade:
            result.reward, result.sub_scores = grade_workspace(task, root)
    return result
