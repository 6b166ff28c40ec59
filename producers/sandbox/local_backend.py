"""Local sandbox backend: bubblewrap isolation (default), its own session/process group, scrubbed env, rlimits, cleanup.

Layout (under ``CLAWSTREAM_SANDBOX_ROOT``, default ``$TMPDIR/clawstream-sandboxes``)::

    <sandbox_id>-XXXX/  owner.json (worker pid)  workspace/  home/  tmp/  grader/  logs/  grading/ (while grading)

Isolation ``bwrap`` (``SandboxSettings.isolation``): every command runs under bubblewrap (``producers.sandbox.bwrap``:
own mount/pid/net/user namespaces, the rollout's dirs the only writable ones, at the same inside paths for every
rollout — workspace at the task's mount dir, ``/home/sandbox``, ``/tmp`` — and the proxy reached through a unix
socket, ``producers.sandbox.relay``; the grader in a sandbox of its own, :meth:`LocalSandbox.run_grader`);
``none``: the host's paths, network and pid space (trusted harnesses).

Processes: every command starts in a new session (``start_new_session``: its own process group), with an
environment that holds only ``PATH``, ``HOME`` (the sandbox's), ``TMPDIR``, ``LANG``, the marker
``CLAWSTREAM_SANDBOX_ID`` and what the adapter adds — nothing of the worker's (no Kafka or proxy admin secrets).
rlimits (``SandboxSettings.limit_*``; defaults documented there: no address-space cap by default because Node
reserves huge virtual ranges, RLIMIT_DATA 8 GiB as the memory cap) and ``PR_SET_PDEATHSIG`` (the harness dies with
a SIGKILLed worker) are set in the child before exec. Output goes to files (a background child holding a pipe open
cannot block the worker). A harness whose sandbox directory outgrows ``max_workspace_bytes`` gets SIGKILL at once.

Kill: at the timeout SIGTERM to the group, ``kill_grace_s`` later SIGKILL to the group and to every process that
carries the sandbox's marker in its environment (catches children that called ``setsid``). After every command
the rest of its group is killed too (daemons a harness left behind). ``destroy`` kills, removes the directory and
verifies: no process of the sandbox's groups or with its marker (zombies excepted), no directory.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import resource
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit, urlunsplit

from clawbase.settings import clawstream_home
from producers.sandbox import bwrap
from producers.sandbox.base import (
    MARKER,
    CleanupReport,
    RunResult,
    Sandbox,
    SandboxBackend,
    SandboxError,
    file_size_limit,
    inside,
    over_quota,
    tree_bytes,
    watch_disk,
)
from producers.sandbox.relay import RelayServer, unix_server
from producers.sandbox.settings import SandboxSettings
from producers.tasks.model import Task

TAIL = 16_000
GRADING = "grading"  # under a sandbox's root: the grader's copy of the workspace and its /tmp
_PR_SET_PDEATHSIG = 1


def default_path() -> str:
    dirs = [str(Path(sys.executable).parent)]
    node = shutil.which("node")
    if node:
        dirs.append(str(Path(node).parent))
    dirs += ["/usr/local/bin", "/usr/bin", "/bin"]
    return ":".join(dict.fromkeys(dirs))


def _limits(s: SandboxSettings) -> list[tuple[int, int]]:
    mb = 1024 * 1024
    wanted = [
        (resource.RLIMIT_CPU, s.limit_cpu_s),
        (resource.RLIMIT_AS, s.limit_address_space_mb * mb),
        (resource.RLIMIT_DATA, s.limit_data_mb * mb),
        (resource.RLIMIT_NOFILE, s.limit_open_files),
        (resource.RLIMIT_NPROC, s.limit_processes),
        (resource.RLIMIT_FSIZE, file_size_limit(s)),
        (resource.RLIMIT_CORE, 0),
    ]
    out = []
    for res, value in wanted:
        if value > 0 or res == resource.RLIMIT_CORE:
            _soft, hard = resource.getrlimit(res)
            out.append((res, value if hard == resource.RLIM_INFINITY else min(value, hard)))
    return out


def _preexec(limits: list[tuple[int, int]]) -> None:
    # Runs in the child between fork and exec: only async-signal-safe-ish calls.
    for res, value in limits:
        resource.setrlimit(res, (value, value))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _proc_info(pid: int) -> tuple[int, str] | None:
    """(process group, state) of a live pid, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()  # comm may contain spaces and parentheses
    return int(rest[2]), rest[0]


