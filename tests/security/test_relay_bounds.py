"""The worker's relay to the proxy (``producers.sandbox.relay``), one unix socket per isolated sandbox, attacked the
way a rollout can: far more connections than any harness opens, held open; an idle connection never closed. The
worker's file descriptors stay bounded, a neighbour sandbox's calls still go through, an idle connection is closed
after ``idle_timeout_s`` and closing the relay (the sandbox's destroy) leaves none of its connections open. A real
upstream HTTP server, real sockets, the attacker in its own process (as in a sandbox)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from producers.sandbox.relay import unix_server
from producers.sandbox.settings import SandboxSettings

CAP = 16
ATTACK = 600  # connections the attacker opens and holds: 37x the cap

ATTACKER = """
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
held, waiting = [], 0
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)  # a full backlog answers EAGAIN instead of blocking
    try:
        s.connect(sys.argv[1])
    except BlockingIOError:
        waiting += 1
        s.close()
        continue
    held.append(s)
print("ready", len(held), waiting, flush=True)
sys.stdin.read()  # hold them until told
"""


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def sockets() -> int:
    """This process's open sockets (not the pipes to the attacker)."""
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return found


@pytest.fixture
async def upstream() -> AsyncIterator[int]:
    """A real HTTP server: ``/`` answers at once, ``/stream`` sends a chunk every 0.1 s for 1.2 s."""

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(12):
            await asyncio.sleep(0.1)
            await resp.write(f"chunk{i}\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_get("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port
    finally:
        await runner.cleanup()


@pytest.fixture
def sockdir() -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cs-relay-") as d:  # short: a socket path is < 108 bytes
        yield Path(d)


async def get(sock: Path, path: str = "/") -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(f"GET {path} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


class Peak:
    """The most fds this process held, sampled every few milliseconds from a thread (the event loop is busy)."""

    def __init__(self) -> None:
        self.peak, self._stop = fds(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, fds())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


async def settle(within_s: float = 5.0) -> int:
    """The fd count once it stopped changing (the relay worked through the attacker's backlog)."""
    loop = asyncio.get_running_loop()
    deadline, last = loop.time() + within_s, -1
    while loop.time() < deadline:
        now = fds()
        if now == last:
            return now
        last = now
        await asyncio.sleep(0.25)
    return fds()


async def test_a_connection_flood_keeps_the_workers_fds_bounded_the_neighbour_served_and_none_left_on_close(
    upstream: int, sockdir: Path
) -> None:
    victim = await unix_server(str(sockdir / "a.sock"), "127.0.0.1", upstream, max_connections=CAP)
    neighbour = await unix_server(str(sockdir / "b.sock"), "127.0.0.1", upstream, max_connections=CAP)
    try:
        assert b"200 OK" in await get(sockdir / "b.sock")
        baseline = await settle()
        baseline_sockets = sockets()
        peak = Peak()
        attacker = subprocess.Popen(
            [sys.executable, "-c", ATTACKER, str(sockdir / "a.sock"), str(ATTACK)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = await asyncio.wait_for(asyncio.to_thread(attacker.stdout.readline), 60)  # type: ignore[union-attr]
            assert line.startswith("ready")
            held = await settle()
            answer = await get(sockdir / "b.sock")  # the neighbour, while the flood is held open
            top = peak.stop()
            bound = 3 * CAP + 24  # per relayed connection: the relay's two ends and the upstream server's one
            assert top - baseline <= bound, f"{ATTACK} connections took the worker from {baseline} to {top} fds"
            assert held - baseline <= bound
            assert b"200 OK" in answer and answer.endswith(b"ok")
            victim.close()  # what the sandbox's destroy does
            await victim.wait_closed()
            await settle()
            left = sockets() - baseline_sockets
            assert left <= 0, f"{left} sockets still held after the relay was closed"
        finally:
            peak.stop()
            attacker.kill()
            attacker.wait()
        assert b"200 OK" in await get(sockdir / "b.sock")
    finally:
        victim.close()
        neighbour.close()


async def test_an_idle_connection_is_closed_and_a_slow_stream_is_not(upstream: int, sockdir: Path) -> None:
    server = await unix_server(str(sockdir / "c.sock"), "127.0.0.1", upstream, idle_timeout_s=0.4)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sockdir / "c.sock"))
        try:  # connected, never a byte sent: closed by the relay (the bound is generous, the timeout small)
            assert await asyncio.wait_for(reader.read(), 20) == b""
        finally:
            writer.close()
        body = await get(sockdir / "c.sock", "/stream")  # 1.2 s long, never 0.4 s without a byte
        assert b"200 OK" in body and b"chunk11" in body
    finally:
        server.close()


def test_the_relay_limits_are_settings_with_sane_defaults() -> None:
    import pydantic

    s = SandboxSettings()
    assert 16 <= s.relay_max_connections <= 256
    assert s.relay_idle_timeout_s > 900  # the proxy's engine_timeout_s: a non-streaming call is silent that long
    for field, bad in (("relay_max_connections", 0), ("relay_idle_timeout_s", 0)):
        with pytest.raises(pydantic.ValidationError, match=field):
            SandboxSettings(**{field: bad})


def test_the_workers_open_files_limit_is_raised_to_its_hard_limit() -> None:
    code = (
        "import resource\n"
        "from producers.sandbox.relay import raise_open_files_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "assert raise_open_files_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})


INSIDE = """
import socket, sys, time
from urllib.parse import urlsplit
u = urlsplit(sys.argv[1])
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((u.hostname, u.port))
    except BlockingIOError:
        pass  # in progress: accepted or queued later
    except OSError:
        s.close()
        continue
    held.append(s)
open("ready", "w").write(str(len(held)))
time.sleep(60)
"""


async def test_a_flood_from_inside_an_isolated_sandbox_is_capped_and_its_destroy_releases_it(
    upstream: int, tmp_path: Path
) -> None:
    """The worker's path end to end: the local backend's relay for a bubblewrap sandbox, its settings, its destroy."""
    from producers.sandbox.local_backend import LocalBackend
    from producers.tasks.cpu import cpu_suite
    from tests.support import sandbox_helpers

    sandbox_helpers.require_bwrap()
    settings = SandboxSettings(root=tmp_path / "sbx", kill_grace_s=0.5, relay_max_connections=CAP)
    backend = LocalBackend(settings)
    task = cpu_suite().split("train")[2]
    box, neighbour = await backend.create("flood-a", task), await backend.create("flood-b", task)
    try:
        url, other = (b.proxy_base_url(f"http://127.0.0.1:{upstream}/") for b in (box, neighbour))
        probe = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=20).read().decode())"
        first = await neighbour.run([neighbour.python, "-c", probe, other], {}, neighbour.workspace, 60)
        assert first.stdout.strip() == "ok", first
        baseline, baseline_sockets = await settle(), sockets()
        peak = Peak()
        flood = asyncio.create_task(box.run([box.python, "-c", INSIDE, url, str(ATTACK)], {}, box.workspace, 90))
        try:
            ready = box.host_path(box.workspace) / "ready"
            for _ in range(600):  # the sandbox starts (a second or two), then opens its connections
                if ready.exists() or flood.done():
                    break
                await asyncio.sleep(0.1)
            assert ready.exists(), await flood
            res = await neighbour.run([neighbour.python, "-c", probe, other], {}, neighbour.workspace, 60)
            held = await settle()
            top = peak.stop()
            assert res.stdout.strip() == "ok", res
            bound = 3 * (CAP + 1) + 24  # the neighbour's call too
            assert top - baseline <= bound, f"a flood inside the sandbox took the worker from {baseline} to {top} fds"
            assert held - baseline <= bound
        finally:
            peak.stop()
            report = await box.destroy()
        assert report.clean, report
        await flood
        await settle()
        left = sockets() - baseline_sockets
        assert left <= 0, f"{left} sockets still held after the sandbox was destroyed"
    finally:
        await neighbour.destroy()
