"""Every service runs with ``python -m <package>`` and through the ``clawstream`` CLI: each entry point answers
``--help`` (exit 0, a usage line) in a fresh interpreter, so a broken import or a moved module shows up here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).with_name("clawstream")

MODULES = [
    "clawstream",
    "producers.proxy",
    "producers.sandbox",
    "producers.scheduler",
    "producers.tasks",
    "producers.harnesses.builtin_loop",
    "producers.harnesses.install",
    "consumers.inference",
    "learner",
    "learner.value",
    "learner.warmstart",
    "policy.tiny_model",
    "streams",
    "streams.app",
]
COMMANDS = [
    ["demo"], ["kafka"], ["kafka", "up"], ["topics", "create"], ["model", "init"], ["model", "sft"], ["infer"],
    ["proxy"], ["streams"], ["sandbox-worker"], ["schedule"], ["learner"], ["harness", "install"], ["vllm"],
    ["vllm", "install"], ["vllm", "serve"],
]  # fmt: skip


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("module", MODULES)
def test_python_m_help(module: str) -> None:
    proc = _run([sys.executable, "-m", module, "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower(), proc.stdout[-2000:]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_cli_help(command: list[str]) -> None:
    if not CLI.exists():
        pytest.skip(f"{CLI} is not installed (pip install -e .)")
    proc = _run([str(CLI), *command, "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower(), proc.stdout[-2000:]


def test_harness_table() -> None:
    """``python -m producers.harnesses`` prints one row per built-in adapter."""
    proc = _run([sys.executable, "-m", "producers.harnesses"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("claude-code", "codex", "qwen-code", "openclaw", "opencode", "agentloop", "agentloop-anthropic"):
        assert name in proc.stdout