def sandbox_pids(marker: str, pgids: set[int]) -> dict[int, str]:
    """Live processes of a sandbox: in one of its process groups or carrying its marker. pid → state letter."""
    needle = f"{MARKER}={marker}".encode()
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        info = _proc_info(pid)
        if info is None:
            continue
        pgid, state = info
        if pgid in pgids:
            found[pid] = state
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found[pid] = state
    return found


def kill_all(marker: str, pgids: set[int], sig: int = signal.SIGKILL) -> int:
    n = 0
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid, state in sandbox_pids(marker, pgids).items():
        if state != "Z":
            try:
                os.kill(pid, sig)
                n += 1
            except (ProcessLookupError, PermissionError):
                pass
    return n


async def kill_and_wait(marker: str, pgids: set[int], within_s: float) -> tuple[int, set[int]]:
    """SIGKILL a sandbox's processes, again every 50 ms until none is alive or ``within_s`` passed: (how many the first
    round signalled, the pids still alive)."""
    killed = kill_all(marker, pgids)
    deadline = time.monotonic() + within_s
    alive = {p for p, st in sandbox_pids(marker, pgids).items() if st != "Z"}
    while alive and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        kill_all(marker, pgids)
        alive = {p for p, st in sandbox_pids(marker, pgids).items() if st != "Z"}
    return killed, alive


