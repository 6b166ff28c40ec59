"""A real single-node Apache Kafka 4.x (KRaft, broker+controller in one JVM) for laptops, tests and CI.

The jars come from Maven Central through the recipe in ``compose/kafka-local/pom.xml`` (provisioned once into a
cache), storage is formatted with ``kafka.tools.StorageTool`` and the broker runs as ``kafka.Kafka`` in its own
session. State (pid, ports, cluster id) lives in ``<home>/state.json``; the data dir survives restarts.

Run: ``clawstream kafka up [--port N] | down | status | logs [-n N] [-f]`` (or ``python -m clawstream kafka ...``).
Environment: ``CLAWSTREAM_HOME`` (default ``~/.cache/clawstream``) holds ``kafka/`` (data, logs, state) and
``jars/`` (the provisioned class path); ``CLAWSTREAM_KAFKA_HEAP`` (default ``512m``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from clawbase.errors import KafkaLocalError
from clawbase.settings import clawstream_home

RECIPE_DIR = Path(__file__).resolve().parents[2] / "compose" / "kafka-local"
MIN_JAVA = 17


@dataclass
class BrokerState:
    """What ``state.json`` records about the local broker."""

    port: int
    controller_port: int
    cluster_id: str
    pid: int | None = None
    started_at: float | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _new_cluster_id() -> str:
    # Same shape as Kafka's Uuid.randomUuid(): base64url of 16 random bytes, unpadded, never starting with '-'.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap if it is our own exited child (tests start it in-process)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _java_major(java: str) -> int:
    out = subprocess.run([java, "-version"], capture_output=True, text=True, check=False).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not match:
        raise KafkaLocalError(f"could not read the Java version from `{java} -version`: {out.strip()[:200]}")
    major = int(match.group(1))
    return int(match.group(2)) if major == 1 and match.group(2) else major


class LocalKafka:
    """Provision, start, stop and inspect the local broker. All paths derive from ``home`` and ``jar_cache``."""

    def __init__(self, home: Path | None = None, jar_cache: Path | None = None) -> None:
        root = clawstream_home()
        self.home = Path(home) if home else root / "kafka"
        self.jar_cache = Path(jar_cache) if jar_cache else root / "jars"
        self.data_dir = self.home / "data"
        self.log_file = self.home / "kafka.log"
        self.state_file = self.home / "state.json"
        self.properties_file = self.home / "server.properties"

    # ---- state -------------------------------------------------------------------------------------------------
    def _read_state(self) -> BrokerState | None:
        try:
            return BrokerState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _write_state(self, state: BrokerState) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    def _our_pid(self, state: BrokerState | None) -> int | None:
        """The recorded pid if that process is alive and is *this* home's broker (pids get reused)."""
        if state is None or state.pid is None or not _pid_alive(state.pid):
            return None
        cmd = _cmdline(state.pid)
        return state.pid if "kafka.Kafka" in cmd and str(self.properties_file) in cmd else None

    def running_bootstrap(self) -> str | None:
        """Bootstrap address of this home's broker if its process is alive, else None."""
        state = self._read_state()
        return state.bootstrap if self._our_pid(state) else None

    # ---- provisioning ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lock(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def java(self) -> str:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
        if not java or not Path(java).exists():
            raise KafkaLocalError(
                f"Java {MIN_JAVA}+ is needed to run the Kafka broker and none was found on PATH or in JAVA_HOME; "
                "install a JDK (e.g. `apt-get install openjdk-17-jre-headless`) and retry"
            )
        major = _java_major(java)
        if major < MIN_JAVA:
            raise KafkaLocalError(f"{java} is Java {major}; Kafka 4.x needs Java {MIN_JAVA}+ (set JAVA_HOME)")
        return java

    def lib_dir(self) -> Path:
        """The cached class path for the recipe's pom (keyed by the pom's hash, so editing the pom re-provisions)."""
        digest = hashlib.sha256((RECIPE_DIR / "pom.xml").read_bytes()).hexdigest()[:12]
        return self.jar_cache / f"kafka-{digest}" / "lib"

    def provision(self, *, quiet: bool = False) -> Path:
        """Fetch the broker jars once with Maven (into the cache) and return the lib dir."""
        lib = self.lib_dir()
        done = lib.parent / "complete"
        if done.exists():
            return lib
        with self._lock(lib.parent / ".lock"):
            if done.exists():
                return lib
            mvn = shutil.which("mvn")
            if mvn is None:
                raise KafkaLocalError(
                    "Maven is needed once to fetch the Kafka broker jars from Maven Central and `mvn` is not on "
                    "PATH; install it (e.g. `apt-get install maven`) and retry"
                )
            if not quiet:
                print(f"provisioning Kafka jars with Maven into {lib} (once) ...", file=sys.stderr, flush=True)
            staging = lib.parent / "lib.partial"
            shutil.rmtree(staging, ignore_errors=True)
            cmd = [
                mvn,
                "-B",
                "-q",
                "-f",
                str(RECIPE_DIR / "pom.xml"),
                "dependency:copy-dependencies",
                f"-DoutputDirectory={staging}",
                "-DincludeScope=runtime",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
                raise KafkaLocalError("Maven could not fetch the Kafka jars:\n  " + "\n  ".join(tail))
            if not any(staging.glob("kafka_2.13-*.jar")):
                raise KafkaLocalError(f"Maven finished but {staging} holds no kafka_2.13 jar; check {RECIPE_DIR}")
            shutil.rmtree(lib, ignore_errors=True)
            staging.replace(lib)
            done.write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
        return lib

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def _pick_ports(self, port: int | None, previous: BrokerState | None) -> tuple[int, int]:
        if port is not None:
            if not _port_free(port):
                raise KafkaLocalError(
                    f"port {port} on 127.0.0.1 is taken by another process; pick another with --port, "
                    "or omit --port to get a free one"
                )
        elif previous is not None and _port_free(previous.port):
            port = previous.port  # keep the address stable across restarts when we can
        else:
            port = _free_port()
        controller = previous.controller_port if previous else None
        if controller is None or controller == port or not _port_free(controller):
            controller = _free_port()
            while controller == port:
                controller = _free_port()
        return port, controller

    def _write_properties(self, state: BrokerState) -> None:
        template = (RECIPE_DIR / "server.properties.in").read_text()
        text = template.format(port=state.port, controller_port=state.controller_port, log_dir=self.data_dir)
        self.properties_file.write_text(text)

    def _format_storage(self, java: str, lib: Path, cluster_id: str) -> None:
        if (self.data_dir / "meta.properties").exists():
            return
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
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KafkaLocalError(f"formatting KRaft storage failed:\n{(proc.stdout + proc.stderr).strip()[-2000:]}")

    def up(self, port: int | None = None, *, timeout: float = 90.0, quiet: bool = False) -> BrokerState:
        """Start the broker (or reuse the running one) and wait until it answers a metadata request."""
        with self._lock(self.home / ".lock"):
            previous = self._read_state()
            if self._our_pid(previous):
                assert previous is not None
                if port is not None and port != previous.port:
                    raise KafkaLocalError(
                        f"a local broker already runs on port {previous.port} (pid {previous.pid}); "
                        "run `clawstream kafka down` first to move it"
                    )
                self.wait_ready(previous, timeout=timeout)
                return previous
            java = self.java()
            lib = self.provision(quiet=quiet)
            port, controller = self._pick_ports(port, previous)
            state = BrokerState(
                port=port, controller_port=controller, cluster_id=previous.cluster_id if previous else _new_cluster_id()
            )
            self.home.mkdir(parents=True, exist_ok=True)
            self._write_properties(state)
            self._format_storage(java, lib, state.cluster_id)
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
                f"-Dkafka.logs.dir={self.home / 'logs'}",
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
            self._write_state(state)
            if not quiet:
                print(f"starting Kafka (pid {proc.pid}) on {state.bootstrap} ...", file=sys.stderr, flush=True)
            try:
                self.wait_ready(state, timeout=timeout)
            except KafkaLocalError:
                self._stop_pid(proc.pid, grace=5.0)
                raise
            return state

    def wait_ready(self, state: BrokerState, *, timeout: float) -> None:
        """Poll a metadata request until the broker answers; fail early (with the log's reason) if it died."""
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        admin = None
        while time.monotonic() < deadline:
            if state.pid is not None and not _pid_alive(state.pid):
                raise KafkaLocalError(self._death_reason(state))
            # A TCP probe first: the acceptor opens only when the broker is up, and an admin client created
            # earlier would log every refused connection.
            if admin is None:
                try:
                    socket.create_connection(("127.0.0.1", state.port), timeout=1.0).close()
                except OSError as exc:
                    last_error = str(exc)
                    time.sleep(0.3)
                    continue
                admin = AdminClient({"bootstrap.servers": state.bootstrap, "socket.connection.setup.timeout.ms": 2000})
            try:
                meta = admin.list_topics(timeout=2.0)
                if meta.brokers:
                    return
            except Exception as exc:  # noqa: BLE001 - librdkafka raises KafkaException with varied codes
                last_error = str(exc)
            time.sleep(0.3)
        raise KafkaLocalError(
            f"the broker on {state.bootstrap} did not answer metadata within {timeout:.0f}s ({last_error}); "
            f"see {self.log_file}"
        )

    def _death_reason(self, state: BrokerState) -> str:
        tail = self.tail(60)
        if "Address already in use" in tail or "failed to bind" in tail.lower():
            return (
                f"the broker could not bind 127.0.0.1:{state.port} or :{state.controller_port} (port taken); "
                "pick another with --port"
            )
        errors = [line for line in tail.splitlines() if "ERROR" in line or "Exception" in line][-5:]
        return "the broker process exited during start-up:\n  " + "\n  ".join(errors or tail.splitlines()[-8:])

    def _stop_pid(self, pid: int, *, grace: float) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # the broker leads its own session/group; its shutdown hook runs
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _pid_alive(pid):
            time.sleep(0.2)
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _pid_alive(pid):
                time.sleep(0.1)

    def down(self, *, grace: float = 30.0) -> bool:
        """Stop this home's broker by its recorded pid. Returns False when none was running."""
        with self._lock(self.home / ".lock"):
            state = self._read_state()
            pid = self._our_pid(state)
            if state is None or pid is None:
                return False
            self._stop_pid(pid, grace=grace)
            if _pid_alive(pid):
                raise KafkaLocalError(f"broker pid {pid} survived SIGKILL; check `ps -p {pid}`")
            state.pid = None
            self._write_state(state)
            return True

    def status(self) -> dict[str, object]:
        state = self._read_state()
        pid = self._our_pid(state)
        return {
            "running": pid is not None,
            "pid": pid,
            "bootstrap": state.bootstrap if state else None,
            "home": str(self.home),
            "data_dir": str(self.data_dir),
            "formatted": (self.data_dir / "meta.properties").exists(),
            "jars": str(self.lib_dir()),
            "log": str(self.log_file),
        }

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
