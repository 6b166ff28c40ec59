"""Docker sandbox backend (docker SDK): one container per rollout, for real deployments.

Container (:func:`container_spec`, the exact ``containers.run`` kwargs; unit-tested, since no Docker engine runs on
the development machines): image ``CLAWSTREAM_SANDBOX_DOCKER_IMAGE`` (python3, node, the harnesses and clawstream
at ``docker_clawstream_root``), kept alive by ``sleep infinity`` under ``--init`` (reaps zombies); host directories
bind-mounted: the workspace at the task's ``mount_dir`` (``/workspace``, or ``/root/.openclaw/workspace`` for
ClawGym-Bench — so its scripts need no rewriting), HOME at ``/home/sandbox``, the grader dir at ``/grader``
(empty until the harness ended). Limits: ``nano_cpus``, ``mem_limit`` = ``memswap_limit`` (no swap), ``pids_limit``,
nofile ulimit, all capabilities dropped, ``no-new-privileges``, a size-capped ``/tmp`` tmpfs.

Network: the container joins only ``docker_network``, created ``internal=True`` (no route out of the host). The
serving proxy must be attached to that network as well and advertise a URL reachable on it (proxy setting
``public_url``, e.g. ``http://clawstream-proxy:8100``): harnesses then reach the proxy and nothing else.

Commands run through ``docker exec`` wrapped in GNU ``timeout -s TERM -k GRACE T`` (it signals the command's whole
process group; exit 124/137 = timed out), with a host-side deadline as a backstop; ``destroy`` force-removes the
container (everything in it dies), removes the host directories and verifies the container is gone.
Requires the ``docker`` Python package (imported lazily).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from producers.sandbox.base import (
    MARKER,
    CleanupReport,
    RunResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    SandboxSettings,
)
from producers.tasks.model import Task

HOME, GRADER = "/home/sandbox", "/grader"
LABEL = "clawstream.sandbox"


def container_spec(settings: SandboxSettings, sandbox_id: str, task: Task, host_root: Path) -> dict[str, Any]:
    """The kwargs of ``client.containers.run`` for one rollout's container (pure)."""
    mb = settings.docker_memory_mb
    return {
        "image": settings.docker_image,
        "command": ["sleep", "infinity"],
        "name": f"clawstream-{sandbox_id}",
        "detach": True,
        "init": True,
        "labels": {LABEL: sandbox_id, "clawstream.worker": f"{socket.gethostname()}:{os.getpid()}"},
        "volumes": {
            str(host_root / "workspace"): {"bind": task.mount_dir, "mode": "rw"},
            str(host_root / "home"): {"bind": HOME, "mode": "rw"},
            str(host_root / "grader"): {"bind": GRADER, "mode": "rw"},
        },
        "working_dir": task.mount_dir,
        "environment": {"HOME": HOME, MARKER: sandbox_id, "LANG": "C.UTF-8"},
        "network": settings.docker_network,
        "nano_cpus": int(settings.docker_cpus * 1e9),
        "mem_limit": f"{mb}m",
        "memswap_limit": f"{mb}m",
        "pids_limit": settings.docker_pids,
        "ulimits": [{"Name": "nofile", "Soft": settings.limit_open_files, "Hard": settings.limit_open_files}],
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "tmpfs": {"/tmp": "rw,size=512m"},
    }


def exec_argv(argv: list[str], timeout_s: float, grace_s: float) -> list[str]:
    return ["timeout", "-s", "TERM", "-k", f"{grace_s:g}", f"{timeout_s:g}", *argv]