def terminate_inside(marker: str) -> None:
    """SIGTERM to an isolated sandbox's processes other than bubblewrap's own (its SIGKILL ends the namespace)."""
    for pid, state in sandbox_pids(marker, set()).items():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if state != "Z" and comm != "bwrap":
                os.kill(pid, signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass


def _tail(path: Path) -> str:
    """The end of a command's output file: never through a link, never blocking on anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.pread(fd, min(size, TAIL), max(0, size - TAIL)).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def snapshot(src: Path, dest: Path) -> None:
    """Copy a workspace tree the rollout left (its processes dead) for the grader: directories, regular files
    (modes kept) and symlinks (as links); FIFOs, sockets and devices are left out (a FIFO would block the copy)."""

    def copy(s: str, d: str) -> None:
        if stat.S_ISREG(os.lstat(s).st_mode):
            shutil.copy2(s, d, follow_symlinks=False)

    shutil.copytree(src, dest, symlinks=True, copy_function=copy, ignore_dangling_symlinks=True)


class LocalSandbox(Sandbox):
    def __init__(self, sandbox_id: str, root: Path, settings: SandboxSettings, mount_dir: str = "/workspace") -> None:
        self.sandbox_id, self.root, self.settings = sandbox_id, root, settings
        self.isolated = settings.isolation == "bwrap"
        self.contained = self.isolated  # its own isolation: a harness's own sandbox (Codex's bwrap) is not needed
        if self.isolated:
            self.workspace, self.home, self.grader_dir, tmp = mount_dir, bwrap.HOME, bwrap.GRADER, bwrap.TMP
        else:
            self.workspace, self.home = str(root / "workspace"), str(root / "home")
            self.grader_dir, tmp = str(root / "grader"), str(root / "tmp")
        self.tmp = tmp
        self._mounts = {
            self.workspace: root / "workspace",
            self.home: root / "home",
            self.grader_dir: root / "grader",
            tmp: root / "tmp",
        }
        self.python = sys.executable
        self.clawstream_root = str(Path(__file__).resolve().parents[2])
        self.pgids: set[int] = set()
        self._runs = 0
        self._proxy: tuple[str, int] | None = None  # the proxy's host and port, relayed into an isolated sandbox
        self._server: RelayServer | None = None
        self._socket_dir: Path | None = None

    def host_path(self, inside_path: str) -> Path:
        if not self.isolated:
            path = Path(inside_path).resolve()
            if path != self.root and self.root.resolve() not in path.parents:
                raise SandboxError(f"{inside_path} is outside sandbox {self.sandbox_id}")
            return path
        p = PurePosixPath(inside_path)
        for base, host in sorted(self._mounts.items(), key=lambda kv: -len(kv[0])):
            if p == PurePosixPath(base) or PurePosixPath(base) in p.parents:
                path = (host / p.relative_to(base)).resolve()
                if path == self.root.resolve() or self.root.resolve() in path.parents:
                    return path
        raise SandboxError(f"{inside_path} is outside sandbox {self.sandbox_id}")

    def proxy_base_url(self, base_url: str) -> str:
        if not self.isolated:
            return base_url
        url = urlsplit(base_url)
        self._proxy = (url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80))
        netloc = f"127.0.0.1:{self.settings.bwrap_proxy_port}"
        return urlunsplit((url.scheme, netloc, url.path, url.query, url.fragment))

    def env(self, extra: Mapping[str, str], extra_path: str = "") -> dict[str, str]:
        path = self.settings.path or default_path()
        env = {
            "PATH": f"{extra_path}:{path}" if extra_path else path,
            "HOME": self.home,
            "TMPDIR": self.tmp,
            "LANG": "C.UTF-8",
            "USER": "sandbox",
        }
        env.update(extra)
        env[MARKER] = self.sandbox_id  # the adapter cannot remove the cleanup marker
        return env

    def _read_only(self, extra_path: str) -> list[str]:
        """Host paths an isolated command sees read-only: Python, venv, harness installs, clawstream's packages."""
        paths = [sys.prefix, sys.base_prefix, str(Path(sys.executable).resolve().parents[1])]
        paths.append(str(clawstream_home() / "harnesses"))
        root = Path(self.clawstream_root)
        paths += [str(d) for d in root.iterdir() if (d / "__init__.py").is_file()]
        for d in f"{extra_path}:{self.settings.path or default_path()}".split(":"):
            if d:
                paths.append(str(Path(d).resolve()))
        return [p for p in paths + list(self.settings.bwrap_read_only) if p != "/"]

    async def proxy_failures(self) -> list[str]:
        return [] if self._server is None else self._server.relay.failures_seen()

    async def _socket(self) -> Path | None:
        """The unix socket relaying to the proxy (started on first use), or None (no proxy named)."""
        if self._proxy is None:
            return None
        if self._server is None:
            self._socket_dir = Path(tempfile.mkdtemp(prefix="clawstream-px-"))  # short: a socket path is < 108 bytes
            self._server = await unix_server(
                str(self._socket_dir / "proxy.sock"),
                *self._proxy,
                max_connections=self.settings.relay_max_connections,
                idle_timeout_s=self.settings.relay_idle_timeout_s,
            )
        assert self._socket_dir is not None
        return self._socket_dir / "proxy.sock"

    async def _argv(self, argv: list[str], cwd: str, extra_path: str, grading: bool = False) -> list[str]:
        """The command line of a rollout command, or (``grading``) of the grader: its own uid, the workspace's
        snapshot read-write, HOME read-only, a /tmp of its own, the grader directory; no proxy."""
        if not self.isolated:
            return argv
        uid, ro_binds, sock = self.settings.bwrap_uid, {}, None
        if grading:
            uid, graded = bwrap.grader_uid(uid), self.root / GRADING
            binds = {
                self.workspace: graded / "workspace",
                self.tmp: graded / "tmp",
                self.grader_dir: self._mounts[self.grader_dir],
            }
            ro_binds = {self.home: self._mounts[self.home]}
        else:  # the grader directory is never in a rollout command's namespace
            binds = {k: v for k, v in self._mounts.items() if k != self.grader_dir}
            sock = await self._socket()
        if sock is not None:
            relay = str(Path(self.clawstream_root) / "producers" / "sandbox" / "relay.py")
            listen = f"127.0.0.1:{self.settings.bwrap_proxy_port}"
            argv = [self.python, "-I", relay, "--listen", listen, "--target-unix", bwrap.PROXY_SOCKET, "--then", *argv]
        return bwrap.bwrap_argv(
            argv,
            binds=binds,
            ro_binds=ro_binds,
            read_only=self._read_only(extra_path),
            cwd=cwd,
            uid=uid,
            bwrap=self.settings.bwrap_path,
            proxy_socket=sock,
        )

    async def run_grader(
        self, argv: list[str], env: Mapping[str, str], cwd: str, timeout_s: float, *, extra_path: str = ""
    ) -> RunResult:
        """The grader, isolated: every process of the rollout dead first, then a bubblewrap sandbox of its own over a
        copy of the workspace (:func:`snapshot`) as :func:`bwrap.grader_uid`, its outputs in the grader directory,
        which no rollout command had in its namespace. Not isolated (trusted harnesses): :meth:`run`."""
        if not self.isolated:
            return await self.run(argv, env, cwd, timeout_s, extra_path=extra_path)
        _killed, alive = await kill_and_wait(self.sandbox_id, self.pgids, within_s=5.0)
        if alive:
            raise SandboxError(f"sandbox {self.sandbox_id}: processes {sorted(alive)} outlived SIGKILL; not grading")
        graded = self.root / GRADING
        await asyncio.to_thread(shutil.rmtree, graded, True)
        try:
            (graded / "tmp").mkdir(parents=True)
            await asyncio.to_thread(snapshot, self._mounts[self.workspace], graded / "workspace")
            self._mounts[self.grader_dir].chmod(0o700)
            return await self._run(argv, env, cwd, timeout_s, extra_path=extra_path, grading=True)
        finally:
            await asyncio.to_thread(shutil.rmtree, graded, True)

    async def disk_bytes(self) -> int:
        return await asyncio.to_thread(tree_bytes, self.root)  # workspace, HOME, /tmp, grader and the output files

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
        return await self._run(argv, env, cwd, timeout_s, extra_path=extra_path, max_bytes=max_bytes)

    async def _run(
        self,
        argv: list[str],
        env: Mapping[str, str],
        cwd: str,
        timeout_s: float,
        *,
        extra_path: str = "",
        max_bytes: int = 0,
        grading: bool = False,
    ) -> RunResult:
        self._runs += 1
        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        out_path, err_path = logs / f"{self._runs}.out", logs / f"{self._runs}.err"
        host_cwd = self.host_path(cwd)
        full = await self._argv(argv, cwd, extra_path, grading)
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *full,
                    cwd=str(self.root if self.isolated else host_cwd),
                    env=self.env(env, extra_path),  # bwrap passes its own environment on: no secret in its argv
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    preexec_fn=lambda: _preexec(_limits(self.settings)),
                )
            except OSError as exc:
                raise SandboxError(f"cannot start {full[0]}: {exc}") from exc
        self.pgids.add(proc.pid)  # new session: pgid == pid
        killed: list[str] = []
        timed_out = False
        exited = asyncio.ensure_future(proc.wait())
        watch = (
            asyncio.ensure_future(watch_disk(self, max_bytes, self.settings.disk_check_interval_s))
            if max_bytes
            else None
        )
        quota: str | None = None
        try:
            done, _ = await asyncio.wait(
                [exited] + ([watch] if watch else []), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if watch is not None and watch in done and exited not in done:
                # Over its disk quota: killed at once, no grace (it would go on writing meanwhile).
                quota = watch.result()
                killed.append("SIGKILL")
                kill_all(self.sandbox_id, {proc.pid})
            elif not done:
                timed_out = True
                killed.append("SIGTERM")
                if self.isolated:  # to the harness's processes, not bwrap (it would end the pid namespace at once)
                    terminate_inside(self.sandbox_id)
                else:
                    kill_all(self.sandbox_id, {proc.pid}, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), self.settings.kill_grace_s)
                except TimeoutError:
                    killed.append("SIGKILL")
        except asyncio.CancelledError:
            kill_all(self.sandbox_id, {proc.pid})
            raise
        finally:
            for task in (exited, watch):
                if task is not None and not task.done():
                    task.cancel()
        # Whatever the command left running in its group (or marked) dies with it, and is gone when run() returns:
        # SIGKILL is delivered when the process next runs, which under load is not at once.
        await kill_and_wait(self.sandbox_id, {proc.pid}, within_s=5.0)
        if proc.returncode is None:
            await proc.wait()
        if max_bytes and quota is None:  # it may have written past the quota since the last measurement, and exited
            quota = over_quota(await self.disk_bytes(), max_bytes)
        return RunResult(
            exit_code=None if timed_out or killed else proc.returncode,
            timed_out=timed_out,
            duration_s=time.monotonic() - t0,
            stdout=_tail(out_path),
            stderr=_tail(err_path),
            killed=killed,
            quota_exceeded=quota,
        )

    async def destroy(self) -> CleanupReport:
        report = CleanupReport()
        report.killed, alive = await kill_and_wait(self.sandbox_id, self.pgids, within_s=5.0)
        report.leftover_pids = sorted(alive)
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, True)
        await asyncio.to_thread(shutil.rmtree, self.root, True)
        if self.root.exists():
            report.leftover_paths.append(str(self.root))
        return report


