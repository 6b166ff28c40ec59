"""Bring your own harness: a user-written adapter file for a harness clawstream does not ship runs through
``clawstream harness check`` and into a mixed training batch, with no code change.

The harness is what a user would write: a tiny Python CLI speaking OpenAI Chat Completions (two tools, stdlib only)
and an adapter TOML naming it by path. ``harness check`` runs as the ``clawstream`` CLI (a real process: real proxy,
real sandbox worker, bubblewrap when present, the scripted engine): the same harness passes, and with
``--session-id-at-half`` (a per-rollout id in the middle of its system prompt, ~50 % of the first prompt) it fails
with exit status 1 and names the differing text. Then the worker, given the file only as a setting
(``harness_files``), runs it beside the built-in ``agentloop`` on one task (groups of two, one rollout solves and one
fails per harness) and the streams worker seals one batch holding both harnesses' groups.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawbase.kafka.clients import make_consumer
from schemas.events import BatchRecord, BatchRecordKind
from schemas.topics import BATCHES
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import by_rollout, run_requests, stack
from tests.support.scripted_engine import tool_call_text
from tests.support.stream_harness import Worker as StreamsWorker

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

AGENT = r'''#!/usr/bin/env python3
"""My coding agent: OpenAI Chat Completions, tools list_files and write_file, stdlib only."""
import argparse, json, os, urllib.request, uuid

p = argparse.ArgumentParser()
p.add_argument("--base-url", required=True)
p.add_argument("--model", required=True)
p.add_argument("--session-id-at-half", action="store_true")
p.add_argument("prompt")
a = p.parse_args()
rules = " ".join(f"Rule {i}: keep every file you touch tidy and small." for i in range(40))
system = "You are MY AGENT, a careful coding agent. " + rules
if a.session_id_at_half:
    system = "You are MY AGENT, a careful coding agent. " + rules + f" Session {uuid.uuid4()}. " + rules
tools = [
    {"type": "function", "function": {"name": "list_files", "description": "List a directory.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}}},
]
messages = [{"role": "system", "content": system}, {"role": "user", "content": a.prompt}]
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["MY_AGENT_KEY"]}
for _turn in range(8):
    body = json.dumps({"model": a.model, "messages": messages, "tools": tools}).encode()
    req = urllib.request.Request(a.base_url + "/chat/completions", data=body, headers=headers)
    msg = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["message"]
    turn = {"role": "assistant", "content": msg.get("content")}
    if msg.get("tool_calls"):
        turn["tool_calls"] = msg["tool_calls"]
    messages.append(turn)
    if not msg.get("tool_calls"):
        print(msg.get("content") or "")
        break
    for call in msg["tool_calls"]:
        args = json.loads(call["function"]["arguments"] or "{}")
        if call["function"]["name"] == "write_file":
            with open(args["path"], "w") as f:
                f.write(args["content"])
            out = "written"
        else:
            out = "\n".join(sorted(os.listdir(args.get("path") or ".")))
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": out})
'''

ADAPTER = """# My agent, run by clawstream (docs/harnesses.md#bring-your-own-harness).
name = "{name}"
description = "my coding agent (OpenAI Chat, two tools)"
dialect = "openai-chat"
install = "./my_agent.py"
command = ["${{python}}", "${{exe}}", "--base-url", "${{base_url_v1}}", "--model", "${{model}}", {extra}"${{prompt}}"]

[env]
MY_AGENT_KEY = "${{secret}}"
"""


@pytest.fixture
def user_harness(tmp_path: Path) -> dict[str, Path]:
    """The user's files: the agent and two adapter files (one of them puts a session id mid-prompt)."""
    src = tmp_path / "my-harness"
    src.mkdir()
    (src / "my_agent.py").write_text(AGENT)
    (src / "my_agent.py").chmod(0o755)
    (src / "my-agent.toml").write_text(ADAPTER.format(name="my-agent", extra=""))
    (src / "my-agent-sid.toml").write_text(ADAPTER.format(name="my-agent-sid", extra='"--session-id-at-half", '))
    return {"ok": src / "my-agent.toml", "sid": src / "my-agent-sid.toml"}


