"""A real Apache Kafka 4.x (KRaft) on one host for laptops, tests and CI: one node by default, or a replicated cluster
of N nodes (``--brokers 3``), each a combined broker + controller in its own JVM with its own ports, data and log.

The jars come from Maven Central through the recipe in ``compose/kafka-local/pom.xml`` (provisioned once into a
cache), storage is formatted with ``kafka.tools.StorageTool`` and each node runs as ``kafka.Kafka`` in its own
session. One node is one :class:`KafkaNode`; :class:`LocalKafka` is the cluster. State (pids, ports, cluster id)
lives in ``<home>/state.json``; data dirs survive restarts, and ``up`` restarts the nodes of a cluster that died.
A single node keeps its files in ``<home>`` itself (``data/``, ``kafka.log``), node N of a cluster in
``<home>/node-N``. Replication follows the size (``clawbase.kafka.topic_spec.replication_for``).

Run: ``clawstream kafka up [--port N] [--brokers N] | down | status | logs [--node N] [-n N] [-f]``.
Environment: ``CLAWSTREAM_HOME`` (default ``~/.cache/clawstream``) holds ``kafka/`` (data, logs, state) and
``jars/`` (the provisioned class path); ``CLAWSTREAM_KAFKA_HEAP`` (default ``512m``, per node).
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
from typing import Any

from clawbase.errors import KafkaLocalError
from clawbase.kafka.topic_spec import replication_for
from clawbase.settings import clawstream_home

RECIPE_DIR = Path(__file__).resolve().parents[2] / "compose" / "kafka-local"
MIN_JAVA = 17


@dataclass
class NodeState:
    """What ``state.json`` records about one node."""

    node_id: int
    port: int
    controller_port: int
    pid: int | None = None
    started_at: float | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class ClusterState:
    """What ``state.json`` records about the local cluster: its id and its nodes (node ids 1..N)."""

    cluster_id: str
    nodes: list[NodeState]

    @property
    def bootstrap(self) -> str:
        """Every node's address: a client finds the cluster through any one that answers."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def pid(self) -> int | None:
        return self.nodes[0].pid

    @property
    def pids(self) -> list[int | None]:
        return [node.pid for node in self.nodes]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        if "nodes" not in data:  # written before clusters existed: one broker, node id 1
            node = NodeState(1, data["port"], data["controller_port"], data.get("pid"), data.get("started_at"))
            return cls(data["cluster_id"], [node])
        return cls(data["cluster_id"], [NodeState(**node) for node in data["nodes"]])


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


class KafkaNode:
    """One KRaft combined node (broker + controller in one JVM): its files under ``root`` and its process."""

    def __init__(self, root: Path, node_id: int) -> None:
        self.root, self.node_id = root, node_id
        self.data_dir = root / "data"
        self.log_file = root / "kafka.log"
        self.properties_file = root / "server.properties"

    @property
    def formatted(self) -> bool:
        return (self.data_dir / "meta.properties").exists()

    def our_pid(self, state: NodeState | None) -> int | None:
        """The recorded pid if that process is alive and is *this* node's broker (pids get reused)."""
        if state is None or state.pid is None or not _pid_alive(state.pid):
            return None
        cmd = _cmdline(state.pid)
        return state.pid if "kafka.Kafka" in cmd and str(self.properties_file) in cmd else None

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


