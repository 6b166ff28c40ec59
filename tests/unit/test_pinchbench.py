"""PinchBench as published: real task files (tests/fixtures/pinchbench, verbatim), graded as the benchmark grades.

* The suite loads every task that has its assets and lists the others with the reason; ids are the benchmark's.
* The automated checks that read OpenClaw's session transcript score a correct run of a *non-OpenClaw* harness:
  the transcript is built from the conversation the proxy saw (or, when nothing was recorded, from the final
  answer); OpenClaw's own session file is read for OpenClaw only.
* LLM-judge and hybrid tasks go to an OpenAI-compatible judge with the benchmark's prompt; weights as stated.

Grading runs for real in a local sandbox (the check is a subprocess there); the judge is a small aiohttp server.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from producers.harnesses.catalog import ADAPTERS
from producers.proxy.conversation import Message, ToolCall, transcript_messages
from producers.proxy.dialects import parse_anthropic, parse_openai_chat
from producers.sandbox.local_backend import LocalBackend
from producers.sandbox.proxy_admin import ProxyAdmin
from producers.sandbox.rollout import RolloutContext, execute
from producers.sandbox.run_grader import grade
from producers.sandbox.settings import SandboxSettings
from producers.tasks import pinchbench
from producers.tasks.catalog import SuiteCatalog, detect_layout, load_suite
from producers.tasks.grading_rules import GraderFailure
from producers.tasks.model import TaskError
from producers.tasks.transcript import session_transcript
from schemas.events import RewardStatus
from tests.support import sandbox_helpers as S
from tests.support.sandbox_helpers import FIXTURES, ListSink

PINCH = FIXTURES / "pinchbench"
# git blob ids of the published files (github.com/pinchbench/skill @ 14b2993): the fixture is byte for byte
PUBLISHED = {
    "tasks/task_00_sanity.md": "1570e26704f23760d7f4a687cbb18d0508070685",
    "tasks/task_08_memory.md": "5050f100d1da5607147356347acab1af85516428",
    "tasks/task_10_workflow.md": "26b1b821174ad4977d546e91e2c102d8b83486f0",
    "tasks/task_13_image_gen.md": "47b84e3aa5ebac2a666bd1d0d706002004827312",
    "tasks/task_14_humanizer.md": "c26ebf6319c3071d2433bc5cb3d74afe4fcd3298",
    "tasks/task_18_market_research.md": "81e5239a8f2e0b28812dc5ad0973af82dcea5ded",
    "tasks/task_19_spreadsheet_summary.md": "0804287c28948048acd36cc88dbda1150bcdda7c",
    "tasks/task_20_eli5_pdf_summary.md": "e5c869319a8c10d887c40fc1990779ba27681f49",
    "assets/ai_blog.txt": "5c2787cd422484470faef496ce9e57014503a610",
    "assets/quarterly_sales.csv": "2df343c99fe18c1718885c740861036f28d2f78f",
    "assets/company_expenses.xlsx": "3aecd38f464ffed4d89befe5a34df3a0f191432a",
}
AVAILABLE = {
    "task_00_sanity",
    "task_08_memory",
    "task_10_workflow",
    "task_13_image_gen",
    "task_14_humanizer",
    "task_16_market_research",
    "task_18_spreadsheet_summary",
}


def suite():
    return load_suite(f"pinchbench:{PINCH}")


async def graded(task, tmp_path: Path, edit=None, stdout: str = "", home=None, **kw):
    """Grade ``task`` in a real local sandbox after ``edit`` (the agent's work on the workspace) and ``home`` (what
    the harness left in its HOME); ``kw``: ``messages`` / ``session_dir`` for grade(), the rest sandbox settings."""
    grade_kw = {k: kw.pop(k) for k in ("messages", "session_dir") if k in kw}
    backend = LocalBackend(SandboxSettings(root=tmp_path / "sbx", **kw))
    box = await backend.create("p-" + task.task_id[:20], task)
    try:
        if edit:
            edit(Path(box.host_path(box.workspace)))
        if home:
            home(Path(box.host_path(box.home)))
        return await grade(task, box, stdout, backend.settings, **grade_kw)
    finally:
        report = await box.destroy()
        assert report.clean, report


# --- loading ----------------------------------------------------------------------------------------------------


def test_fixture_is_the_published_files() -> None:
    for rel, blob in PUBLISHED.items():
        data = (PINCH / rel).read_bytes()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, rel


def test_suite_loads_what_has_its_assets_and_lists_the_rest() -> None:
    assert detect_layout(PINCH) == "pinchbench"
    s = suite()
    assert set(s.tasks) == AVAILABLE  # ids as the benchmark defines them: the front matter's
    assert s.tasks["task_16_market_research"].metadata["file"] == "task_18_market_research.md"
    assert s.tasks["task_18_spreadsheet_summary"].metadata["file"] == "task_19_spreadsheet_summary.md"
    assert set(s.unavailable) == {"task_20_eli5_pdf_summary"}
    assert "assets/GPT4.pdf" in s.unavailable["task_20_eli5_pdf_summary"]
    with pytest.raises(TaskError, match="unavailable: .*GPT4.pdf"):
        s.get("task_20_eli5_pdf_summary")
    sheet = s.get("task_18_spreadsheet_summary")
    assert sheet.files["company_expenses.xlsx"] == (PINCH / "assets" / "company_expenses.xlsx").read_bytes()
    assert (sheet.metadata["weight_automated"], sheet.metadata["weight_llm_judge"]) == ("0.6", "0.4")
    assert (s.get("task_10_workflow").metadata["weight_automated"], sheet.timeout_s) == ("0.5", 180)
    memory = s.get("task_08_memory")
    assert memory.files["notes.md"].startswith(b"# Project Phoenix") and memory.grader.transcript == "openclaw_session"
    humanizer = s.get("task_14_humanizer")  # as lib_tasks reads it: the section up to the next '## ', stripped
    assert humanizer.prompt.endswith("`humanized_blog.txt`.\n\n---") and humanizer.grader.files == {}
    assert humanizer.grader.judge_rubric.startswith("### Criterion 1: Skill Usage or Manual Rewrite")
    assert humanizer.grader.judge_context.startswith("The agent should:")
    # no LLM Judge Rubric section: the rubric is the grading criteria, as the benchmark formats them
    assert s.get("task_00_sanity").grader.judge_rubric == "- Agent responded successfully (any response counts)"


def test_per_task_problems_do_not_stop_the_suite(tmp_path: Path) -> None:
    root = tmp_path / "pb"
    shutil.copytree(PINCH, root)
    (root / "tasks" / "task_30_broken.md").write_text("---\nid: [unclosed\n---\n\n## Prompt\n\nhi\n")
    dup = (root / "tasks" / "task_00_sanity.md").read_text()
    (root / "tasks" / "task_31_dup.md").write_text(dup)
    (root / "tasks" / "task_32_nocheck.md").write_text(dup.replace("```python", "```text"))
    (root / "tasks" / "task_32_nocheck.md").write_text(
        (root / "tasks" / "task_32_nocheck.md").read_text().replace("id: task_00_sanity", "id: task_32_nocheck")
    )
    s = load_suite(str(root))
    assert set(s.tasks) == AVAILABLE
    assert "invalid YAML" in s.unavailable["task_30_broken"]
    assert (
        s.unavailable["task_00_sanity (task_31_dup.md)"] == "tasks/task_31_dup.md: id task_00_sanity is taken by "
        "task_00_sanity.md"
    )
    assert "no ```python block" in s.unavailable["task_32_nocheck"]
    assert "GPT4.pdf" in s.unavailable["task_20_eli5_pdf_summary"]
    for md in (root / "tasks").glob("*.md"):
        if md.name != "task_20_eli5_pdf_summary.md":
            md.unlink()
    with pytest.raises(TaskError, match="no PinchBench task could be loaded: .*GPT4.pdf"):
        load_suite(str(root))


# --- automated checks on the transcript -------------------------------------------------------------------------

CLAUDE_SYSTEM = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]


def claude_code_messages(prompt: str, turns: list[tuple[ToolCall, str]], final: str) -> list[dict]:
    """The conversation a Claude Code run sends the proxy (Anthropic Messages) and the last answer, as the seal
    reports it: the proxy's own parser + ``transcript_messages``."""
    msgs: list[dict] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                {"type": "text", "text": prompt},
            ],
        }
    ]
    for call, result in turns:
        msgs.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}],
            }
        )
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]})
    conv = parse_anthropic({"model": "policy", "max_tokens": 256, "system": CLAUDE_SYSTEM, "messages": msgs})
    return transcript_messages(conv.conversation, Message("assistant", final))


