"""The local backend's bubblewrap isolation, against real processes: two sandboxes side by side, attacked from one.

Each test sets up two sandboxes of the local backend (``SandboxSettings.isolation`` from the environment: bwrap by
default) and shows one hole of docs/security.md closed: another rollout's and the worker's secrets in
``/proc/*/environ``, writing into another rollout's workspace, a ``setsid`` child outliving ``destroy()``, paths
that differ between rollouts (the engine's prefix cache misses), writes outside the rollout's own dirs, and network
other than the proxy. Each fails with ``CLAWSTREAM_SANDBOX_ISOLATION=none`` (checked by hand; docs/security.md).
Skips (in CI: fails) when bubblewrap cannot run here. No Kafka.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from clawbase.settings import clawstream_home
from producers.sandbox.local_backend import LocalBackend, LocalSandbox
from producers.sandbox.settings import SandboxSettings
from producers.tasks.cpu import cpu_suite
from tests.support import sandbox_helpers as S

pytestmark = pytest.mark.integration
TASK = cpu_suite().split("train")[2]


@pytest.fixture
async def boxes(tmp_path: Path) -> AsyncIterator[tuple[LocalSandbox, LocalSandbox]]:
    S.require_bwrap()
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", kill_grace_s=0.5))
    tag = uuid.uuid4().hex[:8]
    a = await backend.create(f"iso-a-{tag}", TASK)
    b = await backend.create(f"iso-b-{tag}", TASK)
    try:
        yield a, b
    finally:
        for box in (a, b):
            report = await box.destroy()
            assert report.clean, report


async def _sh(box: LocalSandbox, script: str, env: dict[str, str] | None = None, timeout: float = 30) -> str:
    res = await box.run(["sh", "-c", script], env or {}, box.workspace, timeout)
    assert not res.timed_out, res
    return res.stdout


async def test_proc_environ_hides_other_rollouts_and_the_worker(boxes) -> None:
    a, b = boxes
    worker_secret, b_secret = f"worker-{uuid.uuid4().hex}", f"rollout-b-{uuid.uuid4().hex}"
    # The worker: a process started with the secret in its environment (a variable set later in this process does
    # not show in its /proc/PID/environ, which holds the environment it was started with).
    worker = await asyncio.create_subprocess_exec(
        "sleep", "30", env={**os.environ, "CLAWSTREAM_KAFKA_SASL_PASSWORD": worker_secret}
    )
    holder = asyncio.create_task(_sh(b, "sleep 20", {"ROLLOUT_B_API_KEY": b_secret}))  # B is running meanwhile
    await asyncio.sleep(1.0)
    reader = (
        "import glob, sys\n"
        "found = set()\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        data = open(path, 'rb').read().decode(errors='replace')\n"
        "    except OSError:\n"
        "        continue\n"
        "    found |= {needle for needle in sys.argv[1:] if needle in data}\n"
        "print(sorted(found))\n"
    )
    try:
        res = await a.run([a.python, "-c", reader, worker_secret, b_secret], {}, a.workspace, 30)
    finally:
        holder.cancel()
        worker.kill()
        await asyncio.gather(holder, worker.wait(), return_exceptions=True)
    assert res.exit_code == 0, res
    assert res.stdout.strip() == "[]", f"rollout A read secrets from /proc/*/environ: {res.stdout}"


async def test_cannot_write_another_rollouts_workspace(boxes) -> None:
    a, b = boxes
    victim = b.host_path(b.workspace) / "victim.txt"
    victim.write_text("original\n")
    target = b.host_path(b.workspace)  # the host path of B's workspace, as an attacker in A would guess it
    await _sh(a, f"echo pwned > {target}/victim.txt; echo pwned > {target}/planted.txt; true")
    assert victim.read_text() == "original\n"
    assert not (target / "planted.txt").exists()


async def test_setsid_child_dies_with_destroy(tmp_path: Path) -> None:
    S.require_bwrap()
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", kill_grace_s=0.5))
    box = await backend.create(f"iso-s-{uuid.uuid4().hex[:8]}", TASK)
    unique = f"0.{uuid.uuid4().int % 10**9:09d}"  # `sleep 1000 0.NNN`: a unique argument to find it by
    try:
        await _sh(box, f"setsid -f env -i sleep 1000 {unique}; sleep 0.3")
        report = await box.destroy()
        await asyncio.sleep(0.5)
        survivors = S.processes_with_arg(unique)
        assert survivors == [], f"setsid child survived destroy(): {survivors}"
        assert report.clean, report
    finally:
        for pid in S.processes_with_arg(unique):
            os.kill(pid, signal.SIGKILL)


async def test_same_paths_inside_for_every_rollout(boxes) -> None:
    a, b = boxes
    script = 'echo "$(pwd) $HOME $TMPDIR"'
    seen_a, seen_b = await _sh(a, script), await _sh(b, script)
    assert seen_a == seen_b, (seen_a, seen_b)
    assert (a.workspace, a.home, a.grader_dir) == (b.workspace, b.home, b.grader_dir)
    assert seen_a.split()[0] == TASK.mount_dir


async def test_no_writes_outside_own_dirs(boxes) -> None:
    a, _b = boxes
    name = f"h1-escape-{uuid.uuid4().hex[:8]}"
    repo = Path(a.clawstream_root)
    sandbox_root = a.root.parent  # where every rollout's directory lives
    targets = [repo / name, repo / "producers" / name, clawstream_home() / name, sandbox_root / name, Path(sys.prefix)]
    targets[-1] = Path(sys.prefix) / name
    try:
        script = "; ".join(f"echo x > {t} 2>/dev/null" for t in targets) + "; echo ok > $HOME/h; echo ok > /tmp/t; true"
        await _sh(a, script)
        written = [str(t) for t in targets if t.exists()]
        assert written == [], f"rollout wrote outside its dirs: {written}"
        assert (a.host_path(a.home) / "h").read_text() == "ok\n"  # its own HOME and /tmp stay writable
        assert (a.root / "tmp" / "t").read_text() == "ok\n"
    finally:
        for t in targets:
            t.unlink(missing_ok=True)


async def test_network_reaches_only_the_proxy(boxes) -> None:
    a, _b = boxes

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"proxy:" + await reader.readline())
        await writer.drain()
        writer.close()

    proxy = await asyncio.start_server(echo, "127.0.0.1", 0)
    other = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy_port, other_port = (s.sockets[0].getsockname()[1] for s in (proxy, other))
    inside_url = a.proxy_base_url(f"http://127.0.0.1:{proxy_port}/r/rid")
    probe = (
        "import socket, sys\n"
        "from urllib.parse import urlsplit\n"
        "u = urlsplit(sys.argv[1])\n"
        "def ask(host, port):\n"
        "    try:\n"
        "        with socket.create_connection((host, port), timeout=5) as c:\n"
        "            c.sendall(b'hi\\n')\n"
        "            return c.recv(100).decode()\n"
        "    except OSError as exc:\n"
        "        return type(exc).__name__\n"
        "print(ask(u.hostname, u.port), ask('127.0.0.1', int(sys.argv[2])))\n"
    )
    async with proxy, other:
        res = await a.run([a.python, "-c", probe, inside_url, str(other_port)], {}, a.workspace, 30)
    assert res.exit_code == 0, res
    via_proxy, direct = res.stdout.split()
    assert via_proxy == "proxy:hi", res
    assert direct != "proxy:hi", f"a host service other than the proxy answered: {res.stdout}"