def _stop_pids(pids: list[int], *, grace: float) -> None:
    """SIGTERM every node at once (a node whose peers are already gone could not finish a controlled shutdown
    without a controller quorum), then SIGKILL what outlives ``grace``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # each node leads its own session/group; its shutdown hook runs
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_pid_alive(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_pid_alive(pid) for pid in pids):
        time.sleep(0.1)


class LocalKafka:
    """Provision, start, stop and inspect the local cluster (one node by default). Paths derive from ``home`` and
    ``jar_cache``."""

    def __init__(self, home: Path | None = None, jar_cache: Path | None = None) -> None:
        root = clawstream_home()
        self.home = Path(home) if home else root / "kafka"
        self.jar_cache = Path(jar_cache) if jar_cache else root / "jars"
        self.state_file = self.home / "state.json"

    # ---- nodes and state ---------------------------------------------------------------------------------------
    def node(self, node_id: int, brokers: int) -> KafkaNode:
        # One node keeps the layout single-broker homes always had (their data dir is reused as it is).
        return KafkaNode(self.home if brokers == 1 else self.home / f"node-{node_id}", node_id)

    def nodes(self, brokers: int | None = None) -> list[KafkaNode]:
        """The nodes of a cluster of ``brokers`` (default: the recorded size, else 1)."""
        n = brokers or self.brokers()
        return [self.node(i, n) for i in range(1, n + 1)]

    def brokers(self) -> int:
        """The size of the cluster this home holds (1 when it holds none yet)."""
        state = self._read_state()
        return len(state.nodes) if state else 1

    def _read_state(self) -> ClusterState | None:
        try:
            return ClusterState.from_json(json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def _write_state(self, state: ClusterState) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    def _alive(self, state: ClusterState | None) -> dict[int, int]:
        """node id → pid of each recorded node whose process is alive and is that node's broker."""
        if state is None:
            return {}
        nodes = self.nodes(len(state.nodes))
        pids = {s.node_id: node.our_pid(s) for node, s in zip(nodes, state.nodes, strict=True)}
        return {node_id: pid for node_id, pid in pids.items() if pid is not None}

    def active_controller(self) -> int | None:
        """The node id of the active controller (the KRaft quorum's leader), as the live nodes' own Raft state says: the
        leader of the highest epoch any of them recorded in ``__cluster_metadata-0/quorum-state``. A client cannot ask:
        KRaft answers Metadata and DescribeCluster with a random live broker as the "controller". None when no live
        node knows a leader; right after the leader died, the dead one until the others elected anew."""
        state = self._read_state()
        alive = self._alive(state)
        newest: tuple[int, int] | None = None  # (epoch, leader)
        for node in self.nodes(len(state.nodes) if state else 1):
            if node.node_id not in alive:
                continue
            try:
                quorum = json.loads((node.data_dir / "__cluster_metadata-0" / "quorum-state").read_text())
                epoch, leader = int(quorum["leaderEpoch"]), int(quorum["leaderId"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if leader >= 0 and (newest is None or epoch > newest[0]):
                newest = (epoch, leader)
        return newest[1] if newest else None

    def running_bootstrap(self) -> str | None:
        """Bootstrap addresses of this home's cluster if any of its nodes is alive, else None."""
        state = self._read_state()
        return state.bootstrap if self._alive(state) else None

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
    def _pick_ports(self, port: int | None, previous: ClusterState | None, brokers: int) -> list[tuple[int, int]]:
        """(broker port, controller port) per node: ``--port`` and the next ones, else the previous ports where
        still free (a stable address across restarts), else free ones; never one port twice."""
        taken: set[int] = set()

        def fresh() -> int:
            candidate = _free_port()
            while candidate in taken:
                candidate = _free_port()
            return candidate

        ports = []
        for i in range(brokers):
            prev = previous.nodes[i] if previous is not None and len(previous.nodes) == brokers else None
            if port is not None:
                p = port + i
                if not _port_free(p):
                    which = "" if i == 0 else f" (broker {i + 1}'s: --port + {i})"
                    raise KafkaLocalError(
                        f"port {p}{which} on 127.0.0.1 is taken by another process; pick another with --port, "
                        "or omit --port to get a free one"
                    )
            elif prev is not None and prev.port not in taken and _port_free(prev.port):
                p = prev.port
            else:
                p = fresh()
            taken.add(p)
            controller = prev.controller_port if prev else None
            if controller is None or controller in taken or not _port_free(controller):
                controller = fresh()
            taken.add(controller)
            ports.append((p, controller))
        return ports

    def _check_size(self, previous: ClusterState | None, brokers: int, alive: dict[int, int]) -> None:
        """A home's data belongs to a cluster of one size: its controller quorum is fixed when it is formatted."""
        if previous is None or len(previous.nodes) == brokers:
            return
        had = len(previous.nodes)
        if alive:
            raise KafkaLocalError(
                f"a local cluster of {had} broker(s) already runs in {self.home}; run `clawstream kafka down` "
                f"first, then `up --brokers {brokers}` with another --home (its data belongs to {had} broker(s))"
            )
        if any(node.formatted for node in self.nodes(had)):
            raise KafkaLocalError(
                f"{self.home} holds the data of a {had}-broker cluster, which a {brokers}-broker one cannot reuse; "
                f"pass another --home, or `--brokers {had}`, or delete {self.home} to start afresh"
            )

    def up(
        self, port: int | None = None, *, brokers: int | None = None, timeout: float = 90.0, quiet: bool = False
    ) -> ClusterState:
        """Start the cluster (``brokers`` nodes; default: the home's recorded size, else 1), reusing running nodes
        and restarting dead ones on their data dirs and ports; wait until every node answers a metadata request
        that lists all of them."""
        if brokers is not None and brokers < 1:
            raise KafkaLocalError(f"--brokers must be 1 or more, got {brokers}")
        with self._lock(self.home / ".lock"):
            previous = self._read_state()
            n = brokers or (len(previous.nodes) if previous else 1)
            alive = self._alive(previous)
            self._check_size(previous, n, alive)
            if previous is not None and alive:
                if port is not None and port != previous.port:
                    raise KafkaLocalError(
                        f"a local broker already runs on port {previous.port} (pid {alive.get(1, previous.pid)}); "
                        "run `clawstream kafka down` first to move it"
                    )
                if len(alive) == n:
                    self.wait_ready(previous, timeout=timeout)
                    return previous
                # Some nodes died: restart them on the ports the others already know them by.
                state, start = previous, [s for s in previous.nodes if s.node_id not in alive]
                for s in start:
                    if not _port_free(s.port) or not _port_free(s.controller_port):
                        raise KafkaLocalError(
                            f"broker {s.node_id}'s port {s.port} or {s.controller_port} is taken by another process, "
                            "and the running nodes know it by these; run `clawstream kafka down`, then `up` again"
                        )
            else:
                ports = self._pick_ports(port, previous, n)
                cluster_id = previous.cluster_id if previous else _new_cluster_id()
                state = ClusterState(cluster_id, [NodeState(i + 1, p, c) for i, (p, c) in enumerate(ports)])
                start = list(state.nodes)
            java = self.java()
            lib = self.provision(quiet=quiet)
            voters = ",".join(f"{s.node_id}@127.0.0.1:{s.controller_port}" for s in state.nodes)
            nodes = {node.node_id: node for node in self.nodes(n)}
            for s in start:
                nodes[s.node_id].write_properties(s, voters, n)
            self._format([nodes[s.node_id] for s in start], java, lib, state.cluster_id)
            for s in start:
                nodes[s.node_id].start(java, lib, s)
            self._write_state(state)
            if not quiet:
                pids = ", ".join(str(s.pid) for s in start)
                where = state.bootstrap if len(start) == n else ", ".join(s.bootstrap for s in start)
                print(f"starting Kafka (pid {pids}) on {where} ...", file=sys.stderr, flush=True)
            try:
                self.wait_ready(state, timeout=timeout)
            except KafkaLocalError:
                _stop_pids([s.pid for s in start if s.pid is not None], grace=5.0)
                raise
            return state

    def _format(self, nodes: list[KafkaNode], java: str, lib: Path, cluster_id: str) -> None:
        procs = [(node, node.start_format(java, lib, cluster_id)) for node in nodes]
        for node, proc in procs:
            if proc is None:
                continue
            out, _ = proc.communicate()
            if proc.returncode != 0:
                who = "" if len(nodes) == 1 else f" of broker {node.node_id}"
                raise KafkaLocalError(f"formatting KRaft storage{who} failed:\n{out.strip()[-2000:]}")

    def wait_ready(self, state: ClusterState, *, timeout: float) -> None:
        """Poll each node with a metadata request until it answers listing every node of the cluster; fail early
        (with the log's reason) if a node died."""
        deadline = time.monotonic() + timeout
        nodes = self.nodes(len(state.nodes))
        for node, s in zip(nodes, state.nodes, strict=True):
            self._wait_node(node, s, len(state.nodes), deadline, timeout)

    def _wait_node(self, node: KafkaNode, s: NodeState, brokers: int, deadline: float, timeout: float) -> None:
        from confluent_kafka.admin import AdminClient

        last_error = "no answer yet"
        admin = None
        while time.monotonic() < deadline:
            if s.pid is not None and not _pid_alive(s.pid):
                raise KafkaLocalError(node.death_reason(s, brokers))
            # A TCP probe first: the acceptor opens only when the broker is up, and an admin client created
            # earlier would log every refused connection.
            if admin is None:
                try:
                    socket.create_connection(("127.0.0.1", s.port), timeout=1.0).close()
                except OSError as exc:
                    last_error = str(exc)
                    time.sleep(0.3)
                    continue
                admin = AdminClient({"bootstrap.servers": s.bootstrap, "socket.connection.setup.timeout.ms": 2000})
            try:
                meta = admin.list_topics(timeout=2.0)
                if len(meta.brokers) >= brokers:
                    return
                last_error = f"{len(meta.brokers)} of {brokers} brokers registered"
            except Exception as exc:  # noqa: BLE001 - librdkafka raises KafkaException with varied codes
                last_error = str(exc)
            time.sleep(0.3)
        who = "the broker" if brokers == 1 else f"broker {s.node_id}"
        raise KafkaLocalError(
            f"{who} on {s.bootstrap} did not answer metadata within {timeout:.0f}s ({last_error}); see {node.log_file}"
        )

    def down(self, *, grace: float = 30.0) -> bool:
        """Stop this home's nodes by their recorded pids. Returns False when none was running."""
        with self._lock(self.home / ".lock"):
            state = self._read_state()
            alive = self._alive(state)
            if state is None or not alive:
                return False
            _stop_pids(list(alive.values()), grace=grace)
            survivors = [pid for pid in alive.values() if _pid_alive(pid)]
            if survivors:
                raise KafkaLocalError(f"broker pid(s) {survivors} survived SIGKILL; check `ps -p {survivors[0]}`")
            for s in state.nodes:
                s.pid = None
            self._write_state(state)
            return True

    def status(self) -> dict[str, object]:
        """One broker: running, pid, bootstrap, home, data_dir, formatted, jars, log. A cluster: running (every
        node), brokers, bootstrap, the active controller's node id, home, formatted, jars, and per node its id,
        running, pid, address, data and log."""
        state = self._read_state()
        n = len(state.nodes) if state else 1
        nodes = self.nodes(n)
        alive = self._alive(state)
        if n == 1:
            return {
                "running": 1 in alive,
                "pid": alive.get(1),
                "bootstrap": state.bootstrap if state else None,
                "home": str(self.home),
                "data_dir": str(nodes[0].data_dir),
                "formatted": nodes[0].formatted,
                "jars": str(self.lib_dir()),
                "log": str(nodes[0].log_file),
            }
        return {
            "running": len(alive) == n,
            "brokers": n,
            "bootstrap": state.bootstrap if state else None,
            "controller": self.active_controller(),
            "home": str(self.home),
            "formatted": all(node.formatted for node in nodes),
            "jars": str(self.lib_dir()),
            "nodes": [
                {
                    "node_id": node.node_id,
                    "running": node.node_id in alive,
                    "pid": alive.get(node.node_id),
                    "bootstrap": s.bootstrap,
                    "data_dir": str(node.data_dir),
                    "log": str(node.log_file),
                }
                for node, s in zip(nodes, state.nodes if state else [], strict=False)
            ],
        }

    def tail(self, lines: int = 50, node_id: int = 1) -> str:
        """The end of a node's log (node 1: the single broker's)."""
        return self.node(node_id, self.brokers()).tail(lines)
