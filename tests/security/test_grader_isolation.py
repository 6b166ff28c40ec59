"""The grader out of the rollout's reach in time, space and identity, on both backends.

Hostile harnesses (scripted Python run in the workspace, through :func:`producers.sandbox.rollout.execute` with a
real proxy and real sandboxes) against what the grader reads: (a) a double-forked ``setsid`` daemon that, once the
harness exited, keeps writing the graded answer and the grader's output file; (b) outputs planted in advance
wherever the rollout can reach — the grader's output file and folder, a symlinked reward folder, a hard-linked
payload — and, in a container, the interpreters a grader runs (``bash``, ``python3`` first on the image's PATH).
Each hostile grade must equal an honest do-nothing harness's on the same task. (c) The grader runs as another uid
than the rollout (a test grader compares its own ``/proc/self/status`` uid with the one the harness recorded).
Local (bubblewrap) always; docker when the engine answers (skipped with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from producers.harnesses.catalog import ADAPTERS
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.rollout import RolloutContext, execute
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog
from schemas.events import RewardStatus
from tests.integration.test_sandbox_disk_quota import proxy_without_kafka
from tests.support import sandbox_helpers as S

pytestmark = pytest.mark.integration

NOTHING = "pass"
# Leaves a daemon (double fork, new session, stdio closed) that waits until grading begins (the grader's files in
# sight) or 4 s have passed (the rollout long over: what it writes before its processes are killed is its answer),
# then for 8 s keeps writing the answer the hello task grades and a forged grader output; the harness exits at once.
DAEMON = """
import os, time
ws = os.getcwd()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        start = time.time()
        while time.time() < start + 4 and not any(map(os.path.exists, (ws + '/reward', '/grader/transcript.json'))):
            time.sleep(0.02)
        end = time.time() + 8
        while time.time() < end:
            for path, text in ((ws + '/hello.txt', 'hi'), ('/grader/subscores.out', '{"exists": 1, "content": 1}')):
                try:
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    open(path, 'w').write(text)
                except OSError:
                    pass
            time.sleep(0.05)
    os._exit(0)
"""
# Plants, before the grader runs, a forged output wherever it can: the grader's output file (and a link to it), a
# symlinked reward folder, a hard-linked payload; and forged interpreters where a grader's PATH looks first.
PREPLANT = r"""
import os
FORGED = '{"a": 1.0}\n'
SCRIPT = '#!/bin/sh\ncat >/dev/null 2>&1\necho 1.0\necho \'{"a": 1.0}\'\n'
def attempt(f, *args, **kw):
    try:
        f(*args, **kw)
    except OSError:
        pass
def put(path, text, mode=0o644):
    tmp = path + '.new'
    with open(tmp, 'w') as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
put('forged.json', FORGED)
attempt(put, '/tmp/forged.json', FORGED)
attempt(os.symlink, '/tmp', 'reward')
attempt(os.link, 'forged.json', '.openclaw_reward_payload.json')
for d in ('/grader', '/grader/cwd', '/grader/bin'):
    attempt(os.makedirs, d, exist_ok=True)
attempt(put, '/grader/subscores.out', FORGED)
attempt(os.symlink, '/tmp/forged.json', '/grader/transcript.json')
for exe in ('/usr/local/bin/bash', '/usr/local/bin/python3', '/opt/venv/bin/python3', '/opt/venv/bin/python',
            '/grader/bin/python3', '/grader/bin/bash'):
    attempt(put, exe, SCRIPT, 0o755)
