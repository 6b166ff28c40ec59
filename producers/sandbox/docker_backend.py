"""Docker sandbox backend (docker SDK): one container per rollout on a real Docker Engine.

:func:`container_spec` is the exact ``containers.run`` kwargs (image ``clawstream/harnesses``, CPU/memory/pids/nofile
limits, no capabilities, ``no-new-privileges``, a capped ``/tmp``). Files are copied in and out around every command,
never bind-mounted (the worker may itself run in a container). The container joins only an ``internal`` network
with no host address on its bridge; its one peer is the serving proxy (the proxy container in compose, else this
worker's relay container, ``producers.sandbox.relay``). Commands run through ``docker exec`` under GNU ``timeout``
(a harness whose writable layer outgrows ``max_workspace_bytes``: the container restarted, every process killed);
``destroy`` force-removes the container and verifies it is gone; :meth:`DockerBackend.sweep` removes the containers
of workers that are gone (labels ``clawstream.sandbox``, ``clawstream.worker``). The design, in full:
docs/method.md#the-docker-backend. Requires the ``docker`` Python package (imported lazily).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from producers.sandbox.archive import fingerprint, pack, unpack_into
from producers.sandbox.base import (
    MARKER,
    CleanupReport,
    RunResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    file_size_limit,
    over_quota,
    watch_disk,
)
from producers.sandbox.relay import relay_failures
from producers.sandbox.settings import SandboxSettings
from producers.tasks.model import Task

log = logging.getLogger("clawstream.sandbox.docker")

HOME, GRADER = "/home/sandbox", "/grader"
BASE_PROCESSES = 2  # a container at rest: its init (docker-init, `init: True`) and `sleep infinity`
IMAGE_PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the images' PATH
LABEL, WORKER_LABEL, RELAY_LABEL = "clawstream.sandbox", "clawstream.worker", "clawstream.relay"
NO_HOST_ADDRESS = {"com.docker.network.bridge.inhibit_ipv4": "true"}


def process_identity(pid: int | None = None) -> str:
    """``host:pid:start`` of a process (start: clock ticks after boot, /proc/PID/stat field 22): unique over reuse."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_ticks(pid)}"


