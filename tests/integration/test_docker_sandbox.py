"""The docker sandbox backend on a real Docker Engine: one container per rollout, only the proxy reachable.

* a REAL harness (Claude Code, Codex) from the sandbox image runs a native task in a container through the serving
  proxy (reached through the worker's relay) and the task's grader scores it 1.0 inside the container;
* from inside a sandbox the proxy answers, while a host service listening on all interfaces, a second port on the
  proxy's own address and a container on Docker's default bridge are all unreachable;
* the wall-clock timeout, the memory limit and the pids limit end a rollout with the statuses the local backend gives
  (TIMED_OUT; HARNESS_EXITED with the kill's or the failure's exit code) within the timeout + 5 s;
* a process the harness leaves running (a daemon writing the answer once the grader's files appear) is ended with
  the command, before grading: the rollout is graded on what the harness wrote;
* a harness writing past the workspace disk quota (many files over the container's writable layer, or one file as
  fast as it can) is stopped within seconds and the rollout graded, its reason ``quota_exceeded: …``;
* a SIGKILLed worker's containers (its sandbox and its relay) are swept by the next worker that starts.

Needs the engine and the image ``clawstream/harnesses:latest`` (built once by ``compose/build-images.sh``; see
tests/support/docker_images.py): skipped with the reason when either is missing, unless CI=true (then a failure).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import create_topics
from clawbase.settings import KafkaSettings
from producers.harnesses.catalog import ADAPTERS
from producers.sandbox.docker_backend import WORKER_LABEL, DockerBackend, bridge_gateway
from producers.sandbox.settings import SandboxSettings
from producers.sandbox.worker import SandboxWorker
from producers.tasks.catalog import SuiteCatalog
from schemas.events import RewardStatus, RolloutState
from schemas.topics import CATALOG
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.docker_images import ensure_images, unavailable
from tests.support.proxy_server import admin_url, running_proxy
from tests.support.sandbox_stack import assert_solved_by_harness, by_rollout, run_requests
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = [pytest.mark.integration, pytest.mark.provisioned("docker")]

IMAGE = "clawstream/harnesses:latest"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine() -> Any:
    """The docker SDK's client of the engine, with the sandbox image built from the working tree."""
    ensure_images("harnesses")
    try:
        import docker

        return docker.from_env()
    except Exception as exc:  # docker.errors.DockerException
        unavailable(f"the docker SDK cannot reach the engine: {exc}")


@pytest.fixture
def network(engine: Any, group_id: str) -> Any:
    """A sandbox network of this test; removed with every container of it afterwards."""
    name = f"cs-test-{group_id}"
    yield name
    for c in engine.containers.list(all=True, filters={"network": name}, ignore_removed=True):
        c.remove(force=True)
    for n in engine.networks.list(names=[name]):
        n.remove()


def settings_for(url: str, network: str, tmp: Path, group_id: str, **kw: Any) -> SandboxSettings:
    return SandboxSettings(
        backend="docker",
        proxy_url=admin_url(url),  # the worker, on the host, reaches the admin listener on 127.0.0.1
        proxy_admin_token="admin",
        docker_relay_target_port=int(url.rsplit(":", 1)[1]),  # the relay forwards to the harness-facing port
        group_id=group_id,
        root=tmp / "sandboxes",
        session_timeout_ms=6000,
        publish_timeout_s=15,
        docker_image=IMAGE,
        docker_network=network,
        docker_cpus=1.0,
        **{"concurrency": 2, "suites": {"native": str(S.NATIVE_SUITE)}, "docker_memory_mb": 1024, **kw},
    )


