"""The whole stack as containers (compose/docker-compose.yml), trained until a weight version is served.

A fresh Compose project (its own broker, volumes and internal sandbox network) runs the quickstart at its smallest:
one step of two tasks × two rollouts, the built-in harnesses in one clawstream/harnesses container per rollout (docker
sandbox backend through the engine's socket), the CPU engine and the learner in clawstream/trainer. The test waits,
bounded by events and an overall deadline (no fixed sleeps beyond the poll period), until

- the learner's ``train_step`` metric and the engine's ``weights_applied`` metric for version >= 1 are on
  ``clawstream.metrics`` (read with ``clawstream tail`` inside the stack: the broker is not published to the host),
- the engine itself answers with ``X-Policy-Version`` >= 1 (what it serves now),
- every rollout of that step was graded by the sandbox worker (``clawstream.rewards``, not infra failures),
- a container on the sandbox network (where rollouts run) reaches the proxy's harness port and not its admin
  listener (neither by the proxy's name nor by the admin name), while the sandbox worker reaches the admin API,

then ``docker compose down -v`` and checks nothing of the project is left: containers, networks, volumes (by the
project's label) and the sandbox network (``down`` cannot remove it while a rollout container is still attached).
Without a Docker engine or Compose v2 the test is skipped with the reason, unless CI is set (then it fails):
tests/support/docker_images.py.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.docker_images import ensure_images, require_compose

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose" / "docker-compose.yml"
STEPS, TASKS, GROUP = 1, 2, 2
DEADLINE_S = 1800.0  # overall: start-up (model init, engine load) + one RL step + the weight swap, on 2 busy cores
POLL_S = 5.0

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(DEADLINE_S + 900), pytest.mark.provisioned("docker", "compose")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Project:
    """``docker compose`` on compose/docker-compose.yml under one project name."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name, self.env = name, {**os.environ, **env}

    def run(self, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-f", str(COMPOSE_FILE), "-p", self.name, *args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`{' '.join(argv[4:])}` failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
            )
        return proc

    def services(self) -> list[dict[str, Any]]:
        out = self.run("ps", "-a", "--format", "json").stdout
        text = out.strip()
        if text.startswith("["):  # older Compose: one JSON array
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def exec_out(self, service: str, *argv: str, timeout: float = 60.0) -> str:
        proc = self.run("exec", "-T", service, *argv, timeout=timeout, check=False)
        return proc.stdout if proc.returncode == 0 else ""

    def logs(self) -> str:
        return self.run("logs", "--no-color", "--tail", "60", timeout=60, check=False).stdout[-20000:]


def records(project: Project, topic: str) -> list[dict[str, Any]]:
    """Every record of ``topic`` (decoded values), read inside the stack by the dashboard's container."""
    out = project.exec_out("dashboard", "clawstream", "tail", topic, "--from-beginning", "-q")
    values = []
    for line in out.splitlines():
        try:
            values.append(json.loads(line)["value"])
        except (ValueError, KeyError, TypeError):
            continue
    return values


def served_version(project: Project) -> int | None:
    code = (
        "import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=5); "
        "print(r.headers['X-Policy-Version'])"
    )
    out = project.exec_out("engine", "python", "-c", code).strip()
    return int(out) if out.isdigit() else None


def left_over(project: str) -> dict[str, list[str]]:
    label = f"label=com.docker.compose.project={project}"
    found = {}
    for kind, argv in {
        "containers": ["docker", "ps", "-a", "-q", "--filter", label],
        "networks": ["docker", "network", "ls", "-q", "--filter", label],
        "volumes": ["docker", "volume", "ls", "-q", "--filter", label],
        "sandbox network": ["docker", "network", "ls", "-q", "--filter", f"name=^{project}-sandbox$"],
    }.items():
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.split()
        found[kind] = out
    return found


PROBE = """
import socket, sys
out = []
for host, port in [("proxy", 8100), ("proxy", 8101), ("proxy-admin", 8101)]:
    try:
        socket.create_connection((host, port), timeout=5).close()
        out.append("open")
    except OSError as exc:
        out.append(type(exc).__name__)
print(" ".join(out))
"""


