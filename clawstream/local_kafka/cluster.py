"""The local Kafka cluster on one host for laptops, tests and CI: one node by default, or a replicated cluster of N
nodes (``--brokers 3``), each a combined broker + controller in its own JVM with its own ports, data and log.

:class:`LocalKafka` provisions (``clawstream.local_kafka.provision``), formats and starts the nodes
(``clawstream.local_kafka.node``), waits until each answers a metadata request listing them all, stops them, and
reports their status. ``up`` reuses running nodes and restarts the dead nodes of a cluster on their data dirs and
ports. Its state is the one clients read (``clawbase.kafka.local_state``); replication follows the size
(``clawbase.kafka.topic_spec.replication_for``).

Run: ``clawstream kafka up [--port N] [--brokers N] | down | status | logs [--node N] [-n N] [-f]``.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from clawbase.errors import KafkaLocalError
from clawbase.kafka.local_state import ClusterState, LocalHome, NodeState, pid_alive
from clawbase.settings import clawstream_home
from clawstream.local_kafka.node import KafkaNode, stop_pids
from clawstream.local_kafka.provision import file_lock, find_java, lib_dir, provision


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


class LocalKafka(LocalHome):
    """Provision, start, stop and inspect the local cluster (one node by default). Paths derive from ``home`` and
    ``jar_cache``."""

    def __init__(self, home: Path | None = None, jar_cache: Path | None = None) -> None:
        super().__init__(home)
        self.jar_cache = Path(jar_cache) if jar_cache else clawstream_home() / "jars"

    # ---- nodes and state ---------------------------------------------------------------------------------------
    def node(self, node_id: int, brokers: int) -> KafkaNode:
        return KafkaNode(self.node_root(node_id, brokers), node_id)

    def nodes(self, brokers: int | None = None) -> list[KafkaNode]:
        """The nodes of a cluster of ``brokers`` (default: the recorded size, else 1)."""
        n = brokers or self.brokers()
        return [self.node(i, n) for i in range(1, n + 1)]

    def _write_state(self, state: ClusterState) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(state), indent=2))
        tmp.replace(self.state_file)

    def active_controller(self) -> int | None:
        """The node id of the active controller (the KRaft quorum's leader), as the live nodes' own Raft state says: the
        leader of the highest epoch any of them recorded in ``__cluster_metadata-0/quorum-state``. A client cannot ask:
        KRaft answers Metadata and DescribeCluster with a random live broker as the "controller". None when no live
        node knows a leader; right after the leader died, the dead one until the others elected anew."""
        state = self.read_state()
        alive = self.alive(state)
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
        with file_lock(self.home / ".lock"):
            previous = self.read_state()
            n = brokers or (len(previous.nodes) if previous else 1)
            alive = self.alive(previous)
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
            java = find_java()
            lib = provision(self.jar_cache, quiet=quiet)
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
                stop_pids([s.pid for s in start if s.pid is not None], grace=5.0)
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
            if s.pid is not None and not pid_alive(s.pid):
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
        with file_lock(self.home / ".lock"):
            state = self.read_state()
            alive = self.alive(state)
            if state is None or not alive:
                return False
            stop_pids(list(alive.values()), grace=grace)
            survivors = [pid for pid in alive.values() if pid_alive(pid)]
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
        state = self.read_state()
        n = len(state.nodes) if state else 1
        nodes = self.nodes(n)
        alive = self.alive(state)
        if n == 1:
            return {
                "running": 1 in alive,
                "pid": alive.get(1),
                "bootstrap": state.bootstrap if state else None,
                "home": str(self.home),
                "data_dir": str(nodes[0].data_dir),
                "formatted": nodes[0].formatted,
                "jars": str(lib_dir(self.jar_cache)),
                "log": str(nodes[0].log_file),
            }
        return {
            "running": len(alive) == n,
            "brokers": n,
            "bootstrap": state.bootstrap if state else None,
            "controller": self.active_controller(),
            "home": str(self.home),
            "formatted": all(node.formatted for node in nodes),
            "jars": str(lib_dir(self.jar_cache)),
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