@asynccontextmanager
async def docker_stack(
    engine: Any, kafka, group_id: str, tmp: Path, network: str, responder, adapters: dict | None = None, **kw: Any
) -> AsyncIterator[dict]:
    """Scripted engine + real proxy on the docker bridge's address + one in-process worker with the docker backend."""
    async with (
        ScriptedEngine(H.tiny_tokenizer(), responder) as scripted,
        running_proxy(kafka, scripted.url, host=bridge_gateway(engine), keepalive_s=1.0) as (proxy, url),
    ):
        settings = settings_for(url, network, tmp, group_id, **kw)
        worker = SandboxWorker(settings, kafka, adapters=adapters or ADAPTERS)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield {"worker": worker, "url": url, "settings": settings, "proxy": proxy}
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 90) == 0


def containers_of(client: Any, identity_prefix: str) -> list[Any]:
    # ignore_removed: the worker being watched removes containers while docker-py inspects the listed ones (a 404).
    return [
        c
        for c in client.containers.list(all=True, filters={"label": WORKER_LABEL}, ignore_removed=True)
        if str(c.labels.get(WORKER_LABEL, "")).startswith(identity_prefix)
    ]


# --- a real harness in a container ------------------------------------------------------------------------------


def harness_responder(name: str):
    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # title / side call
            return '{"title": "Create hello file"}'
        if "<tool_response>" in prompt_text:
            return "Done: hello.txt contains hi."
        assert "/workspace" in prompt_text, "the harness prompt does not name the container's workspace"
        if name == "claude-code":
            return tool_call_text("Write", {"file_path": "/workspace/hello.txt", "content": "hi"})
        return tool_call_text("exec_command", {"cmd": "printf hi > hello.txt", "workdir": "/workspace"})

    return respond


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["claude-code", pytest.param("codex", marks=pytest.mark.long)])  # one is the kind
async def test_real_harness_runs_in_a_container_through_the_proxy(
    engine, kafka_settings, group_id, tmp_path, network, name: str
) -> None:
    async with docker_stack(engine, kafka_settings, group_id, tmp_path, network, harness_responder(name)) as st:
        req = S.request("hello", name, rollout_id=f"docker-{name}", timeout_s=180)
        events, rewards = await run_requests(kafka_settings, [req], timeout=300)
        me = st["worker"].ctx.backend.worker
        assert containers_of(engine, me) and all(c.labels.get("clawstream.relay") for c in containers_of(engine, me))
    assert_solved_by_harness(events, rewards, req.rollout_id)
    assert containers_of(engine, me) == [], "the sandbox or the relay outlived the worker"
    assert not any((tmp_path / "sandboxes").iterdir())


# --- only the proxy is reachable --------------------------------------------------------------------------------

