"""`clawstream kafka up | status | down` on a broker of its own: reuse, port conflicts, data surviving a restart,
and no process left behind. Uses the real CLI entry point in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from clawbase.kafka.clients import create_topics, make_admin
from clawbase.kafka.local_state import pid_alive
from clawbase.settings import KafkaSettings
from clawstream.local_kafka import LocalKafka
from schemas.topics import CATALOG

pytestmark = pytest.mark.integration


def cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clawstream", "kafka", *args, "--home", str(home)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_up_reuse_restart_down(tmp_path: Path) -> None:
    home = tmp_path / "broker"
    first = cli("up", home=home)
    assert first.returncode == 0, first.stderr
    bootstrap = first.stdout.strip()
    assert bootstrap.startswith("127.0.0.1:")
    try:
        status = json.loads(cli("status", "--json", home=home).stdout)
        pid = status["pid"]
        assert status["running"] and status["bootstrap"] == bootstrap and pid_alive(pid)

        again = cli("up", home=home)  # a second `up` reuses the running broker
        assert again.returncode == 0 and again.stdout.strip() == bootstrap
        assert json.loads(cli("status", "--json", home=home).stdout)["pid"] == pid

        settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix="persist.")
        create_topics(settings, CATALOG)
        assert cli("down", home=home).stdout.strip() == "stopped"
        assert not pid_alive(pid)
        assert cli("status", home=home).returncode == 3

        restarted = cli("up", home=home)  # same port, same data dir: the topics survive
        assert restarted.returncode == 0, restarted.stderr
        assert restarted.stdout.strip() == bootstrap
        topics = make_admin(settings).list_topics(timeout=10).topics
        assert settings.topic("clawstream.calls") in topics
    finally:
        cli("down", home=home)
    final = json.loads(cli("status", "--json", home=home).stdout)
    assert not final["running"]
    leftovers = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True, check=False).stdout
    assert leftovers.strip() == "", f"processes left behind: {leftovers}"


def test_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = cli("up", "--port", str(port), home=tmp_path / "b")
    assert result.returncode == 1
    assert f"port {port}" in result.stderr and "taken" in result.stderr and "Traceback" not in result.stderr
    assert not LocalKafka(home=tmp_path / "b").status()["running"]


def test_missing_java_and_maven_are_clear_errors(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path / "empty-bin"), JAVA_HOME="")
    env.pop("JAVA_HOME")
    result = subprocess.run(
        [sys.executable, "-m", "clawstream", "kafka", "up", "--home", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "Java 17+ is needed" in result.stderr and "Traceback" not in result.stderr

    java_dir = tmp_path / "java-only"
    java_dir.mkdir()
    real_java = subprocess.run(["bash", "-lc", "command -v java"], capture_output=True, text=True).stdout.strip()
    (java_dir / "java").symlink_to(os.path.realpath(real_java))
    env["PATH"] = str(java_dir)
    env["CLAWSTREAM_HOME"] = str(tmp_path / "fresh-home")  # no jars cached yet → Maven is needed
    result = subprocess.run(
        [sys.executable, "-m", "clawstream", "kafka", "up", "--home", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and "Maven is needed" in result.stderr, result.stderr
