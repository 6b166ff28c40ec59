"""Every service runs with ``python -m <package>`` and through the ``clawstream`` CLI: each entry point answers
``--help`` (exit 0, a usage line) in a fresh interpreter, so a broken import or a moved module shows up here."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.sandbox_helpers import pid_alive

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
    "clawstream.stack.harness_check",
    "consumers.inference",
    "consumers.analytics",
    "consumers.analytics.dashboard",
    "consumers.analytics.dashboard.health_report",
    "consumers.analytics.replay",
    "consumers.analytics.audit",
    "learner",
    "learner.value",
    "warmstart",
    "policy.tiny_model",
    "policy.architectures",
    "streams",
    "streams.app",
]
COMMANDS = [
    ["demo"],
    ["kafka"],
    ["kafka", "up"],
    ["topics", "create"],
    ["model", "init"],
    ["model", "sft"],
    ["infer"],
    ["proxy"],
    ["streams"],
    ["sandbox-worker"],
    ["schedule"],
    ["learner"],
    ["harness", "install"],
    ["harness", "add"],
    ["harness", "check"],
    ["vllm"],
    ["vllm", "install"],
    ["vllm", "serve"],
    ["tasks"],
    ["tasks", "list"],
    ["tasks", "show"],
    ["tasks", "grade"],
    ["tail"],
    ["export"],
    ["audit"],
    ["dashboard"],
    ["health"],
    ["replay"],
    ["eval"],
]


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


@pytest.mark.parametrize("module", ["producers.sandbox", "producers.scheduler", "learner", "learner.value", "streams"])
def test_services_take_kafka_flags(module: str) -> None:
    """Kafka settings come from flags too (the environment stays supported)."""
    proc = _run([sys.executable, "-m", module, "--help"])
    assert "--bootstrap" in proc.stdout and "--topic-prefix" in proc.stdout, proc.stdout[-2000:]


def test_harness_table() -> None:
    """``python -m producers.harnesses`` prints one row per built-in adapter."""
    proc = _run([sys.executable, "-m", "producers.harnesses"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("claude-code", "codex", "qwen-code", "openclaw", "opencode", "agentloop", "agentloop-anthropic"):
        assert name in proc.stdout


def test_tasks_commands(tmp_path: Path) -> None:
    """``tasks list`` / ``show`` / ``grade`` on the real ClawGym-Bench fixture: the grade of an untouched workspace is
    its true low value, of a solved one 1.0, with check.py's sub-scores; the graded directory is left as it was."""
    if not CLI.exists():
        pytest.skip(f"{CLI} is not installed (pip install -e .)")
    suite = ROOT / "tests" / "fixtures" / "clawgym"
    listed = _run([str(CLI), "tasks", "list", str(suite)])
    assert listed.returncode == 0 and "task_0078" in listed.stdout and "3 available, 0 unavailable" in listed.stdout
    shown = _run([str(CLI), "tasks", "show", "task_0078", "--suite", f"clawgym:{suite}"])
    assert shown.returncode == 0 and "backup_date.txt" in shown.stdout and "reward.sh" in shown.stdout
    assert "/root/.openclaw/workspace/reward/" in shown.stdout
    module = _run([sys.executable, "-m", "producers.tasks", "show", str(suite / "task_0078")])
    assert module.returncode == 0 and module.stdout == shown.stdout
    task = suite / "task_0078"
    untouched = tmp_path / "untouched"
    shutil.copytree(task / "input_files", untouched)
    solved = tmp_path / "solved"
    shutil.copytree(task / "input_files", solved)
    shutil.copytree(ROOT / "tests" / "fixtures" / "clawgym_solutions" / "task_0078", solved, dirs_exist_ok=True)
    before = sorted(p.relative_to(solved) for p in solved.rglob("*"))
    low = _run([str(CLI), "tasks", "grade", str(task), str(untouched)])
    assert low.returncode == 0, low.stderr[-2000:]
    assert low.stdout.startswith("reward 0.083333 "), low.stdout
    assert "no_writes_outside_output" in low.stdout and "changelog_header" in low.stdout
    high = _run([str(CLI), "tasks", "grade", str(task), str(solved)])
    assert high.returncode == 0 and high.stdout.startswith("reward 1.0 "), high.stdout
    assert sorted(p.relative_to(solved) for p in solved.rglob("*")) == before  # no reward/ or payload left behind
    as_json = _run([str(CLI), "tasks", "grade", str(task), str(untouched), "--json"])
    assert json.loads(as_json.stdout)["sub_scores"]["no_writes_outside_output"] == 1.0


def test_learner_refuses_a_prefix_without_topics(kafka_bootstrap: str, tmp_path: Path) -> None:
    """A learner pointed at a prefix whose topics were never created says so in one line and how to fix it."""
    proc = _run(
        [
            sys.executable,
            "-m",
            "learner",
            "--model-dir",
            str(tmp_path / "none"),
            "--weight-store",
            str(tmp_path / "w"),
            "--bootstrap",
            kafka_bootstrap,
            "--topic-prefix",
            "never-created.",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "never-created.clawstream.batches" in proc.stderr
        and "clawstream topics create --prefix never-created." in proc.stderr
    ), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _children(pid: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def test_sigterm_stops_the_services_a_command_started(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`kill` (SIGTERM) on `clawstream eval` stops the engine, proxy and sandbox worker it started, as Ctrl-C does;
    Python's default SIGTERM would end the command at once and leave them running (found with a killed demo)."""
    from policy.tiny_model import init_tiny_model

    model = init_tiny_model(
        tmp_path / "tiny-sigterm",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        progress=None,
    )
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        CLAWSTREAM_HOME=str(tmp_path / "home"),
    )
    log = tmp_path / "eval.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(CLI), "eval", "--model", str(model), "--tasks", "64", "--mode", "greedy"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        services: list[int] = []
        deadline = time.monotonic() + 300  # a bound on waiting for the state below, not the trigger
        while len(services) < 3 and proc.poll() is None and time.monotonic() < deadline:
            services = _children(proc.pid)  # engine, proxy, sandbox worker: all three started
            time.sleep(0.2)
        assert len(services) >= 3, f"the eval's engine, proxy and worker never all ran: {services}\n{log.read_text()}"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, log.read_text()[-2000:]
    left = [p for p in services if pid_alive(p)]
    assert left == [], f"services still running after SIGTERM: {left}\n{log.read_text()[-2000:]}"
