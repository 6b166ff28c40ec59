"""Task suites: native, ClawGym-Bench and PinchBench fixtures load and grade known-good / known-bad workspaces.

Grading runs for real: a local sandbox is created (workspace laid out), the workspace is edited the way a good or a
bad agent would, and the task's grader runs inside the sandbox as a subprocess. ClawGym's hard-coded mount dir
must be rewritten to the sandbox's workspace; PinchBench's ``grade(transcript, workspace_path)`` runs through the
runner; LLM-judge tasks are UNGRADED without a judge and scored through a (fake) OpenAI-compatible judge with one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from aiohttp import web

from producers.sandbox.base import SandboxSettings
from producers.sandbox.grade import grade
from producers.sandbox.local_backend import LocalBackend
from producers.tasks.catalog import SuiteCatalog, detect_layout, load_suite
from producers.tasks.cpu import cpu_suite
from producers.tasks.grading import GraderFailure, parse_reward_float, parse_subscores
from producers.tasks.model import TaskError
from schemas.events import RewardStatus
from tests.support.sandbox_helpers import FIXTURES, leftover_processes


async def graded(task, tmp_path: Path, edit=None, stdout: str = "", **settings):
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", **settings))
    box = await backend.create("t-" + task.task_id[:20], task)
    try:
        if edit:
            edit(Path(box.host_path(box.workspace)))
        return await grade(task, box, stdout, backend.s)
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


async def test_clawgym_mount_dir_is_mapped(tmp_path: Path) -> None:
    suite = load_suite(f"clawgym:{FIXTURES / 'clawgym'}")
    task = suite.get("task_0001")
    assert task.mount_dir == "/root/.openclaw/workspace"
    assert task.files == {"sales.csv": b"item,amount\npen,12\nbook,30\n"}
    assert task.grader.mount_dir_rewrite == "/root/.openclaw/workspace"
    good = await graded(task, tmp_path, lambda ws: (ws / "total.txt").write_text("42\n"))
    assert good.status == RewardStatus.OK and good.reward == 1.0
    assert good.sub_scores == {"total_exists": 1.0, "total_correct": 1.0, "input_intact": 1.0}
    bad = await graded(task, tmp_path, lambda ws: (ws / "total.txt").write_text("41"))
    assert bad.reward == pytest.approx(2 / 3)
    none = await graded(task, tmp_path)
    assert none.reward == pytest.approx(1 / 3)


async def test_pinchbench_automated(tmp_path: Path) -> None:
    suite = load_suite(str(FIXTURES / "pinchbench"))
    assert set(suite.tasks) == {"task_01_sum_fix", "task_02_summary", "task_03_trend"}
    task = suite.get("task_01_sum_fix")
    assert task.timeout_s == 120 and "sum_n(n)" in task.prompt and "sum.py" in task.files
    fixed = "def sum_n(n):\n    return n * (n + 1) // 2\n"
    transcript = json.dumps({"type": "result", "result": "fixed"})
    good = await graded(task, tmp_path, lambda ws: (ws / "sum.py").write_text(fixed), stdout=transcript)
    assert good.reward == 1.0, good
    bad = await graded(task, tmp_path)  # untouched: still off by one
    assert bad.sub_scores == {"file_exists": 1.0, "correct": 0.0, "transcript_seen": 1.0}


async def test_pinchbench_judge(tmp_path: Path) -> None:
    suite = load_suite(str(FIXTURES / "pinchbench"))
    judge_only, hybrid = suite.get("task_02_summary"), suite.get("task_03_trend")
    assert judge_only.files == {"notes.txt": b"Meeting moved to Friday."}
    assert hybrid.files["prices.csv"].startswith(b"day")
    ungraded = await graded(judge_only, tmp_path)
    assert ungraded.status == RewardStatus.UNGRADED and ungraded.reward is None
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": '{"score": 0.5}'}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        judged = await graded(judge_only, tmp_path, judge_url=url)
        assert judged.status == RewardStatus.OK and judged.reward == 0.5
        mixed = await graded(hybrid, tmp_path, lambda ws: (ws / "trend.txt").write_text("up"), judge_url=url)
        assert mixed.reward == pytest.approx(0.6 * 1.0 + 0.4 * 0.5)
        assert "Score 1.0 when the trend is right" in seen[-1]["messages"][0]["content"]
    finally:
        await runner.cleanup()


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
