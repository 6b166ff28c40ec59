"""The local Kafka cluster as its clients find it: the state ``clawstream kafka up`` records in ``<home>/state.json``
(cluster id; per node its ports and pid), which nodes still run, and their address (:meth:`LocalHome.running_bootstrap`,
what ``clawbase.kafka.clients`` falls back to). The launcher is ``clawstream.local_kafka``. The home is
``$CLAWSTREAM_HOME/kafka``; a single node keeps its files there, node N of a cluster in ``<home>/node-N``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawbase.settings import clawstream_home


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


def pid_alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # reap if it is our own exited child (tests start it in-process)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class NodeFiles:
    """Where one node keeps its files under ``root``, and whether its recorded process still runs."""

    def __init__(self, root: Path, node_id: int) -> None:
        self.root, self.node_id = root, node_id
        self.data_dir = root / "data"
        self.log_file = root / "kafka.log"
        self.properties_file = root / "server.properties"

    def our_pid(self, state: NodeState | None) -> int | None:
        """The recorded pid if that process is alive and is *this* node's broker (pids get reused)."""
        if state is None or state.pid is None or not pid_alive(state.pid):
            return None
        try:
            cmd = Path(f"/proc/{state.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return None
        return state.pid if "kafka.Kafka" in cmd and str(self.properties_file) in cmd else None


class LocalHome:
    """A home of the local cluster: its recorded state and which of its nodes run."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = Path(home) if home else clawstream_home() / "kafka"
        self.state_file = self.home / "state.json"

    def node_root(self, node_id: int, brokers: int) -> Path:
        # One node keeps the layout single-broker homes always had (their data dir is reused as it is).
        return self.home if brokers == 1 else self.home / f"node-{node_id}"

    def brokers(self) -> int:
        """The size of the cluster this home holds (1 when it holds none yet)."""
        state = self.read_state()
        return len(state.nodes) if state else 1

    def read_state(self) -> ClusterState | None:
        try:
            return ClusterState.from_json(json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def alive(self, state: ClusterState | None) -> dict[int, int]:
        """node id → pid of each recorded node whose process is alive and is that node's broker."""
        if state is None:
            return {}
        n = len(state.nodes)
        pids = {s.node_id: NodeFiles(self.node_root(i, n), i).our_pid(s) for i, s in enumerate(state.nodes, start=1)}
        return {node_id: pid for node_id, pid in pids.items() if pid is not None}

    def running_bootstrap(self) -> str | None:
        """Bootstrap addresses of this home's cluster if any of its nodes is alive, else None."""
        state = self.read_state()
        return state.bootstrap if self.alive(state) else None
