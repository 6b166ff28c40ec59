"""One node of the local Kafka cluster as a process: its ``server.properties`` from the recipe, its storage
formatted with ``kafka.tools.StorageTool``, its JVM (``kafka.Kafka``, broker + controller) started in its own
session, why it died, the end of its log; and stopping a set of nodes by pid.

Files and recorded state are ``clawbase.kafka.local_state`` (what clients read); the recipe is
``compose/kafka-local/`` (``server.properties.in``, ``log4j2.properties``). Heap per node: ``CLAWSTREAM_KAFKA_HEAP``
(default ``512m``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from clawbase.kafka.local_state import NodeFiles, NodeState, pid_alive
from clawbase.kafka.topic_spec import replication_for

RECIPE_DIR = Path(__file__).resolve().parents[2] / "compose" / "kafka-local"


class KafkaNode(NodeFiles):
    """One KRaft combined node (broker + controller in one JVM): its files under ``root`` and its process."""

    @property
    def formatted(self) -> bool:
        return (self.data_dir / "meta.properties").exists()

    def write_properties(self, state: NodeState, voters: str, brokers: int) -> None:
        replication = replication_for(brokers)
        template = (RECIPE_DIR / "server.properties.in").read_text()
        text = template.format(
            node_id=state.node_id,
            port=state.port,
            controller_port=state.controller_port,
            voters=voters,
            log_dir=self.data_dir,
            replication=replication.factor,
            min_isr=replication.min_insync,
        )
        self.root.mkdir(parents=True, exist_ok=True)
        self.properties_file.write_text(text)

    def start_format(self, java: str, lib: Path, cluster_id: str) -> subprocess.Popen[str] | None:
        """Start formatting the storage (None when it already is); the caller waits, so nodes format in parallel."""
        if self.formatted:
            return None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            java,
            "-Xmx256m",
            f"-Dlog4j2.configurationFile={RECIPE_DIR / 'log4j2.properties'}",
            "-cp",
            f"{lib}/*",
            "kafka.tools.StorageTool",
            "format",
            "-t",
            cluster_id,
            "-c",
            str(self.properties_file),
            "--ignore-formatted",
        ]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def start(self, java: str, lib: Path, state: NodeState) -> None:
        """Start the JVM in its own session (its log appended to ``kafka.log``) and record its pid in ``state``."""
        heap = os.environ.get("CLAWSTREAM_KAFKA_HEAP", "512m")
        cmd = [
            java,
            f"-Xms{heap}",
            f"-Xmx{heap}",
            "-server",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExplicitGCInvokesConcurrent",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.root / 'logs'}",
            f"-Dlog4j2.configurationFile={RECIPE_DIR / 'log4j2.properties'}",
            "-cp",
            f"{lib}/*",
            "kafka.Kafka",
            str(self.properties_file),
        ]
        log = open(self.log_file, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        state.pid, state.started_at = proc.pid, time.time()

    def death_reason(self, state: NodeState, brokers: int) -> str:
        tail = self.tail(60)
        who = "the broker" if brokers == 1 else f"broker {self.node_id}"
        if "Address already in use" in tail or "failed to bind" in tail.lower():
            return (
                f"{who} could not bind 127.0.0.1:{state.port} or :{state.controller_port} (port taken); "
                "pick another with --port"
            )
        errors = [line for line in tail.splitlines() if "ERROR" in line or "Exception" in line][-5:]
        return f"{who} process exited during start-up:\n  " + "\n  ".join(errors or tail.splitlines()[-8:])

    def tail(self, lines: int = 50) -> str:
        try:
            with open(self.log_file, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - 200 * lines))
                text = handle.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def stop_pids(pids: list[int], *, grace: float) -> None:
    """SIGTERM every node at once (a node whose peers are already gone could not finish a controlled shutdown
    without a controller quorum), then SIGKILL what outlives ``grace``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # each node leads its own session/group; its shutdown hook runs
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.1)
