"""Task suites: native, ClawGym-Bench and PinchBench fixtures load and grade known-good / known-bad workspaces.

Grading runs for real: a local sandbox is created (workspace laid out), the workspace is edited the way a good or a
bad agent would, and the task's grader runs inside the sandbox as a subprocess. ClawGym-Bench tasks are three real
published ones, graded as the benchmark does (reward/ inside the workspace after the agent, check.py's sub-scores
captured, nothing of the grader left behind; the hard-coded mount dir rewritten to the sandbox's workspace);
PinchBench: tests/unit/test_pinchbench.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.run_grader import grade
from producers.sandbox.settings import SandboxSettings
from producers.tasks.catalog import SuiteCatalog, detect_layout, load_suite
from producers.tasks.cpu import cpu_suite
from producers.tasks.grading_rules import (
    GraderFailure,
    grader_invocation,
    parse_captured_subscores,
    parse_reward_float,
    parse_subscores,
)
from producers.tasks.model import TaskError
from schemas.events import RewardStatus
from tests.support.sandbox_helpers import FIXTURES, leftover_processes


async def graded(
    task, tmp_path: Path, edit=None, stdout: str = "", left: list | None = None, messages=None, **settings
):
    """Grade ``task`` in a real local sandbox after ``edit`` (the agent's work) on its workspace; ``left`` collects
    the workspace's top-level names after grading."""
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", **settings))
    box = await backend.create("t-" + task.task_id[:20], task)
    try:
        if edit:
            edit(Path(box.host_path(box.workspace)))
        result = await grade(task, box, stdout, backend.settings, messages=messages)
        if left is not None:
            left.append(sorted(p.name for p in Path(box.host_path(box.workspace)).iterdir()))
        return result
    finally:
        report = await box.destroy()
        assert report.clean, report


def test_layout_detection() -> None:
    assert detect_layout(FIXTURES / "native_suite") == "native"
    assert detect_layout(FIXTURES / "clawgym") == "clawgym"
    assert detect_layout(FIXTURES / "pinchbench") == "pinchbench"
    with pytest.raises(TaskError, match="no task"):
        SuiteCatalog({"x": str(FIXTURES / "native_suite")}).task("x", "no_task")
    with pytest.raises(TaskError, match="unknown suite"):
        SuiteCatalog({}).task("nope", "t")


async def test_native_good_and_bad(tmp_path: Path) -> None:
    task = load_suite(str(FIXTURES / "native_suite")).get("sum_numbers")
    assert task.prompt.startswith('The file "numbers.txt"') and task.files == {"numbers.txt": b"2\n3\n4\n"}
    good = await graded(task, tmp_path, lambda ws: (ws / "sum.txt").write_text("9\n"))
    assert good.status == RewardStatus.OK and good.reward == 1.0
    bad = await graded(task, tmp_path, lambda ws: (ws / "sum.txt").write_text("8"))
    assert bad.reward == pytest.approx(2 / 3) and bad.sub_scores["correct"] == 0.0
    with pytest.raises(GraderFailure, match="exited 1"):
        await graded(load_suite(str(FIXTURES / "native_suite")).get("bad_grader"), tmp_path)


CLAWGYM = FIXTURES / "clawgym"  # three real ClawGym-Bench tasks, verbatim (tests/fixtures/clawgym/README.md)


def solve(task_id: str):
    """The edit a correct agent makes: the task's solution files laid over the workspace."""
    return lambda ws: shutil.copytree(FIXTURES / "clawgym_solutions" / task_id, ws, dirs_exist_ok=True)


def test_clawgym_real_layout_loads() -> None:
    suite = load_suite(f"clawgym:{CLAWGYM}")
    assert set(suite.tasks) == {"task_0008", "task_0078", "task_0085"} and not suite.unavailable
    task = suite.get("task_0078")
    assert task.mount_dir == "/root/.openclaw/workspace" and task.split == "test"
    assert task.metadata["grading_type"] == "automated" and json.loads(task.metadata["metadata"])["category"] == ""
    assert task.files["input/backup_date.txt"] == b"2026-04-14"
    g = task.grader
    assert (
        set(g.files) == {"reward.sh", "check.py"}
        and g.files["reward.sh"] == (CLAWGYM / "task_0078/reward/reward.sh").read_bytes()
    )
    assert g.workspace_folder == "reward" and g.subscores_script == "check.py" and g.output == "reward_float"
    # The published reward.sh expects check.py inside the workspace, at the hard-coded mount dir.
    assert b"python3 /root/.openclaw/workspace/reward/check.py /root/.openclaw/workspace" in g.files["reward.sh"]


def test_clawgym_invocation_in_a_container_is_byte_for_byte() -> None:
    """Where the workspace is mounted at the benchmark's path (docker backend) the scripts run unmodified."""
    task = load_suite(str(CLAWGYM)).get("task_0085")
    ws = "/root/.openclaw/workspace"
    inv = grader_invocation(task, python="python3", grader_dir="/grader", workspace=ws)
    assert inv.files == dict(task.grader.files) and inv.files_dir == f"{ws}/reward" and inv.cwd == ws
    assert inv.argv == ["bash", f"{ws}/reward/reward.sh"] and inv.extra_path == "/grader/bin"
    assert inv.env["OPENCLAW_REWARD_PAYLOAD"] == f"{ws}/.openclaw_reward_payload.json"
    assert inv.env["CLAWSTREAM_SUBSCORES_SCRIPT"] == f"{ws}/reward/check.py"
    assert inv.workspace_entries == ("reward", ".openclaw_reward_payload.json")


async def test_clawgym_untouched_and_solved(tmp_path: Path) -> None:
    """Graded as the benchmark grades: an untouched workspace scores its true low value, a solved one 1.0; the
    sub-scores are what check.py prints (one line or indented JSON), and no grader file outlives grading."""
    suite = load_suite(f"clawgym:{CLAWGYM}")
    left: list[list[str]] = []
    low = {"task_0008": 0.0, "task_0078": 1 / 12, "task_0085": 0.0}
    for task_id, want in low.items():
        task = suite.get(task_id)
        untouched = await graded(task, tmp_path, left=left)
        assert untouched.status == RewardStatus.OK and untouched.reward == pytest.approx(want), untouched
        solved = await graded(task, tmp_path, solve(task_id), left=left)
        assert solved.status == RewardStatus.OK and solved.reward == 1.0, solved
        assert solved.sub_scores and set(solved.sub_scores.values()) == {1.0}
    scan = (await graded(suite.get("task_0008"), tmp_path, solve("task_0008"))).sub_scores
    assert len(scan) == 8 and scan["report_closing_line_present"] == 1.0  # check.py prints json.dumps(indent=2)
    backup = (await graded(suite.get("task_0078"), tmp_path)).sub_scores
    assert backup["no_writes_outside_output"] == 1.0 and backup["reward"] == 0.0 and len(backup) == 12
    assert all("reward" not in names and ".openclaw_reward_payload.json" not in names for names in left)


async def test_clawgym_agent_cannot_plant_or_keep_the_checks(tmp_path: Path) -> None:
    """What the agent leaves under reward/ (a check.py printing all ones, a link out of the workspace) or as the
    payload file is replaced by the real checks before grading; the reward and the sub-scores stay the true ones."""
    task = load_suite(str(CLAWGYM)).get("task_0085")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the agent's to delete")

    def plant(ws: Path) -> None:
        (ws / "reward").mkdir()
        (ws / "reward" / "check.py").write_text('import json; print(json.dumps({"all": 1.0}))\n')
        (ws / "reward" / "extra.py").write_text("")
        (ws / ".openclaw_reward_payload.json").symlink_to(outside / "keep.txt")

    planted = await graded(task, tmp_path, plant)
    assert planted.reward == 0.0 and "all" not in planted.sub_scores and "checklist_exists" in planted.sub_scores
    assert (outside / "keep.txt").read_text() == "not the agent's to delete"

    def link(ws: Path) -> None:
        (ws / "reward").symlink_to(outside, target_is_directory=True)

    linked = await graded(task, tmp_path, link)
    assert linked.reward == 0.0 and sorted(p.name for p in outside.iterdir()) == ["keep.txt"]


async def test_clawgym_payload_reaches_the_grader(tmp_path: Path) -> None:
    """$OPENCLAW_REWARD_PAYLOAD names {final_message, metadata, transcript (OpenClaw session records)} while reward.sh
    runs (a train task reads it); here a copy of task_0085 whose check.py reports what it found."""
    src = CLAWGYM / "task_0085"
    suite_dir = tmp_path / "suite"
    shutil.copytree(src, suite_dir / "task_0085")
    (suite_dir / "task_0085" / "reward" / "check.py").write_text(
        "import json, os, sys\n"
        "p = json.load(open(os.environ['OPENCLAW_REWARD_PAYLOAD']))\n"
        "print(json.dumps({'final': float(p['final_message'] == 'all done'), "
        "'meta': float(p['metadata'] == {'category': '', 'grading_type': 'automated'}), "
        "'cwd': float(os.getcwd() == sys.argv[1]), "
        "'session': float([r['type'] for r in p['transcript']][0] == 'session')}))\n"
    )
    task = load_suite(f"clawgym:{suite_dir}").get("task_0085")
    assert task.grader.transcript == "openclaw_session"  # the benchmark's payload holds OpenClaw's session records
    conversation = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": "all done"}]
    got = await graded(task, tmp_path, messages=conversation)
    assert got.reward == 1.0 and got.sub_scores == {"final": 1.0, "meta": 1.0, "cwd": 1.0, "session": 1.0}


def test_clawgym_broken_task_is_listed_unavailable(tmp_path: Path) -> None:
    shutil.copytree(CLAWGYM / "task_0085", tmp_path / "task_0085")
    (tmp_path / "task_9999").mkdir()
    (tmp_path / "task_9999" / "data_entry.json").write_text('{"task_id": "task_9999", "user_query": "x"}')
    suite = load_suite(f"clawgym:{tmp_path}")
    assert set(suite.tasks) == {"task_0085"} and "no reward/reward.sh" in suite.unavailable["task_9999"]
    with pytest.raises(TaskError, match="unavailable: .*reward.sh"):
        suite.get("task_9999")


def test_captured_subscores() -> None:
    assert parse_captured_subscores('{\n  "a": 1.0,\n  "b": 0.0\n}\n') == {"a": 1.0, "b": 0.0}
    assert parse_captured_subscores('{"reward": 0.5, "ok": true, "note": "x"}\n') == {"reward": 0.5, "ok": 1.0}
    assert parse_captured_subscores("noise\n{'x': 1}\n") == {"x": 1.0}
    assert parse_captured_subscores("") == {}


@pytest.mark.serial  # its leftover check is machine-wide
async def test_cpu_suite_graders(tmp_path: Path) -> None:
    suite = cpu_suite()
    assert len(suite.split("train")) >= 64 and len(suite.split("heldout")) >= 32
    assert not {t.prompt for t in suite.split("train")} & {t.prompt for t in suite.split("heldout")}
    assert cpu_suite().tasks.keys() == suite.tasks.keys()  # deterministic
    task = next(t for t in suite.split("train") if t.metadata["template"] == "replace")
    checks = json.loads(task.grader.files["checks.json"])
    target, want = checks[1]["path"], checks[1]["lines"]
    good = await graded(task, tmp_path, lambda ws: (ws / target).write_text("\n".join(want) + "\n"))
    assert good.reward == 1.0
    bad = await graded(task, tmp_path)
    assert bad.reward == 0.5
    assert leftover_processes() == []


def test_output_parsers() -> None:
    assert parse_subscores('noise\n{"a": 1, "b": 0}\n') == (0.5, {"a": 1.0, "b": 0.0})
    assert parse_reward_float("{'x': 1.0}\n0.75\n") == (0.75, {"x": 1.0})
    for bad in ("", "{}", '{"a": 2}', "nothing"):
        with pytest.raises(GraderFailure):
            parse_subscores(bad)
    with pytest.raises(GraderFailure):
        parse_reward_float("1.5")