async def test_sanity_scores_a_correct_non_openclaw_run(tmp_path: Path) -> None:
    task = suite().get("task_00_sanity")
    stdout = json.dumps({"type": "result", "subtype": "success", "result": "Hello, I'm ready!"})
    messages = claude_code_messages(task.prompt, [], "Hello, I'm ready!")
    good = await graded(task, tmp_path, stdout=stdout, messages=messages)
    assert (good.status, good.reward, good.sub_scores) == (RewardStatus.OK, 1.0, {"agent_responded": 1.0})
    # nothing recorded (a proxy that does not report the conversation): the prompt and the printed final answer
    assert (await graded(task, tmp_path, stdout=stdout)).reward == 1.0
    assert (await graded(task, tmp_path, stdout="")).reward == 0.0
    # what the project did before: the harness's stdout as the transcript → 0 for a correct run
    as_stdout = replace(task, grader=replace(task.grader, transcript="stdout"))
    assert (await graded(as_stdout, tmp_path, stdout=stdout, messages=messages)).reward == 0.0
    # an agent that said nothing scores 0
    silent = await graded(task, tmp_path, messages=[{"role": "user", "content": task.prompt}])
    assert silent.reward == 0.0


async def test_transcript_checks_see_tool_calls_of_a_non_openclaw_run(tmp_path: Path) -> None:
    s = suite()
    research = s.get("task_16_market_research")
    report = (
        "# Executive Summary\n## Datadog\n## New Relic\n## Dynatrace\n## Splunk\n## Grafana\n## Trends\n"
        "| vendor | pricing |\n|---|---|\n| Datadog | $15 per host |\nSubscription cost, free tier. "
        "OpenTelemetry, AI/ML and cloud-native consolidation trends.\n"
    )
    messages = claude_code_messages(
        research.prompt,
        [
            (ToolCall("toolu_1", "WebSearch", {"query": "APM market 2026"}), "Datadog, Dynatrace lead ..."),
            (ToolCall("toolu_2", "Write", {"file_path": "market_research.md", "content": report}), "File created"),
        ],
        "Saved the analysis to market_research.md.",
    )
    write = lambda ws: (ws / "market_research.md").write_text(report)  # noqa: E731
    result = await graded(research, tmp_path, write, messages=messages)  # hybrid, no judge: the automated part
    assert result.status == RewardStatus.UNGRADED and result.sub_scores["used_web_search"] == 1.0
    assert min(result.sub_scores.values()) == 1.0
    no_search = claude_code_messages(research.prompt, [], "Done.")
    assert (await graded(research, tmp_path, write, messages=no_search)).sub_scores["used_web_search"] == 0.0

    image = s.get("task_13_image_gen")  # an OpenAI Chat harness with an image tool (agentloop, opencode, Qwen Code)
    chat = parse_openai_chat(
        {
            "model": "policy",
            "messages": [
                {"role": "system", "content": "You are an agent."},
                {"role": "user", "content": image.prompt},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "generate_image",
                                "arguments": json.dumps(
                                    {"prompt": "robot reading a book in a cafe", "path": "robot_cafe.png"}
                                ),
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "saved robot_cafe.png"},
            ],
        }
    ).conversation
    messages = transcript_messages(chat, Message("assistant", "I generated the image and saved it as robot_cafe.png."))
    result = await graded(
        image, tmp_path, lambda ws: (ws / "robot_cafe.png").write_bytes(b"\x89PNG"), messages=messages
    )
    subs = result.sub_scores
    assert (subs["used_image_tool"], subs["confirmed_generation"], subs["file_saved"]) == (1.0, 1.0, 1.0)


