"""Sandboxes: the interface every backend implements; their settings are ``producers.sandbox.settings``.

A sandbox holds one rollout: a workspace (the task's files), a private HOME for the harness's config files, a
grader directory (filled only after the harness ended, so the harness never sees the grader) and the processes it
runs. Paths handed to harnesses and graders are paths *inside* the sandbox (``workspace``, ``home``,
``grader_dir``); the backend maps them to the host (``host_path``) so the worker can lay out files.

Backends: ``local`` (``producers.sandbox.local_backend``: temporary directory, bubblewrap namespaces, own
session/process group, scrubbed environment, rlimits, kill of the whole group at the timeout) and ``docker``
(``producers.sandbox.docker_backend``: one container per rollout); ``producers.sandbox.worker.make_backend(settings)``
picks one. Pure interface: no Kafka.
"""

from __future__ import annotations

import abc
import asyncio
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from clawbase.errors import ClawstreamError
from producers.sandbox.settings import SandboxSettings
from producers.tasks.model import Task, write_tree

# Environment variable every sandboxed process carries: how cleanup finds a dead worker's leftovers.
MARKER = "CLAWSTREAM_SANDBOX_ID"


class SandboxError(ClawstreamError):
    """A sandbox could not be created, used or destroyed (an infrastructure failure: never scored)."""


@dataclass
class RunResult:
    exit_code: int | None  # None: killed before it exited by itself
    timed_out: bool
    duration_s: float
    stdout: str = ""  # tail
    stderr: str = ""  # tail
    killed: list[str] = field(default_factory=list)  # signals sent, e.g. ["SIGTERM", "SIGKILL"]
    quota_exceeded: str | None = None  # the sandbox held more than its disk quota (``max_bytes``): why; then stopped


@dataclass
class CleanupReport:
    leftover_pids: list[int] = field(default_factory=list)
    leftover_paths: list[str] = field(default_factory=list)
    killed: int = 0

    @property
    def clean(self) -> bool:
        return not self.leftover_pids and not self.leftover_paths