"""
UID = "import os\nopen('uid.txt', 'w').write(str(os.getuid()))"
UID_GRADER = """
import json, sys
from pathlib import Path
own = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('Uid:'))
rollout = int((Path(sys.argv[1]) / 'uid.txt').read_text())
print(json.dumps({"other_uid": float(own != rollout)}))
"""
PREPLANT_HONEST = "open('forged.json', 'w').write('{}')"  # the same workspace entries, nothing forged
HARNESSES = {"nothing": NOTHING, "daemon": DAEMON, "preplant": PREPLANT, "preplant.honest": PREPLANT_HONEST, "uid": UID}
# (task, suite, harness) → run together; compared: hostile vs the honest harness with the same workspace entries
# on the same task (the do-nothing one for the daemon: killed in time, it leaves nothing).
RUNS = [
    ("hello", "native", "nothing"),
    ("hello", "native", "daemon"),
    ("hello", "native", "preplant"),
    ("hello", "native", "preplant.honest"),
    ("task_0078", "clawgym", "nothing"),
    ("task_0078", "clawgym", "daemon"),
    ("task_0078", "clawgym", "preplant"),
    ("task_0078", "clawgym", "preplant.honest"),
    ("uid", "iso", "uid"),
]


def _suite(tmp: Path) -> Path:
    task = tmp / "iso_suite" / "uid"
    task.mkdir(parents=True)
    (task / "task.json").write_text(json.dumps({"prompt": 'Write "uid.txt".', "timeout_s": 60, "split": "train"}))
    (task / "grade.py").write_text(UID_GRADER)
    return task.parent


def _context(tmp: Path, settings: SandboxSettings, admin_url: str, backend: object) -> RolloutContext:
    async def resolve(_adapter):  # noqa: ANN001, ANN202
        return "", ""

    suites = {"native": str(S.NATIVE_SUITE), "clawgym": str(S.FIXTURES / "clawgym"), "iso": str(_suite(tmp))}
    return RolloutContext(
        backend=backend,
        proxy=ProxyAdmin(admin_url, "admin"),
        catalog=SuiteCatalog(suites),
        adapters={**ADAPTERS, **{name: S.python_adapter(name, code) for name, code in HARNESSES.items()}},
        sink=S.ListSink(),
        settings=settings,
        resolve_exe=resolve,
    )


async def _grades(ctx: RolloutContext) -> dict[tuple[str, str], tuple]:
    async def one(task: str, suite: str, harness: str):  # noqa: ANN202
        out = await execute(S.request(task, harness, suite=suite, timeout_s=60), ctx)
        assert out.cleanup is not None and out.cleanup.clean, out.cleanup
        assert out.reward is not None, out
        return out.reward

    rewards = await asyncio.gather(*(one(*run) for run in RUNS))
    return {(t, h): (r.status, r.reward, r.sub_scores, r.reason) for (t, _s, h), r in zip(RUNS, rewards, strict=True)}


def _check(got: dict[tuple[str, str], tuple]) -> None:
    assert got[("hello", "nothing")][:2] == (RewardStatus.OK, 0.0), got
    assert got[("task_0078", "nothing")][:2] == (RewardStatus.OK, pytest.approx(1 / 12)), got
    twins = {"daemon": "nothing", "preplant": "preplant.honest"}
    changed = {
        (task, h): (got[(task, h)], got[(task, honest)])
        for task in ("hello", "task_0078")
        for h, honest in twins.items()
        if got[(task, h)][:3] != got[(task, honest)][:3]
    }
    assert not changed, changed  # (task, attack): (its grade, the honest twin's grade)
    assert got[("uid", "uid")][:3] == (RewardStatus.OK, 1.0, {"other_uid": 1.0}), got[("uid", "uid")]


@pytest.mark.timeout(300)
async def test_local_grader_is_out_of_the_rollouts_reach(tmp_path: Path) -> None:
    S.require_bwrap()
    async with proxy_without_kafka() as admin_url:
        settings = SandboxSettings(
            root=tmp_path / "sbx",
            isolation="bwrap",
            kill_grace_s=0.5,
            grader_timeout_s=30,
            proxy_url=admin_url,
            proxy_admin_token="admin",
        )
        got = await _grades(_context(tmp_path, settings, admin_url, LocalBackend(settings)))
    _check(got)


@pytest.mark.provisioned("docker")
@pytest.mark.timeout(600)
async def test_docker_grader_is_out_of_the_rollouts_reach(tmp_path: Path, group_id: str) -> None:
    from producers.sandbox.docker_backend import DockerBackend

    with S.docker_engine(group_id) as network:
        async with proxy_without_kafka() as admin_url:
            settings = S.docker_settings(tmp_path / "sandboxes", group_id, network, admin_url)
            got = await _grades(_context(tmp_path, settings, admin_url, DockerBackend(settings)))
    _check(got)


def test_grader_archive_and_command_line_are_the_graders(tmp_path: Path) -> None:
    """Pure: the docker grader's copy is its own (owner, a private grader directory, traversable ancestors); the
    local grader's namespace binds what it is given read-only as asked."""
    import io
    import tarfile

    from producers.sandbox import bwrap
    from producers.sandbox.docker_grader import GRADER_UID, grader_archive

    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a.txt").write_text("a")
    (tmp_path / "grader").mkdir()
    tar = tarfile.open(
        fileobj=io.BytesIO(
            grader_archive({"/root/x/ws": tmp_path / "ws", "/grader": tmp_path / "grader"}, GRADER_UID, "/grader")
        )
    )
    members = {m.name: m for m in tar.getmembers()}
    assert {"root", "root/x", "root/x/ws", "root/x/ws/a.txt", "grader"} <= set(members)
    assert members["root"].mode == 0o755 and members["grader"].mode == 0o700
    assert {m.uid for n, m in members.items() if n.startswith(("root/x/ws", "grader"))} == {GRADER_UID}
    argv = bwrap.bwrap_argv(["true"], binds={}, ro_binds={"/home/sandbox": tmp_path}, read_only=(), cwd="/", uid=1001)
    assert ["--ro-bind", str(tmp_path), "/home/sandbox"] == argv[
        argv.index(str(tmp_path)) - 1 : argv.index(str(tmp_path)) + 2
    ]
    assert bwrap.grader_uid(1000) != 1000