async def test_memory_task_with_qwen_code_shaped_run(tmp_path: Path) -> None:
    task = suite().get("task_08_memory")
    chat = parse_openai_chat(
        {
            "model": "policy",
            "messages": [
                {"role": "system", "content": "You are Qwen Code."},
                {"role": "user", "content": task.prompt},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "read_file", "arguments": '{"absolute_path": "notes.md"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "Beta Release: June 1, 2024"},
            ],
        }
    ).conversation
    messages = transcript_messages(chat, Message("assistant", "The beta release deadline is June 1, 2024."))
    answer = lambda ws: (ws / "answer.txt").write_text("The beta release deadline is June 1, 2024.")  # noqa: E731
    result = await graded(task, tmp_path, answer, messages=messages)
    # read_notes looks for tool "read_file"/"readFile" with params.files — a key OpenClaw's records never carry
    # (their arguments are under "arguments"), so it is 0 here exactly as for OpenClaw itself
    assert result.sub_scores == {
        "file_created": 1.0,
        "correct_date": 1.0,
        "clear_answer": 1.0,
        "read_notes": 0.0,
        "no_hallucination": 1.0,
    }
    assert result.reward == pytest.approx(0.8)
    assert (await graded(task, tmp_path, messages=messages)).reward == 0.0  # no answer.txt


