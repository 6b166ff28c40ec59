"""The workspace disk quota of a rollout (issue #29), against real processes on the local backend.

A hostile harness writes past ``max_workspace_bytes`` (8 MiB here, measured every 0.2 s): many files spread over the
workspace, HOME and ``/tmp``; one file as fast as it can (RLIMIT_FSIZE stops it at the quota); or files in a
directory it cannot be listed (``chmod 0``-style hiding). Each time the harness is stopped long before its
wall-clock limit, ``RunResult.quota_exceeded`` names the quota, and what the sandbox held on the host (measured here
independently, before ``destroy``) stayed within the quota plus what one measurement period lets through. Through
:func:`producers.sandbox.rollout.execute` with a real proxy (no Kafka), such a rollout is graded as usual and its
lifecycle event's reason starts ``quota_exceeded:`` naming ``max_workspace_bytes``. Every isolation: bubblewrap
(skipped, in CI failed, when it cannot run here) and none.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from producers.harnesses.catalog import ADAPTERS
from producers.proxy.app import Proxy, ProxySettings
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.rollout import RolloutContext, execute
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.cpu import cpu_suite
from schemas.events import RewardStatus, RolloutState
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.integration
TASK = cpu_suite().split("train")[2]
QUOTA = 8 << 20
MIB = 1 << 20

# Many 256 KiB files over the workspace, HOME and /tmp (EXTRA_DIR: another writable dir), ~40 MiB/s; it stops
# by itself at 128 MiB (16x the quota), so a run without the quota fills no disk, then waits for its timeout.
MANY = """
import os, time
open("hello.txt", "w").write("hi")
chunk = b"x" * (256 * 1024)
dirs = [os.getcwd(), os.environ["HOME"], os.environ.get("EXTRA_DIR") or os.environ.get("TMPDIR", "/tmp")]
for i in range(512):
    with open(os.path.join(dirs[i % 3], f"fill-{i}.bin"), "wb") as f:
        f.write(chunk)
    time.sleep(0.005)
time.sleep(600)
"""
# One file, as fast as it can, until the file size limit says no (Python ignores SIGXFSZ: EFBIG), then waits.
ONE = """
import time
open("hello.txt", "w").write("hi")
try:
    with open("big.bin", "wb") as f:
        for _ in range(128):
            f.write(b"x" * (1 << 20))
except OSError as exc:
    print("stopped writing:", exc, flush=True)
time.sleep(600)
"""
# 12 MiB in a directory its owner cannot list (write and search only), then waits.
HIDDEN = """
import os, time
os.mkdir("hidden", 0o300)
for i in range(12):
    with open(f"hidden/{i}.bin", "wb") as f:
        f.write(b"x" * (1 << 20))
