"""The bubblewrap command line of an isolated local sandbox (pure), and the probe that bubblewrap works here.

Every command of an isolated local sandbox runs as ``bwrap <options> -- <relay launcher> <argv>``: a fresh mount,
pid, network, IPC, UTS and user namespace; an unprivileged uid inside (mapped to the worker's uid outside, so files
the harness writes stay the worker's); an empty root with only the system directories, the Python and harness
installs and clawstream's packages bound read-only; the rollout's workspace (at the task's mount dir), HOME
(``/home/sandbox``) and ``/tmp`` bound read-write at the same inside paths for every rollout; then the root made
read-only. The grader runs in a sandbox of its own (``LocalSandbox.run_grader``): as :func:`grader_uid`, with a
copy of the workspace, HOME read-only and the grader directory (``/grader``), which no rollout command ever sees.
``--proc`` is the new pid namespace's (no other process's ``/proc/*/environ``), ``--die-with-parent`` and the pid
namespace make every process the command started die with it (a ``setsid`` child included), ``--new-session``
keeps it off the worker's terminal. The environment is the one given to the ``bwrap`` process (never its argv, so
no secret shows in ``/proc/*/cmdline``). Network: a new, empty network namespace; the proxy is reached through a
unix socket bound in at :data:`PROXY_SOCKET`, served by the worker and relayed to ``127.0.0.1:<port>`` inside
(``producers.sandbox.relay``).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

HOME, GRADER, TMP = "/home/sandbox", "/grader", "/tmp"
PROXY_SOCKET = "/run/clawstream/proxy.sock"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
MASKED = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")  # root-only files the uid map would expose
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"


def _system(path: str) -> list[str]:
    """Bind a system dir read-only, or re-create it as the symlink it is (merged /usr: /bin -> usr/bin)."""
    p = Path(path)
    if p.is_symlink():
        return ["--symlink", os.readlink(p), path]
    if p.is_dir():
        return ["--ro-bind", path, path]
    return []


def bwrap_argv(
    argv: list[str],
    *,
    binds: Mapping[str, Path],
    read_only: Iterable[str],
    cwd: str,
    uid: int,
    bwrap: str = "bwrap",
    proxy_socket: Path | None = None,
    ro_binds: Mapping[str, Path] | None = None,
) -> list[str]:
    """``bwrap`` options then ``argv``. ``binds``: inside path → host directory, read-write; ``ro_binds``: the same,
    read-only; ``read_only``: host paths bound read-only at the same path (the Python, venv, harness installs,
    clawstream's packages)."""
    out = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(uid), "--gid", str(uid)]
    out += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    for d in SYSTEM_DIRS:
        out += _system(d)
    for m in MASKED:
        if Path(m).exists():
            out += ["--ro-bind", "/dev/null", m]
    for inside, host in sorted(binds.items()):
        out += ["--bind", str(host), inside]
    for inside, host in sorted((ro_binds or {}).items()):
        out += ["--ro-bind", str(host), inside]
    # After the rollout's own dirs, so an install under /tmp (a checkout there) is not hidden by the rollout's /tmp.
    covered = [d for d in SYSTEM_DIRS if Path(d).is_dir() and not Path(d).is_symlink()]
    for path in sorted(set(read_only)):
        if Path(path).exists() and not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
            out += ["--ro-bind", path, path]
            covered.append(path)
    out += ["--dev", "/dev", "--proc", "/proc"]
    if proxy_socket is not None:
        out += ["--ro-bind", str(proxy_socket), PROXY_SOCKET]
    out += ["--remount-ro", "/", "--chdir", cwd, "--", *argv]
    return out


def grader_uid(rollout_uid: int) -> int:
    """The uid a grader runs as inside its sandbox: never the rollout's."""
    return rollout_uid + 1


@functools.cache
def probe(bwrap: str = "bwrap") -> str | None:
    """None when bubblewrap can build a sandbox here, else why not (with the fix)."""
    exe = shutil.which(bwrap)
    if exe is None:
        return f"bubblewrap ({bwrap}) is not on PATH: {INSTALL_HINT}"
    cmd = bwrap_argv(["true"], binds={}, read_only=(), cwd="/", uid=1000, bwrap=exe)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap ({exe}) did not run: {exc}"
    if proc.returncode != 0:
        return (
            f"bubblewrap ({exe}) cannot create a sandbox here (exit {proc.returncode}: {proc.stderr.strip()[-300:]}); "
            "it needs user namespaces (sysctl kernel.unprivileged_userns_clone=1, or a container started with "
            "--privileged / seccomp=unconfined)"
        )
    return None