class SealingProxy(ProxyAdmin):
    """The proxy's admin API as the sandbox worker sees it; the seal reports the rollout's last main-agent
    conversation (``messages``) as the serving proxy does."""

    def __init__(self, messages: list[dict] | None, calls_served: int = 1) -> None:
        super().__init__("http://unused", "t")
        self.messages = messages
        self.calls_served = calls_served

    async def register(self, rollout_id: str, **params) -> dict:  # noqa: ANN003
        return {"rollout_id": rollout_id, "secret": "s", "base_url": "http://127.0.0.1:9/r/" + rollout_id}

    async def seal(self, rollout_id: str, attempt_id: str | None = None) -> dict:
        body = {"calls_served": self.calls_served, "status": "ok", "infra_failure": None}
        return body | ({"messages": self.messages} if self.messages is not None else {})

    async def renew(self, rollout_id: str, attempt_id: str, lease_s: float) -> bool:
        return True

    async def forget(self, rollout_id: str, attempt_id: str | None = None, *, finished: bool = False) -> None:
        return None


async def test_worker_grades_from_the_sealed_conversation(tmp_path: Path) -> None:
    """One rollout attempt through the worker's path (sandbox → harness → seal → grade) on task_00_sanity with a
    non-OpenClaw harness: the transcript comes from what the seal reports."""
    task = suite().get("task_00_sanity")
    harness = S.python_adapter("claude-like", 'print(\'{"type": "result", "result": "Hello"}\')')

    async def reward_of(messages: list[dict] | None, adapter=harness, calls_served: int = 1) -> float | None:
        sink = ListSink()

        async def resolve(_adapter):  # noqa: ANN001, ANN202
            return "", ""

        ctx = RolloutContext(
            backend=LocalBackend(SandboxSettings(root=tmp_path / "sbx")),
            proxy=SealingProxy(messages, calls_served),
            catalog=SuiteCatalog({"pinch": str(PINCH)}),
            adapters={adapter.name: adapter},
            sink=sink,
            settings=SandboxSettings(),
            resolve_exe=resolve,
        )
        out = await execute(S.request(task.task_id, adapter.name, suite="pinch", timeout_s=30), ctx)
        assert out.cleanup is not None and out.cleanup.clean
        (reward,) = sink.rewards
        assert reward.status == RewardStatus.OK, reward
        return reward.reward

    assert await reward_of(claude_code_messages(task.prompt, [], "Hello, I'm ready!")) == 1.0
    assert await reward_of([{"role": "user", "content": task.prompt}]) == 0.0
    # The proxy served calls but reports no conversation: the grader never falls back to the harness's own printed
    # answer (forgeable); it reads the prompt alone. Only a proxy that served nothing leaves the harness's records.
    assert await reward_of(None) == 0.0
    assert await reward_of(None, calls_served=0) == 1.0
    assert ADAPTERS["openclaw"].session_dir == ".openclaw/agents"
    assert all(a.session_dir is None for name, a in ADAPTERS.items() if name != "openclaw")


