"""Sandbox worker pieces without Kafka: adapters, local sandbox, docker container spec, rollout status mapping,
scheduler planning / lag gating / re-issue, offset bookkeeping."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from producers.harnesses.base import LaunchContext, launch_spec
from producers.harnesses.catalog import ADAPTERS
from producers.sandbox import bwrap
from producers.sandbox.docker_backend import (
    DockerSandbox,
    container_spec,
    exec_argv,
    owner_alive,
    pack,
    process_identity,
    unpack_into,
)
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.offsets import OffsetTracker
from producers.sandbox.proxy_admin import ProxyAdmin, ProxyError
from producers.sandbox.rollout import RolloutContext, execute
from producers.sandbox.settings import SandboxSettings
from producers.scheduler.plan import (
    Outstanding,
    StepPlan,
    harness_counts,
    instance_requests,
    may_issue,
    plan_step,
    score_table,
)
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.cpu import cpu_suite
from schemas.events import RewardEvent, RewardStatus, RolloutState, now_ms
from tests.support import sandbox_helpers as S

CTX = LaunchContext(
    base_url="http://127.0.0.1:9/r/rid",
    secret="s3cret",
    workspace="/w",
    home="/h",
    prompt='Create "a.txt" with "it\'s" $HOME {x}',
    timeout_s=60,
    python="/py",
    exe="/bin/harness",
    clawstream_root="/src",
)


# --- adapters -------------------------------------------------------------------------------------------------------


def test_builtin_adapters_render() -> None:
    assert set(ADAPTERS) >= {
        "claude-code",
        "codex",
        "qwen-code",
        "openclaw",
        "opencode",
        "agentloop",
        "agentloop-anthropic",
    }
    for name, adapter in ADAPTERS.items():
        spec = launch_spec(adapter, CTX)
        assert CTX.prompt in spec.argv, name  # the prompt is one argv element, untouched
        assert all(p.startswith("/h/") for p in spec.files), name
        for path, content in spec.files.items():
            assert "${" not in content
            if path.endswith((".json", ".json5")):
                json.loads(content)
            elif path.endswith(".toml"):
                tomllib.loads(content)
    claude = launch_spec(ADAPTERS["claude-code"], CTX)
    assert claude.argv[0] == "/bin/harness" and claude.env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/r/rid"
    assert claude.env["ANTHROPIC_API_KEY"] == "s3cret" and claude.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    codex = launch_spec(ADAPTERS["codex"], CTX)
    conf = tomllib.loads(codex.files["/h/.codex/config.toml"])
    assert conf["model_providers"]["clawstream"]["base_url"] == "http://127.0.0.1:9/r/rid/v1"
    assert conf["model_providers"]["clawstream"]["wire_api"] == "responses"
    assert codex.env == {"CODEX_HOME": "/h/.codex", "CLAWSTREAM_API_KEY": "s3cret"}
    assert "workspace-write" in codex.argv and "danger-full-access" not in codex.argv
    contained = launch_spec(ADAPTERS["codex"], dataclasses.replace(CTX, contained=True))  # its bubblewrap cannot run
    assert "danger-full-access" in contained.argv and "workspace-write" not in contained.argv
    assert launch_spec(ADAPTERS["claude-code"], dataclasses.replace(CTX, contained=True)).argv == claude.argv
    opencode = json.loads(launch_spec(ADAPTERS["opencode"], CTX).files["/h/opencode.json"])
    assert opencode["$schema"].startswith("https://")
    assert opencode["provider"]["clawstream"]["options"]["apiKey"] == "s3cret"
    claw = launch_spec(ADAPTERS["openclaw"], CTX)
    assert ADAPTERS["openclaw"].node24 and claw.argv[claw.argv.index("--timeout") + 1] == "60"
    assert json.loads(claw.files["/h/openclaw.json5"])["agents"]["defaults"]["workspace"] == "/w"
    qwen = launch_spec(ADAPTERS["qwen-code"], CTX)
    assert qwen.env["OPENAI_BASE_URL"].endswith("/r/rid/v1") and "HTTP_PROXY" not in qwen.env
    loop, loop_a = launch_spec(ADAPTERS["agentloop"], CTX), launch_spec(ADAPTERS["agentloop-anthropic"], CTX)
    assert loop.argv[:3] == ["/py", "-m", "producers.harnesses.builtin_loop"] and loop.env["PYTHONPATH"] == "/src"
    assert "http://127.0.0.1:9/r/rid/v1" in loop.argv and "http://127.0.0.1:9/r/rid" in loop_a.argv
    assert ADAPTERS["agentloop"].dialect != ADAPTERS["agentloop-anthropic"].dialect


# --- local sandbox --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_local_sandbox_env_limits_kill_cleanup(tmp_path: Path, monkeypatch, isolation: str) -> None:
    if isolation == "bwrap":
        S.require_bwrap()
    monkeypatch.setenv("CLAWSTREAM_KAFKA_SASL_PASSWORD", "leak-me")
    backend = LocalBackend(
        SandboxSettings(root=tmp_path, limit_open_files=321, kill_grace_s=0.5, isolation=isolation)  # type: ignore[arg-type]
    )
    box = await backend.create("unit-box", cpu_suite().split("train")[2])
    assert (box.host_path(box.workspace) / next(iter(cpu_suite().split("train")[2].files))).is_file()
    code = "import os, resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0]); print(sorted(os.environ))"
    res = await box.run([box.python, "-c", code], {"EXTRA": "1"}, box.workspace, 20)
    nofile, names = res.stdout.splitlines()
    assert res.exit_code == 0 and nofile == "321"
    assert "CLAWSTREAM_KAFKA_SASL_PASSWORD" not in names and "EXTRA" in names and "HOME" in names
    # a group that ignores SIGTERM, with a background child: everything dies at the timeout
    hang = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', 'unit-box-child']); "
        "print(p.pid, flush=True); time.sleep(300)"
    )
    res = await box.run([box.python, "-c", hang], {}, box.workspace, 1.0)
    assert res.timed_out and res.exit_code is None and res.killed == ["SIGTERM", "SIGKILL"] and res.duration_s < 5
    assert S.leftover_processes("unit-box") == []
    assert S.processes_with_arg("unit-box-child") == []
    report = await box.destroy()
    assert report.clean and not any(tmp_path.iterdir())
    assert S.leftover_processes("unit-box") == []


def test_bwrap_argv_binds() -> None:
    argv = bwrap.bwrap_argv(
        ["harness", "--flag"],
        binds={"/workspace": Path("/host/ws"), "/home/sandbox": Path("/host/home")},
        read_only=["/venv", "/venv/lib", "/src/producers"],
        cwd="/workspace",
        uid=1000,
        proxy_socket=Path("/tmp/px/proxy.sock"),
    )
    assert argv[0] == "bwrap" and argv[-3:] == ["--", "harness", "--flag"]
    pairs = {(argv[i], argv[i + 1], argv[i + 2]) for i in range(len(argv) - 2)}
    assert ("--bind", "/host/ws", "/workspace") in pairs and ("--bind", "/host/home", "/home/sandbox") in pairs
    assert ("--ro-bind", "/tmp/px/proxy.sock", bwrap.PROXY_SOCKET) in pairs
    for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"):
        assert flag in argv
    assert argv[argv.index("--proc") + 1] == "/proc" and argv[argv.index("--chdir") + 1] == "/workspace"
    assert argv.index("--remount-ro") > max(i for i, a in enumerate(argv) if a == "--bind")  # root read-only last
    assert "/" not in [argv[i + 1] for i, a in enumerate(argv) if a == "--bind"]  # no host path writable but these


# --- docker backend, pure parts (the real engine: tests/integration/test_docker_sandbox.py) ------------------------


def test_docker_container_spec(tmp_path: Path) -> None:
    settings = SandboxSettings(
        backend="docker",
        root=tmp_path,
        docker_image="img:1",
        docker_cpus=1.5,
        docker_memory_mb=2048,
        docker_pids=128,
        docker_network="sbx-net",
    )
    task = SuiteCatalog({"n": str(S.NATIVE_SUITE)}).task("n", "hello")
    spec = container_spec(settings, "sb1", task, "host:1:2")
    assert spec["image"] == "img:1" and spec["command"] == ["sleep", "infinity"] and spec["detach"] and spec["init"]
    assert "volumes" not in spec  # files are copied in and out, so a worker in a container works the same
    assert spec["nano_cpus"] == 1_500_000_000 and spec["mem_limit"] == spec["memswap_limit"] == "2048m"
    assert spec["pids_limit"] == 128 and spec["network"] == "sbx-net" and spec["cap_drop"] == ["ALL"]
    assert spec["security_opt"] == ["no-new-privileges"] and spec["environment"]["CLAWSTREAM_SANDBOX_ID"] == "sb1"
    assert spec["labels"] == {"clawstream.sandbox": "sb1", "clawstream.worker": "host:1:2"}
    assert exec_argv(["python3", "x.py"], 30, 2) == ["timeout", "-s", "TERM", "-k", "2", "30", "python3", "x.py"]


def test_docker_copy_in_and_out_keeps_files_inside_their_directory(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "a.txt").write_text("A")
    (ws / ".hidden").write_text("H")
    archive = pack({"/root/.openclaw/workspace": ws})
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert sorted(tar.getnames()) == [
            "root/.openclaw/workspace",
            "root/.openclaw/workspace/.hidden",
            "root/.openclaw/workspace/sub",
            "root/.openclaw/workspace/sub/a.txt",
        ]
    # What get_archive returns for /workspace: members under "workspace/", here with one escaping link and one
    # escaping path; both are skipped, the rest replaces the host copy (old files disappear).
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("workspace/new.txt", b"N"), ("workspace/../../evil.txt", b"E")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("workspace/passwd")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    skipped = unpack_into(buf.getvalue(), "workspace", ws)
    assert sorted(p.name for p in ws.iterdir()) == ["new.txt"] and (ws / "new.txt").read_text() == "N"
    assert len(skipped) == 2 and not (tmp_path / "evil.txt").exists() and not (tmp_path.parent / "evil.txt").exists()


def test_docker_worker_identity_and_proxy_url() -> None:
    me = process_identity()
    assert owner_alive(me) is True
    host, pid, start = me.split(":")
    assert owner_alive(f"{host}:{pid}:{int(start) + 1}") is False  # same pid, another process (pid reused)
    assert owner_alive(f"{host}:999999999:1") is False and owner_alive("elsewhere:1:1") is None
    settings = SandboxSettings(backend="docker")
    task = SuiteCatalog({"n": str(S.NATIVE_SUITE)}).task("n", "hello")
    box = DockerSandbox("sb", Path("/nonexistent"), None, None, task, settings, "http://relay-x:8100")
    assert box.proxy_base_url("http://127.0.0.1:41234/r/abc?x=1") == "http://relay-x:8100/r/abc?x=1"
    direct = DockerSandbox("sb", Path("/nonexistent"), None, None, task, settings, None)
    assert direct.proxy_base_url("http://clawstream-proxy:8100/r/abc") == "http://clawstream-proxy:8100/r/abc"
    assert box.host_path("/workspace/a/b") == Path("/nonexistent/workspace/a/b")


# --- rollout status mapping (fake proxy, list sink, real local sandboxes) -------------------------------------------


class FakeProxy(ProxyAdmin):
    def __init__(self, seal_result: dict | None = None, fail_register: bool = False) -> None:
        super().__init__("http://unused", "t")
        self.seal_result = seal_result or {"calls_served": 0, "status": "ok", "infra_failure": None}
        self.fail_register = fail_register
        self.log: list[str] = []

    async def register(self, rollout_id: str, **params: Any) -> dict[str, Any]:
        self.log.append("register")
        if self.fail_register:
            raise ProxyError("proxy down")
        return {"rollout_id": rollout_id, "secret": "s", "base_url": "http://127.0.0.1:9/r/" + rollout_id}

    async def seal(self, rollout_id: str, attempt_id: str | None = None) -> dict[str, Any]:
        self.log.append("seal")
        return self.seal_result

    async def renew(self, rollout_id: str, attempt_id: str, lease_s: float) -> bool:
        self.log.append("renew")
        return True

    async def forget(self, rollout_id: str, attempt_id: str | None = None, *, finished: bool = False) -> None:
        self.log.append("forget")


class ListSink:
    def __init__(self, fail_reward: bool = False) -> None:
        self.events: list = []
        self.rewards: list = []
        self.fail_reward = fail_reward

    async def event(self, event) -> None:  # noqa: ANN001
        self.events.append(event)

    async def reward(self, reward) -> None:  # noqa: ANN001
        if self.fail_reward:
            from clawbase.kafka.publisher import PublishError

            raise PublishError("kafka down")
        self.rewards.append(reward)


async def _outcome(
    tmp_path: Path,
    harness: str,
    code: str,
    *,
    proxy: FakeProxy | None = None,
    sink: ListSink | None = None,
    timeout_s: float = 20,
):
    sink = sink or ListSink()

    async def resolve(_adapter):  # noqa: ANN001, ANN202
        return "", ""

    ctx = RolloutContext(
        backend=LocalBackend(SandboxSettings(root=tmp_path, kill_grace_s=0.5)),
        proxy=proxy or FakeProxy(),
        catalog=SuiteCatalog({"native": str(S.NATIVE_SUITE)}),
        adapters={harness: S.python_adapter(harness, code)},
        sink=sink,
        settings=SandboxSettings(),
        resolve_exe=resolve,
    )
    out = await execute(S.request("hello", harness, timeout_s=timeout_s), ctx)
    assert out.cleanup is None or out.cleanup.clean
    return out, sink


@pytest.mark.parametrize(
    ("code", "timeout_s", "states", "status", "reward", "exit_code"),
    [
        ("open('hello.txt','w').write('hi')", 20, ["STARTED", "HARNESS_EXITED"], "OK", 1.0, 0),
        ("raise SystemExit(7)", 20, ["STARTED", "HARNESS_EXITED"], "OK", 0.0, 7),
        (
            "import time; open('hello.txt','w').write('hi'); time.sleep(60)",
            1,
            ["STARTED", "TIMED_OUT"],
            "OK",
            1.0,
            None,
        ),
    ],
)
async def test_status_mapping(tmp_path, code, timeout_s, states, status, reward, exit_code) -> None:
    out, sink = await _outcome(tmp_path, "fake", code, timeout_s=timeout_s)
    assert [e.state.value for e in sink.events] == states
    assert sink.events[-1].exit_code == exit_code
    (r,) = sink.rewards
    assert r.status.value == status and r.reward == reward and r.attempt_id == out.attempt_id
    assert len({e.attempt_id for e in sink.events}) == 1 and not any(tmp_path.iterdir())


async def test_infra_failures_are_never_scored(tmp_path: Path) -> None:
    proxy = FakeProxy(fail_register=True)
    _, sink = await _outcome(tmp_path, "fake", "pass", proxy=proxy)
    assert [e.state for e in sink.events] == [RolloutState.FAILED] and "proxy down" in sink.events[0].reason
    assert sink.rewards[0].status == RewardStatus.INFRA_FAILURE and sink.rewards[0].reward is None
    proxy = FakeProxy(seal_result={"calls_served": 1, "infra_failure": "call 0: kafka"})
    _, sink = await _outcome(tmp_path, "fake", "pass", proxy=proxy)
    assert [e.state for e in sink.events] == [RolloutState.STARTED, RolloutState.FAILED]
    assert sink.rewards[0].status == RewardStatus.INFRA_FAILURE and proxy.log == ["register", "seal", "forget"]
    with pytest.raises(Exception, match="kafka down"):  # the sink failed: the caller must not commit
        await _outcome(tmp_path, "fake", "pass", sink=ListSink(fail_reward=True))
    assert not any(tmp_path.iterdir())


# --- scheduler ------------------------------------------------------------------------------------------------------


def test_harness_ratios_and_groups() -> None:
    assert harness_counts(32, {"a": 3, "b": 1}) == {"a": 24, "b": 8}
    assert harness_counts(5, {"a": 1, "b": 1}) in ({"a": 3, "b": 2}, {"a": 2, "b": 3})
    assert sum(harness_counts(7, {"a": 1, "b": 1, "c": 1}).values()) == 7
    tasks = cpu_suite().split("train")
    plan = StepPlan(tasks_per_step=8, group_size=4, mix={"agentloop": 1, "agentloop-anthropic": 1}, max_attempts=3)
    reqs = plan_step(3, tasks, plan, random.Random(0), policy_version=2)
    assert len(reqs) == 32 and len({r.rollout_id for r in reqs}) == 32
    groups: dict[str, list] = {}
    for r in reqs:
        groups.setdefault(r.group_id, []).append(r)
        assert r.group_id == f"cpu_builtin/{r.task_id}|{r.harness}|3" and r.step == 3
        assert r.metadata["group_size"] == "4" and r.policy_version == 2 and not r.eval
        assert r.metadata["max_attempts"] == "3" and r.attempt == 0  # the grouper keeps an infra failure's place
    assert len(groups) == 8 and all(len(g) == 4 for g in groups.values())
    per_harness = {h: sum(1 for g in groups.values() if g[0].harness == h) for h in plan.mix}
    assert per_harness == {"agentloop": 4, "agentloop-anthropic": 4}
    again = plan_step(3, tasks, plan, random.Random(0))
    assert [(r.task_id, r.harness) for r in again] == [(r.task_id, r.harness) for r in reqs]  # seeded


def test_lag_gating() -> None:
    assert may_issue(0, 0, 0) and not may_issue(1, 0, 0) and may_issue(1, 1, 0)
    assert may_issue(2, 1, 1) and not may_issue(3, 1, 1)


def _reward(rid: str, status: RewardStatus, value: float | None) -> RewardEvent:
    return RewardEvent(
        rollout_id=rid,
        policy_version=0,
        timestamp_ms=now_ms(),
        attempt_id=f"{rid}.x",
        status=status,
        grader="g",
        reward=value,
    )


def test_reissue_is_bounded_and_eval_table() -> None:
    task = cpu_suite().split("heldout")[0]
    plan = StepPlan(1, 1, {})
    a, b = instance_requests(task, "agentloop", -1, plan, eval_mode=True) + instance_requests(task, "x", -1, plan)
    assert a.eval and a.step == -1 and a.group_id.endswith("|agentloop|-1")
    out = Outstanding(max_attempts=2)
    out.add([a, b])
    again = out.on_reward(_reward(a.rollout_id, RewardStatus.INFRA_FAILURE, None))
    assert again is not None and again.attempt == 1 and again.rollout_id == a.rollout_id
    assert out.on_reward(_reward(a.rollout_id, RewardStatus.INFRA_FAILURE, None)) is None  # attempts used up
    assert a.rollout_id in out.gave_up
    assert out.on_reward(_reward(b.rollout_id, RewardStatus.OK, 0.5)) is None and b.rollout_id in out.final
    assert out.on_reward(_reward("unknown", RewardStatus.OK, 1.0)) is None
    table = score_table({a.rollout_id: a, b.rollout_id: b}, out)
    assert "| agentloop | 1 | 0 | n/a | 0 | 1 | 0 | 0 |" in table and "| x | 1 | 1 | 0.500 | 0 | 0 | 0 | 0 |" in table


# --- offsets --------------------------------------------------------------------------------------------------------


def test_offset_commit_points() -> None:
    t, tp = OffsetTracker(), ("requests", 0)
    for off in (10, 11, 12, 14):  # 13 is a gap (e.g. a transaction marker)
        t.start(tp, off)
    assert t.commit_point(tp) == 10 or t.commit_point(tp) is None
    t.done(tp, 11)
    t.done(tp, 12)
    assert t.commit_point(tp) == 10  # 10 still running: nothing above it may be committed
    t.done(tp, 10)
    assert t.commit_point(tp) == 14
    t.committed(tp, 14)
    assert t.commit_point(tp) is None
    t.done(tp, 14)
    assert t.commit_points() == {tp: 15}
    t.forget([tp])
    t.done(tp, 99)  # revoked meanwhile: ignored
    assert t.commit_points() == {} and t.in_flight() == 0
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


# A rollout that does nothing but plant a module where the grader's Python looks first, its script directory (#29):
# the grader dir beside the workspace. `json.py` there took the untouched hello task from 0.0 to 1.0.
FORGE_JSON = """
import os
fake = 'def dumps(obj):\\n    return \\'{"forged": 1.0}\\'\\n'
os.makedirs('../grader', exist_ok=True)
open('../grader/json.py', 'w').write(fake)
"""


async def test_a_rollout_cannot_plant_a_module_that_grades_it(tmp_path: Path) -> None:
    _, sink = await _outcome(tmp_path, "forger", FORGE_JSON)
    (r,) = sink.rewards
    assert r.status == RewardStatus.OK and r.reward == 0.0, (r.reward, r.sub_scores)  # hello.txt was never written
    assert "forged" not in r.sub_scores