class LocalBackend(SandboxBackend):
    def __init__(self, settings: SandboxSettings) -> None:
        """Raises :class:`SandboxError` when isolation is on and bubblewrap cannot build a sandbox here."""
        self.settings = settings
        self.root = settings.root or Path(tempfile.gettempdir()) / "clawstream-sandboxes"
        if settings.isolation == "bwrap" and (why := bwrap.probe(settings.bwrap_path)):
            raise SandboxError(
                f"local sandboxes cannot be isolated: {why}. To run without isolation (trusted harnesses only: a "
                "rollout can then read other rollouts' and the worker's secrets), pass --unsafe-no-isolation or set "
                "CLAWSTREAM_SANDBOX_ISOLATION=none"
            )

    async def create(self, sandbox_id: str, task: Task) -> LocalSandbox:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix=f"{sandbox_id}-", dir=self.root))
            (root / "owner.json").write_text(json.dumps({"pid": os.getpid(), "sandbox_id": sandbox_id}))
            for sub in ("workspace", "home", "tmp", "grader", "logs"):
                (root / sub).mkdir()
            box = LocalSandbox(sandbox_id, root, self.settings, task.mount_dir)
            box.write_files(box.workspace, task.files)
        except OSError as exc:
            raise SandboxError(f"cannot create sandbox {sandbox_id} under {self.root}: {exc}") from exc
        return box

    async def sweep(self) -> int:
        """Remove sandboxes whose owning worker process is gone (killed mid-rollout): processes, then files."""
        if not self.root.is_dir():
            return 0
        removed = 0
        for box in self.root.iterdir():
            try:
                owner = json.loads((box / "owner.json").read_text())
            except (OSError, ValueError):
                continue
            if Path(f"/proc/{owner['pid']}").exists():
                continue
            kill_all(str(owner["sandbox_id"]), set())
            await asyncio.to_thread(shutil.rmtree, box, True)
            removed += 1
        return removed


__all__ = ["LocalBackend", "LocalSandbox", "MARKER", "default_path", "inside", "kill_all", "sandbox_pids"]