PROBE = """
import json, socket, sys, urllib.error, urllib.request
targets = json.loads(sys.argv[1])
out = {}
for name, (host, port) in targets.items():
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); out[name] = "connected"
    except OSError as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
    finally:
        s.close()
with urllib.request.urlopen(sys.argv[2] + "/healthz", timeout=10) as resp:
    out["proxy_http"] = resp.status
try:  # the admin API's /metrics is on the admin listener, not here
    out["proxy_metrics"] = urllib.request.urlopen(sys.argv[2] + "/metrics", timeout=10).status
except urllib.error.HTTPError as exc:
    out["proxy_metrics"] = exc.code
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
async def test_a_sandbox_reaches_the_proxy_and_nothing_else(
    engine, kafka_settings, group_id, tmp_path, network
) -> None:
    gateway = bridge_gateway(engine)
    # Host services a sandbox must not reach: one on all interfaces, one on the proxy's own address.
    open_all, open_gw = socket.create_server(("0.0.0.0", 0)), socket.create_server((gateway, 0))
    peer = engine.containers.run(
        IMAGE,
        ["sleep", "300"],
        detach=True,
        network="bridge",
        labels={"clawstream.test": group_id},
        name=f"cs-peer-{group_id}",
    )
    try:
        peer.reload()
        peer_ip = peer.attrs["NetworkSettings"]["Networks"]["bridge"]["IPAddress"]
        async with running_proxy(kafka_settings, "http://127.0.0.1:9", host=gateway) as (_proxy, url):
            backend = DockerBackend(settings_for(url, network, tmp_path, group_id))
            task = SuiteCatalog({"native": str(S.NATIVE_SUITE)}).task("native", "hello")
            box = await backend.create("probe-" + group_id, task)
            try:
                targets = {
                    "host_all_interfaces": [gateway, open_all.getsockname()[1]],
                    "host_second_port": [gateway, open_gw.getsockname()[1]],
                    "peer_container": [peer_ip, 22],
                    "peer_container_http": [peer_ip, 8100],
                }
                relay_origin = box.proxy_base_url(url + "/r/x").rsplit("/r/x", 1)[0]
                result = await box.run(
                    ["python3", "-c", PROBE, json.dumps(targets), relay_origin], {}, "/workspace", 60
                )
            finally:
                report = await box.destroy()
                await backend.close()
    finally:
        peer.remove(force=True)
        open_all.close()
        open_gw.close()
    assert result.exit_code == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen.pop("proxy_http") == 200, seen  # the proxy answered through the relay
    assert seen.pop("proxy_metrics") == 404, seen  # its admin listener is not relayed
    assert all(v != "connected" for v in seen.values()), seen
    assert report.clean, report


# --- limits and the timeout -------------------------------------------------------------------------------------

HANG = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
HOG = "b = []\nwhile True: b.append(bytearray(64 << 20))"
FORK = (
    "import subprocess\nps = [subprocess.Popen(['sleep', '60']) for _ in range(400)]\n"
    "open('hello.txt', 'w').write('hi')"
)


@pytest.mark.timeout(420)
async def test_timeout_and_limits_end_rollouts_with_their_status(
    engine, kafka_settings, group_id, tmp_path, network
) -> None:
    adapters = {
        **ADAPTERS,
        "hang": S.python_adapter("hang", HANG),
        "hog": S.python_adapter("hog", HOG),
        "fork": S.python_adapter("fork", FORK),
    }
    timeout = 6.0
    async with docker_stack(
        engine,
        kafka_settings,
        group_id,
        tmp_path,
        network,
        S.agent_responder(),
        adapters,
        docker_memory_mb=256,
        docker_pids=64,
        kill_grace_s=1.0,
    ) as st:
        reqs = [
            S.request("hello", h, rollout_id=f"lim-{h}-{group_id}", timeout_s=timeout)
            for h in adapters
            if h in ("hang", "hog", "fork")
        ]
        events, rewards = await run_requests(kafka_settings, reqs, timeout=240)
        me = st["worker"].ctx.backend.worker
    ev, rw = by_rollout(events, rewards)
    for req in reqs:
        started, end = ev[req.rollout_id][0], ev[req.rollout_id][-1]
        assert started.state == RolloutState.STARTED, ev[req.rollout_id]
        # Ended long before the hang's own 600 s. The lifecycle span also holds copying files in and out and the
        # proxy's seal: CI measured 43 s of it beside the compose scale test (a stalled Docker daemon and broker), so
        # the kill itself is checked from the measured run time in the reason, below.
        assert end.timestamp_ms - started.timestamp_ms <= 120_000, (req.harness, end)
        (reward,) = rw[req.rollout_id]
        assert reward.status == RewardStatus.OK and reward.reward == 0.0, (req.harness, reward)  # graded, not lost
        if req.harness == "hang":
            # GNU timeout inside the container ended it: SIGTERM (ignored), then SIGKILL after the grace; the
            # worker's backstop (timeout + grace + 30 s) would report a bare SIGKILL.
            assert end.state == RolloutState.TIMED_OUT and "(SIGTERM+SIGKILL)" in (end.reason or ""), end
            ran = float(re.search(r"killed after ([0-9.]+)s, limit", end.reason or "").group(1))
            assert timeout <= ran < timeout + 1.0 + 30, end
        elif req.harness == "hog":  # the kernel's OOM killer: SIGKILL, exit 137, before the timeout
            assert end.state == RolloutState.HARNESS_EXITED and end.exit_code == 137, end
        else:  # fork: the 64 pids are exhausted, Popen fails, the file is never written
            assert end.state == RolloutState.HARNESS_EXITED and end.exit_code == 1, end
            assert "BlockingIOError" in (end.reason or "") or "Resource temporarily" in (end.reason or ""), end
    assert containers_of(engine, me) == []


# --- a daemon the harness leaves behind ----------------------------------------------------------------------------

# Detaches a shell that waits, by the sandbox's state and no clock, until the grader's files are copied in, then
# writes the answer over and over; the harness itself exits at once without writing it. (`$$`: the command is a
# template.)
DAEMON = """
import subprocess
script = 'until [ -n "$$(ls -A /grader 2>/dev/null)" ]; do sleep 0.01; done; while :; do printf hi > hello.txt; done'
subprocess.Popen(
    ["sh", "-c", script],
    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
"""


@pytest.mark.timeout(300)
async def test_a_daemon_left_by_the_harness_is_ended_before_grading(
    engine, kafka_settings, group_id, tmp_path, network
) -> None:
    # Without the end of leftovers after each command the daemon writes hello.txt while the grader runs: graded 1.0.
    adapters = {**ADAPTERS, "daemon": S.python_adapter("daemon", DAEMON)}
    async with docker_stack(engine, kafka_settings, group_id, tmp_path, network, S.agent_responder(), adapters) as st:
        req = S.request("hello", "daemon", rollout_id=f"daemon-{group_id}", timeout_s=60)
        events, rewards = await run_requests(kafka_settings, [req], timeout=240)
        me = st["worker"].ctx.backend.worker
    ev, rw = by_rollout(events, rewards)
    end = ev[req.rollout_id][-1]
    assert end.state == RolloutState.HARNESS_EXITED and end.exit_code == 0, end
    (reward,) = rw[req.rollout_id]
    assert reward.status == RewardStatus.OK and reward.reward == 0.0, reward  # graded on what the harness left
    assert containers_of(engine, me) == []


# --- the workspace disk quota --------------------------------------------------------------------------------------

# 256 KiB files over the workspace, HOME and /var/tmp (outside the copied dirs: the container's writable layer
# counts), ~40 MiB/s, stopping by itself at 128 MiB; then a file of its own as large as it can (RLIMIT_FSIZE).
DISK_HOG = """
import os, time
open("hello.txt", "w").write("hi")
dirs = [os.getcwd(), os.environ["HOME"], "/var/tmp"]
for i in range(512):
    with open(os.path.join(dirs[i % 3], f"fill-{i}.bin"), "wb") as f:
        f.write(b"x" * (256 * 1024))
    time.sleep(0.005)
time.sleep(600)
"""
ONE_FILE = """
import time
try:
    with open("/var/tmp/big.bin", "wb") as f:
        for _ in range(128):
            f.write(b"x" * (1 << 20))
except OSError as exc:
    print("stopped writing:", exc, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
async def test_a_rollout_over_its_disk_quota_is_stopped_and_graded_with_the_quota(
    engine, kafka_settings, group_id, tmp_path, network
) -> None:
    quota = 8 << 20
    adapters = {"disk-hog": S.python_adapter("disk-hog", DISK_HOG), "one-file": S.python_adapter("one-file", ONE_FILE)}
    async with docker_stack(
        engine,
        kafka_settings,
        group_id,
        tmp_path,
        network,
        S.agent_responder(),
        {**ADAPTERS, **adapters},
        max_workspace_bytes=quota,
        disk_check_interval_s=0.2,
    ) as st:
        reqs = [S.request("hello", h, rollout_id=f"dq-{h}-{group_id}", timeout_s=60) for h in adapters]
        events, rewards = await run_requests(kafka_settings, reqs, timeout=180)
        me = st["worker"].ctx.backend.worker
    ev, rw = by_rollout(events, rewards)
    for req in reqs:
        started, end = ev[req.rollout_id][0], ev[req.rollout_id][-1]
        assert [e.state for e in ev[req.rollout_id]] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], end
        assert end.reason is not None and end.reason.startswith("quota_exceeded: "), end
        assert f"max_workspace_bytes {quota}" in end.reason and end.exit_code == -9, end
        assert end.timestamp_ms - started.timestamp_ms < 30_000, end  # stopped by its bytes, not its 60 s
        (reward,) = rw[req.rollout_id]
        assert reward.status == RewardStatus.OK, reward  # graded as usual
        assert reward.reward == (1.0 if req.harness == "disk-hog" else 0.0), reward
    assert containers_of(engine, me) == []


# --- a SIGKILLed worker's containers are swept --------------------------------------------------------------------


def sleeper_responder():
    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tool_response>" in prompt_text:
            return tool_call_text("finish", {"summary": "ok"})
        return tool_call_text("run", {"command": "sleep 600", "timeout": 900})

    return respond


@pytest.mark.timeout(420)
async def test_a_sigkilled_workers_containers_are_swept_on_restart(
    engine, kafka_settings, group_id, tmp_path, network
) -> None:
    async with (
        ScriptedEngine(H.tiny_tokenizer(), sleeper_responder()) as scripted,
        running_proxy(kafka_settings, scripted.url, host=bridge_gateway(engine), keepalive_s=1.0) as (_p, url),
    ):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
            "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
            "CLAWSTREAM_SANDBOX_SUITES": f'{{"native": "{S.NATIVE_SUITE}"}}',
            "CLAWSTREAM_SANDBOX_DOCKER_IMAGE": IMAGE,
            "CLAWSTREAM_SANDBOX_DOCKER_NETWORK": network,
            "CLAWSTREAM_SANDBOX_DOCKER_RELAY_TARGET_PORT": url.rsplit(":", 1)[1],
            "CLAWSTREAM_SANDBOX_ROOT": str(tmp_path / "sandboxes-1"),
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "producers.sandbox.worker",
                "--backend",
                "docker",
                "--proxy-url",
                admin_url(url),
                "--proxy-admin-token",
                "admin",
                "--group-id",
                group_id,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        victim = f"{socket.gethostname()}:{proc.pid}:"
        try:
            S.publish(kafka_settings, [S.request("hello", "agentloop", rollout_id=f"kill-{group_id}", timeout_s=600)])
            # The state that triggers the kill: the worker's rollout container and its relay both exist.
            deadline = time.monotonic() + 180
            while len(containers_of(engine, victim)) < 2 and time.monotonic() < deadline:
                assert proc.poll() is None, "the worker died by itself"
                await asyncio.sleep(0.2)
            assert len(containers_of(engine, victim)) == 2, "the worker never started its rollout's container"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        await asyncio.sleep(0)
        assert len(containers_of(engine, victim)) == 2  # the dead worker could not clean up
        # Another topic prefix: the restarted worker must not pick the killed rollout's request up again.
        other = KafkaSettings(
            bootstrap_servers=kafka_settings.bootstrap_servers, topic_prefix=kafka_settings.topic_prefix + "restart."
        )
        create_topics(other, CATALOG)
        restarted = SandboxWorker(settings_for(url, network, tmp_path, group_id), other, adapters=ADAPTERS)
        stop = asyncio.Event()
        task = asyncio.create_task(restarted.run(stop))
        try:
            deadline = time.monotonic() + 60
            while containers_of(engine, victim) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert containers_of(engine, victim) == [], "the restarted worker did not sweep the dead one's containers"
        finally:
            stop.set()
            assert await asyncio.wait_for(task, 90) == 0