class DockerSandbox(Sandbox):
    def __init__(self, sandbox_id: str, host_root: Path, container: Any, client: Any, task: Task,
                 settings: SandboxSettings) -> None:  # fmt: skip
        self.sandbox_id, self.root, self.s = sandbox_id, host_root, settings
        self.container, self.client = container, client
        self.workspace, self.home, self.grader_dir = task.mount_dir, HOME, GRADER
        self.python, self.clawstream_root = settings.docker_python, settings.docker_clawstream_root
        self._mounts = {task.mount_dir: host_root / "workspace", HOME: host_root / "home", GRADER: host_root / "grader"}

    def host_path(self, inside_path: str) -> Path:
        p = PurePosixPath(inside_path)
        for base, host in self._mounts.items():
            if p == PurePosixPath(base) or PurePosixPath(base) in p.parents:
                return host / p.relative_to(base)
        raise SandboxError(f"{inside_path} is not under a mounted directory of sandbox {self.sandbox_id}")

    async def run(
        self, argv: list[str], env: Mapping[str, str], cwd: str, timeout_s: float, *, extra_path: str = ""
    ) -> RunResult:
        full_env = {"HOME": HOME, MARKER: self.sandbox_id, **env}
        if extra_path:
            full_env["PATH"] = f"{extra_path}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        api = self.client.api
        t0 = time.monotonic()

        def work() -> tuple[int | None, bytes, bytes]:
            exec_id = api.exec_create(self.container.id, exec_argv(argv, timeout_s, self.s.kill_grace_s),
                                      environment=full_env, workdir=cwd, stdin=False)["Id"]  # fmt: skip
            out, err = api.exec_start(exec_id, demux=True)
            return api.exec_inspect(exec_id).get("ExitCode"), out or b"", err or b""

        try:
            code, out, err = await asyncio.wait_for(asyncio.to_thread(work), timeout_s + self.s.kill_grace_s + 30)
        except TimeoutError:
            # The backstop: `timeout` inside did not end it; kill the container's processes wholesale.
            await asyncio.to_thread(self.container.kill)
            return RunResult(None, True, time.monotonic() - t0, killed=["SIGKILL"])
        except Exception as exc:  # docker.errors.APIError and friends: the docker package is optional
            raise SandboxError(f"docker exec in {self.sandbox_id} failed: {exc}") from exc
        timed_out = code in (124, 137) and time.monotonic() - t0 >= timeout_s
        killed = (["SIGTERM"] + (["SIGKILL"] if code == 137 else [])) if timed_out else []
        stdout, stderr = out.decode(errors="replace")[-16000:], err.decode(errors="replace")[-16000:]
        return RunResult(None if timed_out else code, timed_out, time.monotonic() - t0, stdout, stderr, killed)

    async def destroy(self) -> CleanupReport:
        report = CleanupReport()
        try:
            await asyncio.to_thread(self.container.remove, force=True)
        except Exception as exc:  # noqa: BLE001 - already gone is fine; anything else is reported below
            if "No such container" not in str(exc) and "404" not in str(exc):
                report.leftover_paths.append(f"container {self.container.id}: {exc}")
        mine = {"label": f"{LABEL}={self.sandbox_id}"}
        left = await asyncio.to_thread(self.client.containers.list, all=True, filters=mine)
        if left:
            report.leftover_paths.append(f"container {self.sandbox_id} still exists")
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        if self.root.exists():
            report.leftover_paths.append(str(self.root))
        return report


class DockerBackend(SandboxBackend):
    def __init__(self, settings: SandboxSettings, client: Any = None) -> None:
        self.s = settings
        self._client = client
        self.root = settings.root or Path(tempfile.gettempdir()) / "clawstream-sandboxes"

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import docker
            except ImportError as exc:
                raise SandboxError("the docker backend needs the 'docker' Python package (pip install docker)") from exc
            try:
                self._client = docker.from_env()
            except Exception as exc:  # docker.errors.DockerException: no engine reachable
                raise SandboxError(f"no Docker engine reachable: {exc}") from exc
        return self._client

    def ensure_network(self) -> None:
        """The internal network sandboxes join (no route out); created once if missing."""
        if not self.client.networks.list(names=[self.s.docker_network]):
            self.client.networks.create(self.s.docker_network, driver="bridge", internal=True,
                                        labels={"clawstream": "sandbox-network"})  # fmt: skip

    async def create(self, sandbox_id: str, task: Task) -> DockerSandbox:
        host_root = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._mkroot()))
        try:
            for sub in ("workspace", "home", "grader"):
                (host_root / sub).mkdir()
            await asyncio.to_thread(self.ensure_network)
            spec = container_spec(self.s, sandbox_id, task, host_root)
            container = await asyncio.to_thread(lambda: self.client.containers.run(**spec))
        except Exception as exc:
            shutil.rmtree(host_root, ignore_errors=True)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot start a container for {sandbox_id}: {exc}") from exc
        box = DockerSandbox(sandbox_id, host_root, container, self.client, task, self.s)
        box.write_files(box.workspace, task.files)
        return box

    def _mkroot(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    async def sweep(self) -> int:
        """Remove containers of dead workers on this host (label ``clawstream.worker`` = host:pid, pid gone)."""
        host = socket.gethostname()
        removed = 0
        for c in await asyncio.to_thread(self.client.containers.list, all=True, filters={"label": LABEL}):
            owner_host, _, pid = str(c.labels.get("clawstream.worker", "")).rpartition(":")
            if owner_host == host and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                await asyncio.to_thread(c.remove, force=True)
                removed += 1
        return removed
