"""Grading out of the rollout's reach: hostile harnesses against the grader, on the local backend.

Each hostile harness is scripted Python run in the workspace (``python -c``), through
:func:`producers.sandbox.rollout.execute` with a real proxy (no Kafka) and real sandboxes. It plants what a
grader might import or trust — a ``json.py`` / ``re.py`` / ``os.py`` / ``sitecustomize.py`` in the workspace, a
``.pth`` and ``usercustomize.py`` in the sandbox's user site-packages — and the reward must equal an honest
do-nothing harness's on the same task (ClawGym-Bench ``task_0078``: 1/12). Planted code that replaces the grader's
sub-scores capture with a FIFO must not stall the worker: a neighbour rollout on the same event loop finishes and
the loop never stops for long. A graded file made unreadable (``chmod 000``) is a graded 0 flagged
``grader_error_by_rollout``, never an uncounted INFRA_FAILURE; a grader that fails on the task's untouched
workspace too stays an INFRA_FAILURE. The grader-output reader refuses FIFOs and symlinks without blocking and
reads a bounded tail.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
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

# Prints a forged reward from inside whatever Python imports it (after draining its stdin: the pipe's writer then
# exits 0), and ends that Python at once.
FORGE = "import sys\ntry:\n    sys.stdin.read()\nexcept Exception:\n    pass\nprint(1.0)\nsys.exit(0)\n"
BENIGN = "# notes\n"
USER_SITES = [f"~/.local/lib/python3.{minor}/site-packages" for minor in range(6, 16)]
# What each hostile harness plants (path → content; ``~``: the sandbox's HOME).
ATTACKS = {
    "json_py": {"json.py": FORGE},
    "re_py": {"re.py": FORGE},  # json imports re
    "os_py": {"os.py": FORGE},
    "sitecustomize": {"sitecustomize.py": FORGE},
    "user_site": {
        **{f"{site}/zz.pth": "import sys; print(1.0); sys.exit(0)\n" for site in USER_SITES},
        **{f"{site}/usercustomize.py": FORGE for site in USER_SITES},
    },
}


def plant(files: dict[str, str], *, benign: bool = False) -> str:
    """A harness (Python source) that writes ``files`` (their content replaced by a comment when ``benign``: the
    honest baseline with the same workspace shape) and exits."""
    files = {path: BENIGN if benign else text for path, text in files.items()}
    return (
        "import os\n"
        f"for path, text in {files!r}.items():\n"
        "    path = os.path.expanduser(path)\n"
        "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n"
        "    open(path, 'w').write(text)\n"
    )


# Planted json.py that, once imported by the grader, swaps the sub-scores capture for a FIFO nobody writes.
FIFO_JSON = (
    "import os, sys\n"
    "out = os.environ.get('CLAWSTREAM_SUBSCORES_OUT')\n"
    "if out:\n"
    "    os.path.lexists(out) and os.unlink(out)\n"
    "    os.mkfifo(out)\n" + FORGE
)
DO_NOTHING = "pass"
NEIGHBOUR = "import time\ntime.sleep(3)\nopen('hello.txt', 'w').write('hi')"
HALF = "open('hello.txt', 'w').write('wrong')"  # exists, wrong content: graded 0.5
CHMOD = HALF + "\nimport os\nos.chmod('hello.txt', 0)"


def _settings(tmp: Path, isolation: str, admin_url: str) -> SandboxSettings:
    if isolation == "bwrap":
        S.require_bwrap()
    return SandboxSettings(
        root=tmp / "sbx",
        isolation=isolation,
        kill_grace_s=0.5,
        grader_timeout_s=30,
        proxy_url=admin_url,
        proxy_admin_token="admin",
    )


def _context(settings: SandboxSettings, admin_url: str, adapters: dict[str, str]) -> RolloutContext:
    async def resolve(_adapter):  # noqa: ANN001, ANN202
        return "", ""

    return RolloutContext(
        backend=LocalBackend(settings),
        proxy=ProxyAdmin(admin_url, "admin"),
        catalog=SuiteCatalog({"native": str(S.NATIVE_SUITE), "clawgym": str(S.FIXTURES / "clawgym")}),
        adapters={**ADAPTERS, **{name: S.python_adapter(name, code) for name, code in adapters.items()}},
        sink=S.ListSink(),
        settings=settings,
        resolve_exe=resolve,
    )


async def _run(ctx: RolloutContext, task: str, harness: str, suite: str = "clawgym"):  # noqa: ANN202
    out = await execute(S.request(task, harness, suite=suite, timeout_s=60), ctx)
    assert out.cleanup is not None and out.cleanup.clean, out.cleanup
    assert out.reward is not None, out
    return out.reward


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_planted_modules_do_not_change_a_clawgym_reward(tmp_path: Path, isolation: str) -> None:
    async with proxy_without_kafka() as admin_url:
        harnesses = {"nothing": DO_NOTHING}
        for name, files in ATTACKS.items():
            harnesses[name], harnesses[f"{name}.honest"] = plant(files), plant(files, benign=True)
        ctx = _context(_settings(tmp_path, isolation, admin_url), admin_url, harnesses)
        rewards = await asyncio.gather(*(_run(ctx, "task_0078", name) for name in harnesses))
    got = {name: (r.status, r.reward) for name, r in zip(harnesses, rewards, strict=True)}
    assert got["nothing"] == (RewardStatus.OK, pytest.approx(1 / 12)), got
    assert all(got[f"{name}.honest"][0] == RewardStatus.OK for name in ATTACKS), got
    forged = {name: (got[name], got[f"{name}.honest"]) for name in ATTACKS if got[name] != got[f"{name}.honest"]}
    assert not forged, forged  # attack: (its grade, the same files' grade with harmless content)


class _Rescuer:
    """Opens, for writing, every FIFO that appears under ``root`` once ``after_s`` have passed: a reader blocked in
    ``open`` of it is released (so a stalled worker fails this test instead of hanging it)."""

    def __init__(self, root: Path, after_s: float) -> None:
        self.root, self.after_s, self.rescued = root, after_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        if self.stop.wait(self.after_s):
            return
        while not self.stop.wait(0.2):
            for d, _dirs, files in os.walk(self.root):
                for name in files:
                    path = os.path.join(d, name)
                    try:
                        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                    except OSError:
                        continue  # not a FIFO with a reader waiting
                    os.close(fd)
                    self.rescued += 1


async def _max_gap(stop: asyncio.Event) -> float:
    """The longest the event loop went without running this task (0.05 s ticks)."""
    worst, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.05)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("isolation", ["bwrap", "none"])
async def test_a_fifo_grader_output_stalls_no_neighbour(tmp_path: Path, isolation: str) -> None:
    async with proxy_without_kafka() as admin_url:
        settings = _settings(tmp_path, isolation, admin_url)
        ctx = _context(
            settings,
            admin_url,
            {
                "fifo": plant({"json.py": FIFO_JSON}),
                "fifo.honest": plant({"json.py": FIFO_JSON}, benign=True),
                "neighbour": NEIGHBOUR,
            },
        )
        rescuer = _Rescuer(settings.root, after_s=12)
        rescuer.thread.start()
        stop = asyncio.Event()
        gap = asyncio.ensure_future(_max_gap(stop))
        try:
            baseline = await _run(ctx, "task_0078", "fifo.honest")
            hostile, neighbour = await asyncio.gather(
                _run(ctx, "task_0078", "fifo"), _run(ctx, "hello", "neighbour", suite="native")
            )
        finally:
            stop.set()
            rescuer.stop.set()
        worst = await gap
    assert rescuer.rescued == 0, "the worker blocked opening a FIFO the rollout planted"
    assert worst < 6.0, f"the event loop stalled for {worst:.1f} s"
    assert (neighbour.status, neighbour.reward) == (RewardStatus.OK, 1.0), neighbour
    assert (hostile.status, hostile.reward) == (baseline.status, baseline.reward), (hostile, baseline)


@pytest.mark.timeout(300)
async def test_an_unreadable_graded_file_is_the_rollouts_graded_zero(tmp_path: Path) -> None:
    async with proxy_without_kafka() as admin_url:
        ctx = _context(
            _settings(tmp_path, "bwrap", admin_url),
            admin_url,
            {"nothing": DO_NOTHING, "half": HALF, "chmod": CHMOD},
        )
        nothing, half, chmod, broken = await asyncio.gather(
            _run(ctx, "hello", "nothing", suite="native"),
            _run(ctx, "hello", "half", suite="native"),
            _run(ctx, "hello", "chmod", suite="native"),
            _run(ctx, "bad_grader", "nothing", suite="native"),
        )
    assert (half.status, half.reward) == (RewardStatus.OK, 0.5), half
    assert (chmod.status, chmod.reward) == (RewardStatus.OK, 0.0), chmod
    assert (nothing.status, nothing.reward, nothing.grader_error_by_rollout) == (RewardStatus.OK, 0.0, False)
    assert chmod.grader_error_by_rollout and "grader_error_by_rollout" in (chmod.reason or ""), chmod
    # A grader that fails on the task's untouched workspace too is broken: infrastructure, never a 0.
    assert (broken.status, broken.reward, broken.grader_error_by_rollout) == (RewardStatus.INFRA_FAILURE, None, False)


def test_grader_output_reader_refuses_fifos_and_links_and_bounds_size(tmp_path: Path) -> None:
    from producers.sandbox.run_grader import read_grader_output
    from producers.tasks.grading_rules import GraderFailure

    (tmp_path / "ok").write_text('{"a": 1}\n')
    assert read_grader_output(tmp_path / "ok") == '{"a": 1}\n'
    assert read_grader_output(tmp_path / "missing") is None
    (tmp_path / "big").write_bytes(b"x" * (3 << 20) + b"\nEND")
    assert read_grader_output(tmp_path / "big", limit=1 << 20).endswith("\nEND")
    assert len(read_grader_output(tmp_path / "big", limit=1 << 20)) == 1 << 20
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "ok")
    (tmp_path / "dir").mkdir()
    for name in ("fifo", "link", "dir"):
        t0 = time.monotonic()
        with pytest.raises(GraderFailure):
            read_grader_output(tmp_path / name)
        assert time.monotonic() - t0 < 1.0


@pytest.mark.provisioned("docker")
@pytest.mark.timeout(600)
async def test_the_docker_backend_grades_out_of_the_rollouts_reach(tmp_path: Path, group_id: str) -> None:
    """The same grading code on the docker backend: a planted json.py forges nothing; a chmod 000 changes nothing."""
    from producers.sandbox.docker_backend import DockerBackend

    files = ATTACKS["json_py"]
    harnesses = {"json_py": plant(files), "json_py.honest": plant(files, benign=True), "half": HALF, "chmod": CHMOD}
    with S.docker_engine(group_id) as network:
        async with proxy_without_kafka() as admin_url:
            settings = S.docker_settings(tmp_path / "sandboxes", group_id, network, admin_url)
            ctx = _context(settings, admin_url, harnesses)
            ctx = RolloutContext(**{**ctx.__dict__, "backend": DockerBackend(settings)})
            forged, honest, half, chmod = await asyncio.gather(
                _run(ctx, "task_0078", "json_py"),
                _run(ctx, "task_0078", "json_py.honest"),
                _run(ctx, "hello", "half", suite="native"),
                _run(ctx, "hello", "chmod", suite="native"),
            )
    assert (honest.status, honest.reward) == (RewardStatus.OK, 0.0), honest
    assert (forged.status, forged.reward) == (honest.status, honest.reward), forged
    assert (half.status, half.reward) == (RewardStatus.OK, 0.5), half
    # The copy out of the container (tar, "data" filter) gives every file u+rw: a chmod 000 does not survive it.
    assert (chmod.status, chmod.reward, chmod.grader_error_by_rollout) == (RewardStatus.OK, 0.5, False), chmod