class Sandbox(abc.ABC):
    """One rollout's sandbox. ``workspace``/``home``/``grader_dir`` are paths inside it."""

    sandbox_id: str
    workspace: str
    home: str
    grader_dir: str
    python: str
    clawstream_root: str
    contained: bool = False  # its own isolation (a container, bubblewrap), not a directory + process group on the host

    @abc.abstractmethod
    def host_path(self, inside: str) -> Path:
        """The host path of a path inside the sandbox (under workspace, home or grader_dir)."""

    def write_files(self, base: str, files: Mapping[str, bytes]) -> None:
        write_tree(self.host_path(base), files)

    def write_text(self, inside: str, text: str) -> None:
        target = self.host_path(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    @abc.abstractmethod
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
        """Run a command to completion or kill it (and everything it started) at ``timeout_s``. ``max_bytes`` > 0:
        the sandbox's disk quota (:meth:`disk_bytes`), measured every ``disk_check_interval_s`` while it runs and once
        at its end; over it, the command is killed at once and ``RunResult.quota_exceeded`` says why."""

    async def run_grader(
        self, argv: list[str], env: Mapping[str, str], cwd: str, timeout_s: float, *, extra_path: str = ""
    ) -> RunResult:
        """Run the task's grader, once the rollout's commands ended: out of the rollout's reach where the backend
        can (its processes dead, a snapshot of the workspace, another uid, an output folder of its own); the
        default (no isolation: trusted harnesses) is :meth:`run`."""
        return await self.run(argv, env, cwd, timeout_s, extra_path=extra_path)

    @abc.abstractmethod
    async def disk_bytes(self) -> int:
        """What the sandbox holds on disk now (what ``max_workspace_bytes`` bounds)."""

    def proxy_base_url(self, base_url: str) -> str:
        """The rollout's proxy base URL as the harness inside this sandbox reaches it (default: unchanged)."""
        return base_url

    async def proxy_failures(self) -> list[str]:
        """Upstream failures the worker's relay to the proxy saw for this sandbox (``producers.sandbox.relay``): calls
        the proxy lost. Default: none recorded (the harness reaches the proxy directly)."""
        return []

    @abc.abstractmethod
    async def destroy(self) -> CleanupReport:
        """Kill whatever still runs, remove every file, and report anything that survived."""


class SandboxBackend(abc.ABC):
    @abc.abstractmethod
    async def create(self, sandbox_id: str, task: Task) -> Sandbox:
        """A fresh sandbox with the task's workspace laid out (raises :class:`SandboxError`)."""

    async def sweep(self) -> int:
        """Remove sandboxes left behind by dead workers; the number removed."""
        return 0

    async def close(self) -> None:
        """Release what the backend holds for the worker's lifetime (the docker relay); sandboxes are gone by now."""
        return None


def inside(base: str, *parts: str) -> str:
    return str(PurePosixPath(base, *parts))


def file_size_limit(s: SandboxSettings) -> int:
    """RLIMIT_FSIZE of a sandbox's processes (0: none): ``limit_file_size_mb``, never above ``max_workspace_bytes``,
    so no single file outgrows the disk quota between two measurements."""
    caps = [cap for cap in (s.limit_file_size_mb * 1024 * 1024, s.max_workspace_bytes) if cap > 0]
    return min(caps) if caps else 0


# Bounds of one disk-quota walk: a tree past either is reported as UNMEASURED (over any quota), so a rollout cannot
# stall the worker's walk with millions of entries, nor make it hold a file descriptor per level of a deep tree.
WALK_MAX_ENTRIES = 500_000  # a large node_modules holds ~100k; a walk lists ~70k a second (2 busy cores)
WALK_MAX_DEPTH = 256  # directories open at once along the walked path
UNMEASURED = 1 << 62  # what tree_bytes reports for a tree past its bounds


def over_quota(used: int, max_bytes: int) -> str | None:
    """Why a sandbox holding ``used`` bytes is over its disk quota, or None."""
    if max_bytes and used >= UNMEASURED:
        return (
            f"rollout quota exceeded: max_workspace_bytes {max_bytes} (its sandbox holds too many files to measure: "
            f"over {WALK_MAX_ENTRIES} or nested over {WALK_MAX_DEPTH} directories deep)"
        )
    if max_bytes and used > max_bytes:
        return f"rollout quota exceeded: max_workspace_bytes {max_bytes} (its sandbox holds {used} bytes on disk)"
    return None


async def watch_disk(box: Sandbox, max_bytes: int, every_s: float) -> str:
    """Measure ``box`` every ``every_s`` until it holds more than ``max_bytes``; then return why (runs until then)."""
    while True:
        why = over_quota(await box.disk_bytes(), max_bytes)
        if why is not None:
            return why
        await asyncio.sleep(every_s)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _TooLarge(Exception):
    pass


def _open_dir(name: str, parent: int) -> int | None:
    """A listable fd of the directory ``name`` in ``parent`` (a symlink there is refused, never followed), or None.
    A directory its owner shut (``chmod 0``) is opened again for its owner through its own inode: ``O_PATH``, then
    ``chmod`` of ``/proc/self/fd/N`` (the magic link is that inode, whatever the name now points to)."""
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except PermissionError:
        pass  # the worker is not root and the directory is shut
    except OSError:
        return None  # gone, or no longer a directory (a symlink: ELOOP)
    try:
        handle = os.open(name, os.O_PATH | _DIR, dir_fd=parent)
    except OSError:
        return None
    try:
        st = os.fstat(handle)
        if not stat.S_ISDIR(st.st_mode):
            return None
        proc = f"/proc/self/fd/{handle}"
        os.chmod(proc, stat.S_IMODE(st.st_mode) | 0o700)
        return os.open(proc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(handle)


class _Walk:
    """The running total of one walk: bytes, inodes seen, entries listed."""

    def __init__(self, max_entries: int) -> None:
        self.total, self.entries, self.max_entries = 0, 0, max_entries
        self.seen: set[tuple[int, int]] = set()

    def count(self, st: os.stat_result) -> bool:
        """Add one inode (once); False when it was counted already."""
        if (st.st_dev, st.st_ino) in self.seen:
            return False
        self.seen.add((st.st_dev, st.st_ino))
        blocks = st.st_blocks * 512
        self.total += max(st.st_size, blocks) if stat.S_ISREG(st.st_mode) else blocks
        return True

    def scan(self, fd: int) -> list[str]:
        """Count what directory ``fd`` lists but subdirectories (``fstatat``, links not followed); those, by name."""
        subdirs: list[str] = []
        try:
            listing = os.scandir(fd)
        except OSError:
            return subdirs
        with listing:
            for entry in listing:
                self.entries += 1
                if self.entries > self.max_entries:
                    raise _TooLarge
                try:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        self.count(entry.stat(follow_symlinks=False))
                except OSError:
                    continue
        return subdirs

    def enter(self, name: str, parent: int) -> int | None:
        """Open, count and (when its owner shut it) reopen subdirectory ``name``: its fd, or None (skipped)."""
        fd = _open_dir(name, parent)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if self.count(st):
                if st.st_mode & 0o700 != 0o700:
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)  # this inode, never a path
                return fd
        except OSError:
            pass
        os.close(fd)
        return None


def tree_bytes(root: Path, *, max_entries: int = WALK_MAX_ENTRIES, max_depth: int = WALK_MAX_DEPTH) -> int:
    """Bytes a directory tree holds on disk, links not followed, each inode once: a regular file at the larger of
    its size and its allocated blocks (a sparse file at its size: a copy writes it whole), anything else at its
    blocks. A directory its owner made unreadable or unsearchable (``chmod 0``) is made so again first: the
    sandbox's files are the worker's, and a directory it cannot list would hide its bytes.

    The tree is the rollout's and may change under the walk, so every step is relative to an open directory fd:
    ``openat(O_DIRECTORY | O_NOFOLLOW)``, ``fstat``/``fchmod`` on that fd, listing it by fd; no path is looked up
    twice, so a directory swapped for a symlink mid-walk is skipped, never followed. Past ``max_entries`` listed or
    ``max_depth`` levels: :data:`UNMEASURED`."""
    try:
        top = os.open(root, _DIR)
    except OSError:
        return 0
    walk = _Walk(max_entries)
    stack: list[tuple[int, list[str]]] = [(top, [])]  # the open directories along the walked path, and what is left
    try:
        stack[-1] = (top, walk.scan(top))
        while stack:
            fd, subdirs = stack[-1]
            if not subdirs:
                stack.pop()
                os.close(fd)
                continue
            child = walk.enter(subdirs.pop(), fd)
            if child is None:
                continue
            stack.append((child, []))
            if len(stack) > max_depth:
                raise _TooLarge
            stack[-1] = (child, walk.scan(child))
    except _TooLarge:
        return UNMEASURED
    finally:
        for fd, _ in stack:
            os.close(fd)
    return walk.total
