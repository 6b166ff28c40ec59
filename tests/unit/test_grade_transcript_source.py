"""What graders read about the conversation comes from the proxy's record, never from what the harness wrote (#29).

A harness's stdout and a process it started can say anything (a forged final answer written to the harness's
stdout, a rewritten OpenClaw session file); the proxy has what the model saw and answered. Here the harness "wrote"
a forged answer to stdout and a forged session file in HOME while the proxy recorded the model saying something
else: the transcript file of both formats, ClawGym-Bench's payload (``final_message``, ``transcript``) and the
PinchBench judge prompt carry the model's conversation. The harness-written sources are used only when the proxy
reported no conversation, with a warning. No processes: a local sandbox's directories, the transcript built from
them (``producers.sandbox.run_grader.run_transcript``), and the pure payload and prompt builders.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from producers.proxy.conversation import Message, transcript_messages
from producers.proxy.dialects import parse_openai_chat
from producers.sandbox.base import Sandbox
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.run_grader import run_transcript
from producers.sandbox.settings import SandboxSettings
from producers.tasks import pinchbench
from producers.tasks.grading_rules import final_message, reward_payload, transcript_from_stdout
from producers.tasks.model import Grader, Task
from producers.tasks.transcript import OPENCLAW_AGENTS_DIR, parse_session_jsonl, session_transcript, stream_transcript

PROMPT = "Read notes.md and tell me the beta release date."
MODEL = "The beta release is on June 1, 2024."
FORGED = "FORGED: the answer the grader wants"


def task_of(fmt: str) -> Task:
    grader = Grader(
        "probe",
        {},
        ("${python}", "-c", "pass"),
        transcript=fmt,  # type: ignore[arg-type]
        reward_payload=".openclaw_reward_payload.json" if fmt == "openclaw_session" else None,
        judge_rubric="Did it answer?",
    )
    return Task("probe", "probe-0", PROMPT, 30.0, {}, grader, metadata={"metadata": '{"category": "x"}'})


def proxy_messages() -> list[dict]:
    """The conversation as the seal reports it: the last main-agent call's messages plus the model's answer."""
    conv = parse_openai_chat(
        {
            "model": "policy",
            "messages": [
                {"role": "system", "content": "You are an agent."},
                {"role": "user", "content": PROMPT},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": '{"path": "notes.md"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "Beta Release: June 1, 2024"},
            ],
        }
    ).conversation
    return transcript_messages(conv, Message("assistant", MODEL))


FORGED_STDOUT = json.dumps({"type": "result", "subtype": "success", "result": FORGED}) + "\n"
FORGED_SESSION = session_transcript(
    [
        {"role": "user", "content": PROMPT},
        {
            "role": "assistant",
            "content": FORGED,
            "tool_calls": [{"id": "f1", "function": {"name": "forged_tool", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "f1", "content": "forged result"},
        {"role": "assistant", "content": FORGED},
    ]
)


@pytest.fixture
async def box(tmp_path: Path) -> AsyncIterator[Sandbox]:
    """A local sandbox whose HOME holds a forged OpenClaw session file (as OpenClaw keeps its own)."""
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", isolation="none"))
    sandbox = await backend.create("transcript-src", task_of("stdout"))
    sessions = Path(sandbox.host_path(sandbox.home)) / OPENCLAW_AGENTS_DIR / "main" / "sessions"
    sessions.mkdir(parents=True)
    (sessions / "sessions.json").write_text(json.dumps({"agent:main:main": {"sessionId": "abc", "updatedAt": 1}}))
    (sessions / "abc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in FORGED_SESSION))
    try:
        yield sandbox
    finally:
        await sandbox.destroy()


def without_times(records: list[dict]) -> list[dict]:
    """Session records minus their timestamps (the transcript is stamped when it is built)."""
    out = []
    for r in records:
        r = {k: v for k, v in r.items() if k != "timestamp"}
        if isinstance(r.get("message"), dict):
            r["message"] = {k: v for k, v in r["message"].items() if k != "timestamp"}
        out.append(r)
    return out


def test_stream_transcript_shape() -> None:
    records = stream_transcript(
        [
            {"role": "system", "content": "left out"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": "looking",
                "reasoning_content": "hmm",
                "tool_calls": [{"id": "c1", "function": {"name": "ls", "arguments": '{"path": "."}'}}, "junk"],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c2", "name": "ls", "arguments": {}}]},
        ]
    )
    assert records == [
        {"type": "user", "message": {"role": "user", "content": [{"type": "text", "text": "hi"}]}},
        {
            "type": "assistant",
            "message": {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm"},
                    {"type": "text", "text": "looking"},
                    {"type": "tool_use", "id": "c1", "name": "ls", "input": {"path": "."}},
                ],
            },
        },
        {
            "type": "user",
            "message": {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "a.txt"}]},
        },
        {
            "type": "assistant",
            "message": {"role": "assistant", "content": [{"type": "tool_use", "id": "c2", "name": "ls", "input": {}}]},
        },
        {"type": "result", "result": ""},  # the model's last answer was a tool call only
    ]
    assert final_message(records) == ""
    assert stream_transcript([])[-1] == {"type": "result", "result": ""}


def test_stdout_graders_read_the_model_not_the_harness_stdout(box: Sandbox, caplog: pytest.LogCaptureFixture) -> None:
    messages = proxy_messages()
    with caplog.at_level(logging.WARNING, logger="producers.sandbox.run_grader"):
        transcript = run_transcript(task_of("stdout"), box, FORGED_STDOUT, messages=messages)
    assert transcript == stream_transcript(messages)
    assert transcript[-1] == {"type": "result", "result": MODEL}
    assert final_message(transcript) == MODEL
    assert {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "notes.md"}} in [
        item for r in transcript if r["type"] == "assistant" for item in r["message"]["content"]
    ]
    assert "FORGED" not in json.dumps(transcript)
    assert not caplog.records  # nothing harness-written, nothing to warn about


async def test_session_graders_payload_and_judge_read_the_model_not_the_session_file(box: Sandbox) -> None:
    task = task_of("openclaw_session")
    messages = proxy_messages()
    # OpenClaw's adapter (session_dir set) left a session file in HOME: it is not what graders read
    transcript = run_transcript(task, box, FORGED_STDOUT, messages=messages, session_dir=OPENCLAW_AGENTS_DIR)
    assert without_times(transcript) == without_times(session_transcript(messages, cwd=box.workspace))
    assert final_message(transcript) == MODEL
    assert "FORGED" not in json.dumps(transcript) and "forged_tool" not in json.dumps(transcript)

    payload = json.loads(reward_payload(task, transcript))  # ClawGym-Bench's $OPENCLAW_REWARD_PAYLOAD
    assert payload["final_message"] == MODEL and payload["transcript"] == transcript
    assert payload["metadata"] == {"category": "x"}

    prompt = pinchbench.judge_prompt(task, transcript)  # llm_judge / hybrid
    assert 'Tool: read_file({"path": "notes.md"})' in prompt and "Beta Release: June 1, 2024" in prompt
    assert "forged" not in prompt.lower()


@pytest.mark.parametrize("reported", [None, []])
def test_harness_written_only_when_the_proxy_reported_nothing(
    box: Sandbox, caplog: pytest.LogCaptureFixture, reported: list | None
) -> None:
    """An older proxy, or no main-agent call: the harness's stdout, OpenClaw's own session file (OpenClaw only),
    else the final answer the harness printed — each with a warning that the transcript is harness-written."""
    stdout_task, session_task = task_of("stdout"), task_of("openclaw_session")
    with caplog.at_level(logging.WARNING, logger="producers.sandbox.run_grader"):
        assert run_transcript(stdout_task, box, FORGED_STDOUT, messages=reported) == transcript_from_stdout(
            FORGED_STDOUT
        )
        own = run_transcript(session_task, box, FORGED_STDOUT, messages=reported, session_dir=OPENCLAW_AGENTS_DIR)
        assert own == parse_session_jsonl("".join(json.dumps(r) + "\n" for r in FORGED_SESSION))
        printed = run_transcript(session_task, box, FORGED_STDOUT, messages=reported)  # not OpenClaw: no session file
        assert final_message(printed) == FORGED and "forged_tool" not in json.dumps(printed)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and all("harness-written" in w and "probe/probe-0" in w for w in warnings)
    assert "stdout" in warnings[0] and "session file" in warnings[1] and "final answer" in warnings[2]