def _start_ticks(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split()[19]


def owner_alive(identity: str) -> bool | None:
    """Whether the worker named by a ``clawstream.worker`` label still runs; None when it ran on another host."""
    host, _, rest = identity.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return None
    return Path(f"/proc/{pid}").exists() and (not start or _start_ticks(int(pid)) == start)


def container_spec(settings: SandboxSettings, sandbox_id: str, task: Task, worker: str) -> dict[str, Any]:
    """The kwargs of ``client.containers.run`` for one rollout's container (pure)."""
    mb, fsize = settings.docker_memory_mb, file_size_limit(settings)
    ulimits = [{"Name": "nofile", "Soft": settings.limit_open_files, "Hard": settings.limit_open_files}]
    if fsize:  # RLIMIT_FSIZE in bytes (docker passes it to setrlimit as given); docker exec's processes inherit it
        ulimits.append({"Name": "fsize", "Soft": fsize, "Hard": fsize})
    return {
        "image": settings.docker_image,
        "command": ["sleep", "infinity"],
        "name": f"clawstream-{sandbox_id}",
        "detach": True,
        "init": True,
        "labels": {**settings.docker_labels, LABEL: sandbox_id, WORKER_LABEL: worker},
        "working_dir": "/",
        "environment": {"HOME": HOME, MARKER: sandbox_id, "LANG": "C.UTF-8"},
        "network": settings.docker_network,
        "nano_cpus": int(settings.docker_cpus * 1e9),
        "mem_limit": f"{mb}m",
        "memswap_limit": f"{mb}m",
        "pids_limit": settings.docker_pids,
        "ulimits": ulimits,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "tmpfs": {"/tmp": "rw,size=512m"},
    }


def bridge_gateway(client: Any, network: str = "bridge") -> str:
    """The host's address on a Docker network: its gateway, or Docker's default for it (the subnet's first host)."""
    config = (client.networks.get(network).attrs.get("IPAM") or {}).get("Config") or []
    for entry in config:
        if entry.get("Gateway"):
            return str(entry["Gateway"])
        if entry.get("Subnet") and ":" not in entry["Subnet"]:
            return str(next(ipaddress.ip_network(entry["Subnet"]).hosts()))
    raise SandboxError(f"Docker network {network!r} has no IPv4 gateway; set CLAWSTREAM_SANDBOX_DOCKER_HOST_ADDRESS")


def exec_argv(argv: list[str], timeout_s: float, grace_s: float) -> list[str]:
    return ["timeout", "-s", "TERM", "-k", f"{grace_s:g}", f"{timeout_s:g}", *argv]


class DockerSandbox(Sandbox):
    contained = True

    def __init__(
        self,
        sandbox_id: str,
        host_root: Path,
        container: Any,
        client: Any,
        task: Task,
        settings: SandboxSettings,
        proxy_origin: str | None,
    ) -> None:
        self.sandbox_id, self.root, self.settings = sandbox_id, host_root, settings
        self.container, self.client = container, client
        self.workspace, self.home, self.grader_dir = task.mount_dir, HOME, GRADER
        self.python, self.clawstream_root = settings.docker_python, settings.docker_clawstream_root
        self._mounts = {task.mount_dir: host_root / "workspace", HOME: host_root / "home", GRADER: host_root / "grader"}
        self._proxy_origin = proxy_origin
        self._synced: tuple | None = None  # fingerprint of the host copy at the last push/pull
        self.relay: Any = None  # the worker's relay container, whose log records the proxy's lost calls
        self.created_s = int(time.time()) - 1  # the relay's log is read from here on
        self.spec: dict[str, Any] = {}  # the container's ``containers.run`` kwargs (the grader's are made from them)

    def host_path(self, inside_path: str) -> Path:
        p = PurePosixPath(inside_path)
        for base, host in self._mounts.items():
            if p == PurePosixPath(base) or PurePosixPath(base) in p.parents:
                return host / p.relative_to(base)
        raise SandboxError(f"{inside_path} is not under a copied directory of sandbox {self.sandbox_id}")

    def proxy_base_url(self, base_url: str) -> str:
        if self._proxy_origin is None:
            return base_url
        origin, url = urlsplit(self._proxy_origin), urlsplit(base_url)
        return urlunsplit((origin.scheme, origin.netloc, url.path, url.query, url.fragment))

    async def proxy_failures(self) -> list[str]:
        if self.relay is None:
            return []
        return await asyncio.to_thread(self._proxy_failures)

    def _proxy_failures(self) -> list[str]:
        """The relay's upstream failures for this container's address on the sandbox network (unique while it
        lives), logged since it was created."""
        self.container.reload()
        network = self.container.attrs.get("NetworkSettings", {}).get("Networks", {}).get(self.settings.docker_network)
        address = (network or {}).get("IPAddress")
        if not address:
            return []
        text = self.relay.logs(stdout=False, stderr=True, since=self.created_s).decode(errors="replace")
        return relay_failures(text, address)

    # --- copy in / copy out -----------------------------------------------------------------------------------

    def _exec(self, argv: list[str]) -> tuple[int | None, bytes]:
        code, out = self._exec_once(argv)
        if b"OCI runtime exec failed" in out:
            # The container could not start one more process: what the harness left running (a fork bomb's children)
            # holds every pid of its limit. Copying in or out happens between commands, so no work of ours runs
            # there: a restart stops them all (the filesystem stays) and the copy is tried once more. Seen in the
            # limits test: a Python harness's 400 `sleep 60` children outlived it and the grader's copy failed.
            log.warning("sandbox %s cannot start a process (%r): restarting it", self.sandbox_id, out[-200:])
            self.container.restart(timeout=0)
            code, out = self._exec_once(argv)
        return code, out

    def _exec_once(self, argv: list[str]) -> tuple[int | None, bytes]:
        api = self.client.api
        exec_id = api.exec_create(self.container.id, argv, stdin=False)["Id"]
        out = api.exec_start(exec_id)
        return api.exec_inspect(exec_id).get("ExitCode"), out or b""

    def end_leftovers(self) -> int:
        """End every process a finished command left running; how many there were (0: nothing done).

        A command's processes end with it, as in the local backend's pid namespace: a daemon a harness left behind
        would otherwise run on beside the grader (rewriting the answer it grades, or holding every pid of the limit
        so the grader cannot start: a grade turned INFRA_FAILURE). Counted from the host (``docker top``
        needs no pid inside the container), so a full pid limit cannot hide them; the restart kills them all at
        once and keeps the filesystem (``/tmp``'s tmpfs is emptied).
        """
        rows = self.container.top().get("Processes") or []
        left = len(rows) - BASE_PROCESSES
        if left > 0:
            log.info("sandbox %s: %d process(es) outlived the command: restarting the container", self.sandbox_id, left)
            self.container.restart(timeout=0)
        return max(left, 0)

    def push(self) -> None:
        """Make the container's directories equal to the host copy (skipped when it did not change)."""
        now = fingerprint(self._mounts)
        if now == self._synced:
            return
        if self._synced is not None:  # not the first push: the container's copies are replaced, not merged
            code, out = self._exec(["find", *self._mounts, "-mindepth", "1", "-delete"])
            if code != 0:
                raise SandboxError(f"cannot empty the directories of {self.sandbox_id}: {out[-500:]!r}")
        if not self.container.put_archive("/", pack(self._mounts)):
            raise SandboxError(f"copying files into {self.sandbox_id} failed")
        self._synced = now

    def pull(self) -> None:
        """Make the host copy equal to the container's directories."""
        for inside, host in self._mounts.items():
            stream, _stat = self.container.get_archive(inside)
            skipped = unpack_into(b"".join(stream), PurePosixPath(inside).name, host)
            if skipped:
                log.warning(
                    "sandbox %s: %d member(s) of %s not copied out: %s",
                    self.sandbox_id,
                    len(skipped),
                    inside,
                    "; ".join(skipped[:5]),
                )
        self._synced = fingerprint(self._mounts)

    async def disk_bytes(self) -> int:
        """The container's writable layer as the engine measures it (``SizeRw``; ``/tmp`` is a tmpfs of its own)."""

        def size() -> int:
            found = self.client.api.containers(all=True, size=True, filters={"id": self.container.id})
            return int((found[0].get("SizeRw") if found else 0) or 0)

        try:
            return await asyncio.to_thread(size)
        except Exception as exc:  # docker.errors.APIError and friends
            raise SandboxError(f"cannot measure the disk use of {self.sandbox_id}: {exc}") from exc

    async def run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        timeout_s: float,
        *,
        extra_path: str = "",
        max_bytes: int = 0,
    ) -> RunResult:
        full_env = {"HOME": HOME, MARKER: self.sandbox_id, **env}
        if extra_path:
            full_env["PATH"] = f"{extra_path}:{IMAGE_PATH}"
        api = self.client.api

        def work() -> tuple[int | None, bytes, bytes]:
            exec_id = api.exec_create(
                self.container.id,
                exec_argv(argv, timeout_s, self.settings.kill_grace_s),
                environment=full_env,
                workdir=cwd,
                stdin=False,
            )["Id"]
            out, err = api.exec_start(exec_id, demux=True)
            return api.exec_inspect(exec_id).get("ExitCode"), out or b"", err or b""

        try:
            await asyncio.to_thread(self.push)
        except SandboxError:
            raise
        except Exception as exc:  # docker.errors.APIError and friends: the docker package is optional
            raise SandboxError(f"copying files into {self.sandbox_id} failed: {exc}") from exc
        t0 = time.monotonic()
        job = asyncio.ensure_future(
            asyncio.wait_for(asyncio.to_thread(work), timeout_s + self.settings.kill_grace_s + 30)
        )
        watch = (
            asyncio.ensure_future(watch_disk(self, max_bytes, self.settings.disk_check_interval_s))
            if max_bytes
            else None
        )
        quota: str | None = None
        try:
            if watch is not None:
                await asyncio.wait([job, watch], return_when=asyncio.FIRST_COMPLETED)
                if watch.done() and not job.done():
                    # Over its disk quota: every process in the container is stopped at once (the exec ends with it);
                    # the filesystem stays, for the grader.
                    quota = watch.result()
                    await asyncio.to_thread(self.container.restart, timeout=0)
            try:
                code, out, err = await job
            except Exception:
                if quota is None:
                    raise
                code, out, err = None, b"", b""  # the exec ended with the restart: nothing more to learn from it
        except TimeoutError:
            # The backstop: `timeout` inside did not end it; every process of the container is killed by a restart
            # (a bare kill left the container stopped and the grade an INFRA_FAILURE).
            await asyncio.to_thread(self.container.restart, timeout=0)
            return RunResult(None, True, time.monotonic() - t0, killed=["SIGKILL"])
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"docker exec in {self.sandbox_id} failed: {exc}") from exc
        finally:
            for task in (job, watch):
                if task is not None and not task.done():
                    task.cancel()
        duration = time.monotonic() - t0
        stopped = quota is not None
        if not stopped:  # (a quota stop restarted the container already)
            try:
                await asyncio.to_thread(self.end_leftovers)
            except Exception as exc:  # docker.errors.APIError and friends
                raise SandboxError(f"cannot end what the command left running in {self.sandbox_id}: {exc}") from exc
        if max_bytes and quota is None:  # it may have written past the quota since the last measurement, and exited
            quota = over_quota(await self.disk_bytes(), max_bytes)
        try:
            await asyncio.to_thread(self.pull)
        except Exception as exc:
            raise SandboxError(f"copying files out of {self.sandbox_id} failed: {exc}") from exc
        timed_out = code in (124, 137) and duration >= timeout_s and not stopped
        killed = (["SIGTERM"] + (["SIGKILL"] if code == 137 else [])) if timed_out else ["SIGKILL"] if stopped else []
        stdout, stderr = out.decode(errors="replace")[-16000:], err.decode(errors="replace")[-16000:]
        exit_code = None if timed_out or stopped else code
        return RunResult(exit_code, timed_out, duration, stdout, stderr, killed, quota)

    async def run_grader(
        self, argv: list[str], env: Mapping[str, str], cwd: str, timeout_s: float, *, extra_path: str = ""
    ) -> RunResult:
        """The grader in a container of its own (``producers.sandbox.docker_grader``), once nothing of the rollout
        runs: never in the rollout's container, whose binaries the harness could rewrite."""
        from producers.sandbox import docker_grader

        try:
            await asyncio.to_thread(self.end_leftovers)
        except Exception as exc:  # docker.errors.APIError and friends
            raise SandboxError(f"cannot end what the rollout left running in {self.sandbox_id}: {exc}") from exc
        full_env = {"HOME": HOME, **env}
        if extra_path:
            full_env["PATH"] = f"{extra_path}:{IMAGE_PATH}"
        name = f"clawstream-{self.sandbox_id}-grader"
        spec = docker_grader.grader_spec(self.spec, name, self.container.labels)
        timed = exec_argv(argv, timeout_s, self.settings.kill_grace_s)
        return await docker_grader.run_in_grader_container(self, spec, timed, full_env, cwd, timeout_s)

    async def destroy(self) -> CleanupReport:
        report = CleanupReport()
        try:
            await asyncio.to_thread(self.container.remove, force=True)
        except Exception as exc:  # noqa: BLE001 - already gone is fine; anything else is reported below
            if "No such container" not in str(exc) and "404" not in str(exc):
                report.leftover_paths.append(f"container {self.container.id}: {exc}")
        mine = {"label": f"{LABEL}={self.sandbox_id}"}
        left = await asyncio.to_thread(self.client.containers.list, all=True, filters=mine, ignore_removed=True)
        if left:
            report.leftover_paths.append(f"container {self.sandbox_id} still exists")
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        if self.root.exists():
            report.leftover_paths.append(str(self.root))
        return report