def sandbox_reach(project: Project) -> list[str]:
    """What a container on the project's sandbox network (as a rollout container is) can connect to."""
    argv = ["docker", "run", "--rm", "--network", f"{project.name}-sandbox"]
    argv += [f"clawstream/harnesses:{os.environ.get('CLAWSTREAM_IMAGE_TAG', 'latest')}", "python3", "-c", PROBE]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()


def test_compose_stack_trains_and_serves_a_new_version() -> None:
    require_compose()
    ensure_images("runtime", "harnesses", "trainer", "kafka")
    name = f"cstest{uuid.uuid4().hex[:8]}"
    project = Project(
        name,
        {
            "COMPOSE_PROFILES": "cpu",
            "CLAWSTREAM_STEPS": str(STEPS),
            "CLAWSTREAM_TASKS_PER_STEP": str(TASKS),
            "CLAWSTREAM_GROUP_SIZE": str(GROUP),
            "CLAWSTREAM_CONCURRENCY": "4",
            "CLAWSTREAM_DASHBOARD_PORT": str(free_port()),
            # a fresh random one per deployment, by environment (compose has no default for it)
            "CLAWSTREAM_ADMIN_TOKEN": secrets.token_urlsafe(32),
        },
    )
    t0 = time.monotonic()
    passed = False
    try:
        # `up -d` returns once every service is started and the health / completion conditions it depends on hold.
        project.run("up", "-d", "--quiet-pull", timeout=DEADLINE_S)
        print(f"stack up in {time.monotonic() - t0:.0f} s")
        # A rollout's network: the harness port answers, the admin listener is not there (by either name).
        harness, by_proxy_name, by_admin_name = sandbox_reach(project)
        assert harness == "open", harness
        assert by_proxy_name != "open" and by_admin_name != "open", (by_proxy_name, by_admin_name)
        worker_reach = "import urllib.request as u; print(u.urlopen('http://proxy-admin:8101/healthz').status)"
        assert project.exec_out("sandbox-worker", "python3", "-c", worker_reach).strip() == "200"
        trained: list[dict[str, Any]] = []
        applied: list[dict[str, Any]] = []
        version = None
        while time.monotonic() - t0 < DEADLINE_S:
            failed = [s for s in project.services() if s.get("State") == "exited" and int(s.get("ExitCode", 0)) != 0]
            assert not failed, f"services failed: {[(s['Service'], s['ExitCode']) for s in failed]}"
            metrics = records(project, "clawstream.metrics")
            trained = [m for m in metrics if m.get("name") == "train_step"]
            applied = [m for m in metrics if m.get("name") == "weights_applied" and m.get("policy_version", 0) >= 1]
            if trained and applied:
                version = served_version(project)
                if version is not None and version >= 1:
                    break
            time.sleep(POLL_S)
        else:
            raise AssertionError(
                f"no weight version trained and served within {DEADLINE_S:.0f} s: "
                f"{len(trained)} train_step, {len(applied)} weights_applied metrics"
            )
        took = time.monotonic() - t0
        print(f"v{version} served {took:.0f} s after `up`")
        assert trained[0]["policy_version"] >= 1 and trained[0]["step"] == 0
        assert applied[0]["policy_version"] == trained[0]["policy_version"]
        # The step's rollouts really ran in sandbox containers and were graded (status OK).
        rewards = records(project, "clawstream.rewards")
        graded = {r["rollout_id"] for r in rewards if r.get("status") == "OK"}
        assert len(graded) >= TASKS * GROUP, f"only {len(graded)} graded rollouts: {rewards[:4]}"
        passed = True
    finally:
        if not passed:
            print(f"--- logs of {name} ---\n{project.logs()}")
        down = project.run("down", "-v", "--remove-orphans", timeout=600, check=False)
        leftovers = left_over(name)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(leftovers.values()), f"left behind by `down -v`: {leftovers}"