time.sleep(600)
"""
SCENARIOS = {"many": (MANY, 24 * MIB), "one": (ONE, MIB), "hidden": (HIDDEN, 6 * MIB)}  # code, allowed overshoot


def held_bytes(root: Path) -> int:
    """What a sandbox directory holds, measured independently of the backend (apparent sizes, every file)."""
    subprocess.run(["chmod", "-R", "u+rwX", str(root)], check=False, capture_output=True)
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(root) for f in files)


def settings(tmp: Path, isolation: str, **kw) -> SandboxSettings:  # noqa: ANN003
    if isolation == "bwrap":
        S.require_bwrap()
    return SandboxSettings(
        root=tmp / "sbx",
        isolation=isolation,
        kill_grace_s=0.5,
        max_workspace_bytes=QUOTA,
        disk_check_interval_s=0.2,
        **kw,
    )


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_a_harness_writing_past_the_quota_is_stopped_and_the_disk_stays_bounded(
    tmp_path: Path, isolation: str, scenario: str
) -> None:
    code, overshoot = SCENARIOS[scenario]
    backend = LocalBackend(settings(tmp_path, isolation))
    box = await backend.create(f"dq-{scenario}-{uuid.uuid4().hex[:8]}", TASK)
    try:
        res = await box.run([box.python, "-c", code], {}, box.workspace, 60, max_bytes=QUOTA)
        held = held_bytes(box.root)
    finally:
        report = await box.destroy()
    assert report.clean, report
    assert res.quota_exceeded is not None, res
    assert res.quota_exceeded.startswith(f"rollout quota exceeded: max_workspace_bytes {QUOTA} "), res
    assert not res.timed_out and res.exit_code is None and res.killed == ["SIGKILL"], res
    assert res.duration_s < 20, res  # stopped by its bytes, not by its 60 s wall clock
    assert QUOTA < held <= QUOTA + overshoot, (held, res)
    if scenario == "one":
        assert "stopped writing" in res.stdout, res  # RLIMIT_FSIZE: no single file past the quota


async def test_under_the_quota_nothing_is_stopped_and_graders_are_not_watched(tmp_path: Path) -> None:
    backend = LocalBackend(settings(tmp_path, "none"))
    box = await backend.create(f"dq-ok-{uuid.uuid4().hex[:8]}", TASK)
    try:
        write = "open('small.bin', 'wb').write(b'x' * (1 << 20))"
        res = await box.run([box.python, "-c", write], {}, box.workspace, 60, max_bytes=QUOTA)
        assert (res.exit_code, res.quota_exceeded, res.killed) == (0, None, []), res
        # A command run without max_bytes (the grader) is never stopped for the quota, even over it.
        res = await box.run([box.python, "-c", HIDDEN.replace("time.sleep(600)", "")], {}, box.workspace, 60)
        assert (res.exit_code, res.quota_exceeded, res.killed) == (0, None, []), res
    finally:
        assert (await box.destroy()).clean


class MemoryPublisher:
    async def publish(self, topic: str, key: str, value: bytes, timeout: float) -> None:
        return None

    def close(self) -> None:
        return None


@asynccontextmanager
async def proxy_without_kafka() -> AsyncIterator[str]:
    """A real proxy (both listeners) in front of the scripted engine, its call events kept nowhere; its admin URL."""
    async with ScriptedEngine(H.tiny_tokenizer(), ["ok"] * 4) as engine:
        cfg = ProxySettings(model=H.tiny_model_dir(), engine_url=engine.url, port=0, admin_token="admin")
        proxy = Proxy(cfg, MemoryPublisher(), "calls", tokenizer=H.tiny_tokenizer())
        runner, admin = web.AppRunner(proxy.app()), web.AppRunner(proxy.admin_app())
        await runner.setup()
        await admin.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            await web.TCPSite(admin, "127.0.0.1", 0).start()
            proxy.public_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            yield f"http://127.0.0.1:{admin.addresses[0][1]}"
        finally:
            await runner.cleanup()
            await admin.cleanup()


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_a_rollout_over_its_disk_quota_is_graded_with_the_quota_as_its_reason(
    tmp_path: Path, isolation: str
) -> None:
    sink = S.ListSink()

    async def resolve(_adapter):  # noqa: ANN001, ANN202
        return "", ""

    async with proxy_without_kafka() as admin_url:
        sandbox = settings(tmp_path, isolation, proxy_url=admin_url, proxy_admin_token="admin")
        ctx = RolloutContext(
            backend=LocalBackend(sandbox),
            proxy=ProxyAdmin(admin_url, "admin"),
            catalog=SuiteCatalog({"native": str(S.NATIVE_SUITE)}),
            adapters={**ADAPTERS, "disk-hog": S.python_adapter("disk-hog", MANY)},
            sink=sink,
            settings=sandbox,
            resolve_exe=resolve,
        )
        out = await execute(S.request("hello", "disk-hog", timeout_s=60), ctx)
    assert out.cleanup is not None and out.cleanup.clean, out.cleanup
    assert [e.state for e in sink.events] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], sink.events
    started, exited = sink.events
    assert exited.reason is not None and exited.reason.startswith("quota_exceeded: "), exited
    assert f"max_workspace_bytes {QUOTA}" in exited.reason and "stopped (SIGKILL)" in exited.reason, exited
    assert exited.exit_code == -9, exited
    assert exited.timestamp_ms - started.timestamp_ms < 20_000, exited  # by its bytes, not its 60 s
    (reward,) = sink.rewards
    assert reward.status == RewardStatus.OK and reward.reward == 1.0, reward  # graded as usual: hello.txt is "hi"