def _check(file: Path, kafka_settings, tmp_path: Path) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    env = {
        **os.environ,
        "CLAWSTREAM_HOME": str(tmp_path / "home"),
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "clawstream", "harness", "check", str(file), "--tasks", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    (tmp_path / f"{file.stem}.log").write_text(proc.stderr)  # the stack's log, for a failure's reader
    return proc


def test_harness_check_passes_a_stable_prompt_and_flags_a_session_id_mid_prompt(
    user_harness: dict[str, Path], kafka_settings, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    ok = _check(user_harness["ok"], kafka_settings, tmp_path)
    print(f"\n[check my-agent, {time.monotonic() - t0:.0f} s]\n{ok.stdout}{ok.stderr[-2000:]}")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-4000:]
    assert "harness my-agent: PASS" in ok.stdout and "OPENAI_CHAT" in ok.stdout
    assert "first prompts agree:   100.0 %" in ok.stdout and "2, 2" in ok.stdout  # two main calls per rollout

    t0 = time.monotonic()
    bad = _check(user_harness["sid"], kafka_settings, tmp_path)
    print(f"\n[check my-agent-sid, {time.monotonic() - t0:.0f} s]\n{bad.stdout}{bad.stderr[-2000:]}")
    assert bad.returncode == 1, bad.stdout + bad.stderr[-4000:]
    assert "harness my-agent-sid: FAIL" in bad.stdout and "before 90 %" in bad.stdout
    share = float(bad.stdout.split("first prompts agree:")[1].split("%")[0])
    assert 35 < share < 65, bad.stdout  # the id sits mid-prompt
    assert "Session" in bad.stdout.split("first difference:")[1].splitlines()[0], bad.stdout  # the text is named


def _sealed(kafka, timeout: float) -> list[BatchRecord]:  # noqa: ANN001
    consumer = make_consumer(kafka, f"batch-{os.urandom(4).hex()}")
    consumer.subscribe([kafka.topic(BATCHES)])
    out: list[BatchRecord] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not any(r.kind == BatchRecordKind.SEAL for r in out):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(BatchRecord.from_bytes(msg.value()))
    finally:
        consumer.close()
    return out


def mixed_responder():  # noqa: ANN201
    """Per harness, the first rollout writes hello.txt right (reward 1) and the second writes it wrong (reward 0)."""
    starts = {"my-agent": 0, "agentloop": 0}

    def respond(prompt_text: str, _ids: list[int], _body: dict) -> str:
        name = "my-agent" if "MY AGENT" in prompt_text else "agentloop"
        if "<tool_response>" in prompt_text:
            return "Done." if name == "my-agent" else tool_call_text("finish", {"summary": "ok"})
        starts[name] += 1
        return tool_call_text("write_file", {"path": "hello.txt", "content": "hi" if starts[name] == 1 else "no"})

    return respond


@pytest.mark.timeout(900)
async def test_a_user_harness_file_trains_in_a_mixed_batch_with_no_code_change(
    user_harness: dict[str, Path], kafka_settings, group_id, tmp_path: Path
) -> None:
    (tmp_path / "streams").mkdir()
    streams = StreamsWorker(
        kafka_settings,
        tmp_path / "streams",
        app_id=f"streams-{group_id}",
        store="memory://",
        group_size=2,
        batch_groups=2,
        settle_interval_s=1.0,
        commit_interval_s=0.5,
    )
    streams.start()
    harnesses = ("my-agent", "agentloop")
    reqs = [S.request("hello", h, rollout_id=f"mix-{h}-{k}", step=1) for h in harnesses for k in range(2)]
    try:
        async with stack(
            kafka_settings, group_id, tmp_path, mixed_responder(), harness_files=[str(user_harness["ok"])]
        ):
            events, rewards = await run_requests(kafka_settings, reqs, timeout=300)
        _ev, rw = by_rollout(events, rewards)
        got = {h: sorted(rw[f"mix-{h}-{k}"][0].reward for k in range(2)) for h in harnesses}
        assert all(got[h][1] == 1.0 and got[h][0] < 1.0 for h in harnesses), (got, events)
        batch = await asyncio.to_thread(_sealed, kafka_settings, 300)
        seals = [r for r in batch if r.kind == BatchRecordKind.SEAL]
        assert seals, streams.log_tail()
        assert seals[0].harness_counts == {"my-agent": 2, "agentloop": 2}, seals[0]
        records = [r for r in batch if r.kind == BatchRecordKind.TRAJECTORY]
        assert sorted((r.harness, round(r.advantage)) for r in records) == sorted(
            (h, a) for h in harnesses for a in (1, -1)
        )
    finally:
        streams.stop()