class DockerBackend(SandboxBackend):
    def __init__(self, settings: SandboxSettings, client: Any = None) -> None:
        self.settings = settings
        self._client = client
        self.root = settings.root or Path(tempfile.gettempdir()) / "clawstream-sandboxes"
        self.worker = process_identity()
        self._relay: Any = None
        self._proxy_origin: str | None = None
        self._setup_lock = threading.Lock()  # concurrent creates (worker threads) set up network and relay once
        self._network_ready = False

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
        """The internal network sandboxes join (no route out, no host address); created once if missing.

        Docker allows two networks of one name, and a name that matches two cannot be used: creation checks for a
        duplicate (another worker may create it at the same moment), and losing that race is fine."""
        with self._setup_lock:
            if self._network_ready:
                return
            name = self.settings.docker_network
            if not [n for n in self.client.networks.list(names=[name]) if n.name == name]:  # filter: substrings
                try:
                    self.client.networks.create(
                        name,
                        driver="bridge",
                        internal=True,
                        options=NO_HOST_ADDRESS,
                        check_duplicate=True,
                        labels={"clawstream": "sandbox-network"},
                    )
                except Exception as exc:  # docker.errors.APIError 409: created by someone else meanwhile
                    if "already exists" not in str(exc) and "409" not in str(exc):
                        raise
            self._network_ready = True

    def ensure_relay(self) -> str | None:
        """This worker's relay to the host's proxy (started once); the proxy's origin as sandboxes reach it."""
        if not self.settings.docker_proxy_relay:
            return None
        with self._setup_lock:
            if self._relay is None:
                self._start_relay()
        return self._proxy_origin

    def _start_relay(self) -> None:
        host = self.settings.docker_host_address or self._bridge_gateway()
        port_to = self.settings.docker_relay_target_port  # the harness-facing port: the admin listener is not relayed
        name = f"clawstream-relay-{socket.gethostname()}-{os.getpid()}"[:63]
        port = self.settings.docker_relay_port
        for old in self.client.containers.list(all=True, filters={"name": f"^{name}$"}, ignore_removed=True):
            old.remove(force=True)  # a previous incarnation of this pid (a restarted container)
        relay = self.client.containers.run(
            self.settings.docker_image,
            [
                "python3",
                "-m",
                "producers.sandbox.relay",
                "--listen",
                f"0.0.0.0:{port}",
                "--target",
                f"{host}:{port_to}",
                "--max-connections",
                str(self.settings.relay_max_connections),
                "--idle-timeout",
                str(self.settings.relay_idle_timeout_s),
            ],
            name=name,
            detach=True,
            init=True,
            network="bridge",
            labels={**self.settings.docker_labels, RELAY_LABEL: name, WORKER_LABEL: self.worker},
            mem_limit="256m",
            pids_limit=64,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
        )
        self.client.networks.get(self.settings.docker_network).connect(relay, aliases=[name])
        self._relay, self._proxy_origin = relay, f"http://{name}:{port}"
        log.info("relay %s: %s → %s:%s", name, self._proxy_origin, host, port_to)

    def _bridge_gateway(self) -> str:
        return bridge_gateway(self.client)

    async def create(self, sandbox_id: str, task: Task) -> DockerSandbox:
        host_root = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self._mkroot()))
        container = None
        try:
            for sub in ("workspace", "home", "grader"):
                (host_root / sub).mkdir()
            await asyncio.to_thread(self.ensure_network)
            origin = await asyncio.to_thread(self.ensure_relay)
            spec = container_spec(self.settings, sandbox_id, task, self.worker)
            container = await asyncio.to_thread(lambda: self.client.containers.run(**spec))
            box = DockerSandbox(sandbox_id, host_root, container, self.client, task, self.settings, origin)
            box.relay = self._relay if origin is not None else None
            box.spec = spec
            box.write_files(box.workspace, task.files)
            await asyncio.to_thread(box.push)  # the directories exist in the container from the start
        except Exception as exc:
            if container is not None:
                await asyncio.to_thread(container.remove, force=True)
            shutil.rmtree(host_root, ignore_errors=True)
            if isinstance(exc, SandboxError):
                raise
            raise SandboxError(f"cannot start a container for {sandbox_id}: {exc}") from exc
        return box

    def _mkroot(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root

    async def sweep(self) -> int:
        """Remove the containers (sandboxes and relays) of workers of this host that are gone; the number removed."""

        def work() -> int:
            client = self.client  # a SandboxError when docker is missing, before the import below
            from docker.errors import NotFound

            removed = 0
            # ignore_removed: a container removed between docker's list and its inspect of each (its own worker
            # finishing a rollout, another sweeper) is skipped instead of failing the sweep with a 404.
            for c in client.containers.list(all=True, filters={"label": WORKER_LABEL}, ignore_removed=True):
                if owner_alive(str(c.labels.get(WORKER_LABEL, ""))) is False:
                    try:
                        c.remove(force=True)
                    except NotFound:
                        continue  # removed meanwhile by someone else
                    removed += 1
            return removed

        try:
            return await asyncio.to_thread(work)
        except SandboxError:
            raise
        except Exception as exc:
            raise SandboxError(f"sweeping stale containers failed: {exc}") from exc

    async def close(self) -> None:
        if self._relay is not None:
            relay, self._relay = self._relay, None
            await asyncio.to_thread(relay.remove, force=True)
