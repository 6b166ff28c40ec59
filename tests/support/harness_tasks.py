"""What the real-harness tests script: every harness, the solved ClawGym-Bench task, each harness's own write tool.

Shared by ``tests/integration/test_harness_matrix.py`` (each harness alone) and ``tests/e2e/test_mixed_batch.py``
(all of them in one training batch). The scripted policy finds the sandbox's workspace in the harness's prompt
(every real harness names its working directory there; the built-in loops take relative paths), writes the files
of the task's solution (``tests/fixtures/clawgym_solutions/task_0085``) one tool call per turn with the harness's
own write tool (:data:`WRITE`), then ends with a plain answer.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from typing import Any

import pytest

from producers.harnesses.catalog import ADAPTERS
from producers.harnesses.install import HarnessInstallError, install_harness, install_node24
from producers.tasks.loaders import CLAWGYM_MOUNT_DIR
from producers.tasks.model import DEFAULT_MOUNT_DIR
from tests.support import sandbox_helpers as S
from tests.support.scripted_engine import tool_call_text

# mini-swe-agent last: its one tool, ``bash{command}``, is in opencode's tool set too (the mixed batch's harness_of).
HARNESSES = [
    "claude-code",
    "codex",
    "qwen-code",
    "openclaw",
    "opencode",
    "agentloop",
    "agentloop-anthropic",
    "gemini-cli",
    "cline",
    "mini-swe-agent",
]
SOLUTION = S.FIXTURES / "clawgym_solutions" / "task_0085"
FILES = ["output/nimbus_checklist.md", "output/context_sources.json"]
CLAWGYM_PHRASE = "Nimbus rollout"  # in task_0085's prompt
SANITY_PHRASE = "Hello, I'm ready!"  # in task_00_sanity's prompt
# Their tools take paths relative to the workspace (mini-swe-agent's commands run there; its prompt names no path).
RELATIVE = {"agentloop", "agentloop-anthropic", "mini-swe-agent"}
FINAL = {"clawgym": "Done: the checklist and the context trace are in output/.", "pinch": SANITY_PHRASE}


def heredoc(rel: str, content: str) -> str:
    return f"mkdir -p {rel.rsplit('/', 1)[0]} && cat > {rel} <<'CLAWSTREAM_EOF'\n{content}\nCLAWSTREAM_EOF"


# harness → (workspace, relative path, content) → (tool name, arguments): the harness's own write tool.
WRITE: dict[str, Callable[[str, str, str], tuple[str, dict[str, Any]]]] = {
    "claude-code": lambda ws, rel, c: ("Write", {"file_path": f"{ws}/{rel}", "content": c}),
    "codex": lambda ws, rel, c: ("exec_command", {"cmd": heredoc(rel, c), "workdir": ws}),
    "qwen-code": lambda ws, rel, c: ("write_file", {"file_path": f"{ws}/{rel}", "content": c}),
    "gemini-cli": lambda ws, rel, c: ("write_file", {"file_path": f"{ws}/{rel}", "content": c}),
    "openclaw": lambda ws, rel, c: ("write", {"path": f"{ws}/{rel}", "content": c}),
    "opencode": lambda ws, rel, c: ("write", {"filePath": f"{ws}/{rel}", "content": c}),
    "agentloop": lambda _ws, rel, c: ("write_file", {"path": rel, "content": c}),
    "agentloop-anthropic": lambda _ws, rel, c: ("Write", {"file_path": rel, "content": c}),
    "cline": lambda ws, rel, c: ("editor", {"path": f"{ws}/{rel}", "new_text": c}),
    "mini-swe-agent": lambda _ws, rel, c: ("bash", {"command": heredoc(rel, c)}),
}
# Harnesses whose run ends on a tool call, not on a plain answer: that call (mini-swe-agent asks again after an answer
# without a bash call, and stops when a command prints its submit word first).
FINISH: dict[str, tuple[str, dict[str, Any]]] = {
    "mini-swe-agent": ("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}),
}


def final_answer(name: str, text: str) -> str:
    """The scripted policy's last answer for harness ``name``: ``text``, then the call that ends its run (FINISH)."""
    return f"{text}\n{tool_call_text(*FINISH[name])}" if name in FINISH else text


def solution_files() -> list[tuple[str, str]]:
    """(relative path, content) of each file of the solved task, in the order the policy writes them."""
    return [(rel, (SOLUTION / rel).read_text()) for rel in FILES]


def workspace_pattern(sandboxes: str) -> re.Pattern[str]:
    """A sandbox workspace path as a harness prompt names it: under the worker's sandbox root (no isolation), or a
    task's mount dir (bubblewrap: the workspace is bound there)."""
    host = re.escape(sandboxes) + r"/[^/\s\"'<>\\]+/workspace"
    inside = "|".join(r"(?<![\w/.-])" + re.escape(d) + r"(?![\w.-])" for d in (CLAWGYM_MOUNT_DIR, DEFAULT_MOUNT_DIR))
    return re.compile(f"{host}|{inside}")


def installed(name: str) -> None:
    """Install the real harness (once, cached); skip with the reason when it cannot be."""
    package = ADAPTERS[name].install
    if package is None:
        return
    if package.startswith("npm:") and shutil.which("npm") is None:
        pytest.skip(f"{name}: npm is not on PATH, cannot install the real harness")
    try:
        install_harness(name)
        if ADAPTERS[name].node24:
            install_node24()
    except HarnessInstallError as exc:
        pytest.skip(f"{name}: install failed: {exc}")