def openclaw_home(records: list[dict]):
    def write(home: Path) -> None:
        sessions = home / ".openclaw" / "agents" / "main" / "sessions"
        sessions.mkdir(parents=True)
        (sessions / "sessions.json").write_text(json.dumps({"agent:main:main": {"sessionId": "abc", "updatedAt": 1}}))
        (sessions / "abc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    return write


async def test_openclaw_own_session_file_is_read_only_without_the_proxys_record(tmp_path: Path) -> None:
    task = suite().get("task_00_sanity")
    answered = session_transcript(
        [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": "Hello, I'm ready!"}]
    )
    silent = [{"role": "user", "content": task.prompt}]
    # the proxy recorded the conversation: graded on it, even for OpenClaw with its own session file (#29: the harness
    # or a process it started can write that file)
    own = await graded(task, tmp_path, home=openclaw_home(answered), messages=silent, session_dir=".openclaw/agents")
    assert own.reward == 0.0
    # no conversation reported (an older proxy): OpenClaw's own file is the fallback
    fallback = await graded(task, tmp_path, home=openclaw_home(answered), session_dir=".openclaw/agents")
    assert fallback.reward == 1.0
    # any other harness: a session file in HOME (the agent could plant one) is never read
    planted = await graded(task, tmp_path, home=openclaw_home(answered), messages=silent)
    assert planted.reward == 0.0


async def test_runner_averages_as_the_benchmark(tmp_path: Path) -> None:
    root = tmp_path / "pb"
    (root / "tasks").mkdir(parents=True)
    check = (
        'def grade(transcript, workspace_path):\n    print("noise", {"x": 1})\n    print(0.9)\n'
        '    return {"a": True, "b": 0.0, "note": "text", "c": "0.5"}\n'
    )
    (root / "tasks" / "task_01_x.md").write_text(
        f"---\nid: task_01_x\ngrading_type: automated\n---\n\n## Prompt\n\nDo x.\n\n## Automated Checks\n\n"
        f"```python\n{check}```\n"
    )
    (root / "tasks" / "task_02_y.md").write_text(
        "---\nid: task_02_y\ngrading_type: automated\n---\n\n## Prompt\n\nDo y.\n\n## Automated Checks\n\n"
        "```python\ndef grade(transcript, workspace_path):\n    return None\n```\n"
    )
    (root / "tasks" / "task_03_z.md").write_text(
        "---\nid: task_03_z\ngrading_type: automated\n---\n\n## Prompt\n\nDo z.\n\n## Automated Checks\n\n"
        "```python\ndef grade(transcript, workspace_path):\n    raise ValueError('bad file')\n```\n"
    )
    s = load_suite(str(root))
    assert s.get("task_01_x").timeout_s == 120  # the benchmark's default
    x = await graded(s.get("task_01_x"), tmp_path)
    # mean of the numeric values (True counts 1, "0.5" does not count but is in the breakdown, "text" is not)
    assert (x.reward, x.sub_scores) == (0.5, {"a": 1.0, "b": 0.0, "c": 0.5})
    assert (await graded(s.get("task_02_y"), tmp_path)).reward == 0.0  # not a dict: 0, as the benchmark
    with pytest.raises(GraderFailure, match="bad file"):  # a crash is an infrastructure failure, never a 0
        await graded(s.get("task_03_z"), tmp_path)


# --- the judge ------------------------------------------------------------------------------------------------


def test_parse_judge_reply_as_the_benchmark() -> None:
    parse = pinchbench.parse_judge_reply
    assert parse('{"scores": {"a": 1.0, "b": 0.5}, "total": 0.8, "notes": "ok"}') == (0.8, {"a": 1.0, "b": 0.5}, "ok")
    assert parse('Sure!\n```json\n{"score": 0.7, "justification": "fine"}\n```') == (0.7, {}, "fine")
    assert parse('{"criteria_scores": {"a": {"score": "0.5", "weight": 1}, "b": {"score": 1}}}') == (
        0.75,
        {"a": 0.5, "b": 1.0},
        "",
    )
    assert parse('{"x": 1} then {"scores": {"a": 0.2}, "total": 0.2}')[0] == 0.2  # the one with scores
    assert parse("I think. Total score: 0.65")[0] == 0.65  # prose fallback
    assert parse("no idea")[0] is None and parse("")[0] is None
    assert parse('{"total": "high"}')[0] is None


async def test_judge_and_hybrid_weights(tmp_path: Path) -> None:
    s = suite()
    replies: list[str] = []
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": replies.pop(0)}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    try:
        humanizer = s.get("task_14_humanizer")
        assert (await graded(humanizer, tmp_path)).status == RewardStatus.UNGRADED  # no judge URL
        messages = claude_code_messages(
            humanizer.prompt,
            [
                (ToolCall("toolu_1", "Read", {"file_path": "ai_blog.txt"}), "In today's fast-paced world ..."),
                (ToolCall("toolu_2", "Write", {"file_path": "humanized_blog.txt", "content": "Look, ..."}), "ok"),
            ],
            "Rewrote it by hand.",
        )
        replies.append('{"scores": {"skill_usage": 0.75, "quality": 0.65}, "total": 0.7, "notes": "manual"}')
        judged = await graded(humanizer, tmp_path, messages=messages, judge_url=url, judge_model="judge-m")
        assert (judged.status, judged.reward, judged.sub_scores) == (
            RewardStatus.OK,
            0.7,
            {"skill_usage": 0.75, "quality": 0.65},
        )
        body = seen[-1]
        assert body["model"] == "judge-m" and body["temperature"] == 0 and len(body["messages"]) == 1
        prompt = body["messages"][0]["content"]
        transcript = session_transcript(messages)
        assert prompt == pinchbench.judge_prompt(humanizer, transcript)  # the benchmark's prompt, word for word
        assert 'Tool: Write({"file_path": "humanized_blog.txt", "content": "Look, ..."})' in prompt
        assert "## Grading Rubric\n### Criterion 1: Skill Usage" in prompt
        assert "## Expected Behavior\nThe agent" in prompt

        sheet = s.get("task_18_spreadsheet_summary")  # hybrid, grading_weights automated 0.6 / llm_judge 0.4
        replies.append('{"scores": {"accuracy": 0.5}, "total": 0.5}')
        report = lambda ws: (ws / "data_summary.md").write_text("Total revenue 119,900; total profit 47,960.")  # noqa: E731
        mixed = await graded(sheet, tmp_path, report, judge_url=url)
        auto = {k.removeprefix("automated."): v for k, v in mixed.sub_scores.items() if k.startswith("automated.")}
        assert auto["report_created"] == auto["total_revenue"] == 1.0 and mixed.sub_scores["llm_judge.accuracy"] == 0.5
        assert mixed.reward == pytest.approx(0.6 * sum(auto.values()) / len(auto) + 0.4 * 0.5)

        replies.append("I cannot grade this.")
        with pytest.raises(GraderFailure, match="no score"):
            await graded(humanizer, tmp_path, judge_url=url)
        replies.append('{"total": 1.5}')
        with pytest.raises(GraderFailure, match="outside"):
            await graded(humanizer, tmp_path, judge_url=url)
    finally:
        await runner.cleanup()
    with pytest.raises(GraderFailure, match="judge at"):  # the judge is gone
        await graded(s.get("task_14_humanizer"), tmp_path, judge_url=url)
