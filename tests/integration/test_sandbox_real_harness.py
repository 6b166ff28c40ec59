"""A REAL harness (Claude Code, Codex) runs a native task end to end: sandbox worker → local sandbox → harness →
serving proxy → scripted engine, graded by the task's grader inside the sandbox.

The scripted policy finds the sandbox's workspace path in the harness's own prompt (both put the working directory
there: the task's mount dir inside bubblewrap, a host path without isolation) and answers with the harness's write
tool (Claude Code ``Write``, Codex ``exec_command``), then a final message. Asserts HARNESS_EXITED with exit code 0
and ≥ 2 calls served, reward 1, and a clean sandbox root. Skips with the reason when npm or the harness package
is unavailable.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from typing import Any

import pytest

from producers.harnesses.install import HarnessInstallError, install_harness
from producers.tasks.model import DEFAULT_MOUNT_DIR
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import assert_clean, assert_solved_by_harness, run_requests, stack
from tests.support.scripted_engine import tool_call_text

# its leftover check is machine-wide; long: `make test` runs both harnesses through the worker, graded, with a clean
# sandbox root, on ClawGym and PinchBench tasks in tests/integration/test_harness_matrix.py
pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.long]


def installed(name: str) -> None:
    if shutil.which("npm") is None:
        pytest.skip(f"{name}: npm is not on PATH, cannot install the real harness")
    try:
        install_harness(name)
    except HarnessInstallError as exc:
        pytest.skip(f"{name}: install failed: {exc}")


def responder(name: str, sandboxes: str):
    # Unisolated the workspace is a host path under the sandbox root; under bubblewrap the task's mount dir.
    ws_re = re.compile(
        re.escape(sandboxes) + r"/[^/\s\"'<>]+/workspace|(?<![\w/.-])" + re.escape(DEFAULT_MOUNT_DIR) + r"\b"
    )

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # title / side call
            return '{"title": "Create hello file"}'
        if "<tool_response>" in prompt_text:
            return "Done: hello.txt contains hi."
        found = ws_re.search(prompt_text)
        assert found, "the harness prompt names no sandbox workspace"
        ws = found.group(0)
        if name == "claude-code":
            return tool_call_text("Write", {"file_path": f"{ws}/hello.txt", "content": "hi"})
        return tool_call_text("exec_command", {"cmd": "printf hi > hello.txt", "workdir": ws})

    return respond


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["claude-code", "codex"])
async def test_real_harness_through_worker(kafka_settings, group_id, tmp_path, name: str) -> None:
    await asyncio.to_thread(installed, name)
    sandboxes = tmp_path / "sandboxes"
    async with stack(kafka_settings, group_id, tmp_path, responder(name, str(sandboxes))):
        req = S.request("hello", name, rollout_id=f"real-{name}", timeout_s=180)
        events, rewards = await run_requests(kafka_settings, [req], timeout=240)
    assert_solved_by_harness(events, rewards, req.rollout_id)
    assert_clean(sandboxes)
