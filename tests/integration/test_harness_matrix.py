"""Every harness adapter through the real sandbox worker on real benchmark tasks: Claude Code, Codex, Qwen Code,
OpenClaw (Node 24), opencode, Cline, mini-swe-agent (PyPI) and the built-in loop in both variants (Gemini CLI: the
same case in ``test_gemini_cli.py``).

Per harness one stack — real Kafka broker, real serving proxy, the scripted engine as the model, one sandbox worker
with local sandboxes — runs two rollouts at once: the ClawGym-Bench task ``task_0085`` (verbatim,
``tests/fixtures/clawgym``) and PinchBench's ``task_00_sanity`` (``tests/fixtures/pinchbench``). The scripted policy
answers with the harness's *own* write tool (:data:`WRITE`): it finds the sandbox's workspace in the harness's prompt
(every real harness names its working directory there), writes the two files of the task's solution
(``tests/fixtures/clawgym_solutions/task_0085``) one tool call per turn, then ends with a plain answer; to the
PinchBench prompt it answers "Hello, I'm ready!" at once (a harness that ends on a tool call, mini-swe-agent, gets
that call after the answer: :data:`FINISH`). Title-style calls (no tools) get a title.

Asserts per rollout: STARTED → HARNESS_EXITED with exit code 0, a graded reward — 1.0 with every ``check.py``
sub-score 1.0 for the solved ClawGym task (``reward.sh`` run as published), 1.0 for the sanity check (its check
reads the OpenClaw session transcript) — and a clean sandbox root (no directory, no process); per harness: only the
expected main-agent calls (no extra calls of the harness's own), no call event ``tampered`` (every harness echoes the
answers, a reasoning block and a line of text before each write call, as the proxy's own), and graders that read,
for every harness, the session transcript built from the conversation the proxy saw, with the harness's write calls
in it (never what the harness wrote); OpenClaw's own session export (SQLite, Zstandard) is still checked to decode.

A real harness is installed from the npm registry (mini-swe-agent: PyPI, into its own venv) on first use
(``producers.harnesses.install``, cached under ``$CLAWSTREAM_HOME``; OpenClaw with Node 24 from the registry too);
when npm or the package is unavailable the test SKIPS with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
import uuid
from typing import Any

import pytest

from producers.sandbox import run_grader as grade_module
from producers.sandbox.run_grader import run_transcript
from producers.tasks.transcript import find_openclaw_session, parse_session_jsonl
from schemas.events import RewardStatus, RolloutState
from tests.support import sandbox_helpers as S
from tests.support.harness_tasks import (
    CLAWGYM_PHRASE,
    FILES,
    FINAL,
    FINISH,
    HARNESSES,
    RELATIVE,
    SOLUTION,
    WRITE,
    final_answer,
    installed,
    solution_files,
    workspace_pattern,
)
from tests.support.proxy_server import consume_calls
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack
from tests.support.scripted_engine import tool_call_text

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide

# OpenClaw's final answer to the ClawGym task quotes the checklist six times (2.3 KB): OpenClaw then stores that
# transcript record Zstandard-compressed, and the session export must decode it.
LONG_FINAL = "Done. output/nimbus_checklist.md reads:\n\n" + 6 * (SOLUTION / FILES[0]).read_text()


def responder(name: str, sandboxes: str, seen: list[str]):
    ws_re = workspace_pattern(sandboxes)
    solution = solution_files()

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # title / side call
            seen.append("side")
            return '{"title": "Nimbus checklist"}'
        conversation = prompt_text.partition("<|im_start|>user")[2]
        if CLAWGYM_PHRASE not in conversation:
            seen.append("pinch")
            return final_answer(name, FINAL["pinch"])
        done = conversation.count("<tool_response>")
        seen.append(f"clawgym:{done}")
        if done >= len(solution):
            return LONG_FINAL if name == "openclaw" else final_answer(name, FINAL["clawgym"])
        found = ws_re.search(prompt_text)
        if found is None and name not in RELATIVE:
            seen.append("no workspace in the prompt")
            return f"{name}: the harness prompt names no sandbox workspace"  # fails the reward, shown in `seen`
        tool, args = WRITE[name](found.group(0) if found else "", *solution[done])
        thought = f"<think>Next: {solution[done][0]}.</think>\nWriting {solution[done][0]}.\n"
        return thought + tool_call_text(tool, args)

    return respond


# Gemini CLI's case is tests/integration/test_gemini_cli.py: this same stack and responder on the same two tasks, plus
# its prefix trees; it is not run twice.
OWN_TEST = {"gemini-cli"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in HARNESSES if n not in OWN_TEST])
async def test_harness_solves_clawgym_and_pinchbench(kafka_settings, group_id, tmp_path, monkeypatch, name) -> None:
    await asyncio.to_thread(installed, name)
    transcripts: dict[str, list[dict[str, Any]]] = {}  # task id → the transcript its grader read
    compressed: dict[str, int] = {}  # OpenClaw: task id → Zstandard-compressed records in its transcript store
    exported: dict[str, list[dict[str, Any]]] = {}  # OpenClaw: task id → its own session export (not graded)

    def recording(task, box, stdout, **kw):  # noqa: ANN001, ANN202
        transcripts[task.task_id] = out = run_transcript(task, box, stdout, **kw)
        if kw.get("session_dir"):
            own = find_openclaw_session(box.host_path(box.home), kw["session_dir"])
            if own is not None:
                exported[task.task_id] = parse_session_jsonl(own.read_text(encoding="utf-8"))
        for db in box.host_path(box.home).glob(".openclaw/agents/*/agent/openclaw-agent.sqlite"):
            with contextlib.closing(sqlite3.connect(db)) as con:
                compressed[task.task_id] = con.execute(
                    "SELECT count(*) FROM transcript_events WHERE event_zstd IS NOT NULL"
                ).fetchone()[0]
        return out

    monkeypatch.setattr(grade_module, "run_transcript", recording)
    sandboxes = tmp_path / "sandboxes"
    suites = {"clawgym": str(S.FIXTURES / "clawgym"), "pinch": str(S.FIXTURES / "pinchbench")}
    seen: list[str] = []
    reqs = [
        S.request("task_0085", name, suite="clawgym", rollout_id=f"clawgym-{name}", timeout_s=300),
        S.request("task_00_sanity", name, suite="pinch", rollout_id=f"pinch-{name}", timeout_s=120),
    ]
    t0 = time.monotonic()
    async with stack(
        kafka_settings, group_id, tmp_path, responder(name, str(sandboxes), seen), suites=suites, concurrency=2
    ) as st:
        events, rewards = await run_requests(kafka_settings, reqs, timeout=420)
        served = len(st["engine"].requests)
    rollout_ids = {r.rollout_id for r in reqs}
    tampered = [(e.rollout_id, e.seq) for e in consume_calls(kafka_settings, rollout_ids, served) if e.tampered]
    wall = time.monotonic() - t0
    ev, rw = by_rollout(events, rewards)
    log = f"{name}: {wall:.0f}s, {served} engine calls {seen}; events {ev}; rewards {rw}"
    for req in reqs:
        states = [e.state for e in ev.get(req.rollout_id, [])]
        assert states == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], log
        exited = ev[req.rollout_id][-1]
        assert exited.exit_code == 0 and exited.calls_served >= 1, log
        (reward,) = rw[req.rollout_id]
        assert reward.status == RewardStatus.OK and reward.reward == 1.0, log
    clawgym = rw[reqs[0].rollout_id][0]
    assert clawgym.grader == "clawgym_reward_sh" and len(clawgym.sub_scores) == 12, log
    assert set(clawgym.sub_scores.values()) == {1.0}, log
    # Main-agent calls only: one per file and a final answer, one answer to the sanity prompt (side calls aside, no
    # harness makes calls of its own, e.g. Qwen Code's memory-extraction subagent, which its adapter turns off).
    assert sum(s != "side" for s in seen) == len(FILES) + 2, log
    assert rw[reqs[1].rollout_id][0].sub_scores == {"agent_responded": 1.0}, log
    # Both graders read a transcript in OpenClaw's session format built from the conversation the proxy saw (a fixed
    # id), OpenClaw's included: what the harness wrote is not what it is graded on (#29).
    assert set(transcripts) == {"task_0085", "task_00_sanity"}, log
    built_id = str(uuid.UUID(int=0))
    for transcript in transcripts.values():
        assert transcript[0]["type"] == "session" and transcript[0]["id"] == built_id, log
    calls = [
        c
        for r in transcripts["task_0085"]
        if r.get("type") == "message"
        for c in r["message"]["content"]
        if isinstance(c, dict) and c.get("type") == "toolCall"
    ]
    finish = [FINISH[name][0]] if name in FINISH else []
    assert [c["name"] for c in calls] == [WRITE[name]("", "", "")[0]] * len(FILES) + finish, (calls, log)
    if name == "openclaw":  # its long final answer was stored compressed, and its own export decoded it
        assert compressed.get("task_0085", 0) >= 1, (compressed, log)
        assert exported["task_0085"][0]["id"] != built_id, log
        assert exported["task_0085"][-1]["message"]["content"][0]["text"] == LONG_FINAL.strip(), log
        assert LONG_FINAL.strip() in transcripts["task_0085"][-1]["message"]["content"][0]["text"], log
    assert not tampered, (tampered, log)  # the harness's rewritten history holds only the proxy's own turns
    assert_clean(sandboxes)
    print(json.dumps({"harness": name, "wall_s": round(wall, 1), "engine_calls": served, "calls": seen}))
