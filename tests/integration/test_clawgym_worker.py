"""Real ClawGym-Bench tasks through the sandbox worker: real Kafka broker, real serving proxy, scripted engine, local
sandboxes, the built-in agent loops as harnesses.

The three published tasks of ``tests/fixtures/clawgym`` (verbatim) are solved by a scripted policy through the
agent loops' tools (``run`` the task's own tool, ``write_file`` the answers; the Anthropic variant for one of them),
left untouched, or tampered with (the agent writes its own ``reward/check.py`` and payload file). Graded as the
benchmark grades — ``reward/`` copied into the workspace only after the harness ended, ``reward.sh`` run as published,
``check.py``'s sub-scores captured — solved workspaces score 1.0, untouched ones their true low value (0 or 1/12),
the tampered one its true 0.0 with the real sub-scores; the agent never saw ``reward/``; every attempt is graded OK
(no GraderFailure), and no sandbox directory or process survives.
"""

from __future__ import annotations

import pytest

from schemas.events import RewardStatus, RolloutState
from tests.support import sandbox_helpers as S
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack
from tests.support.scripted_engine import tool_call_text

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # its leftover check is machine-wide

SOLUTIONS = S.FIXTURES / "clawgym_solutions"


def _solution(task_id: str, rel: str) -> str:
    return (SOLUTIONS / task_id / rel).read_text()


# What the scripted policy does per task, recognised by a phrase of the task's prompt: (tool role, arguments).
SOLVE = {
    "Nimbus rollout": [
        ("write", "output/nimbus_checklist.md", _solution("task_0085", "output/nimbus_checklist.md")),
        ("write", "output/context_sources.json", _solution("task_0085", "output/context_sources.json")),
    ],
    "dependency scan": [
        (
            "run",
            "python3 tools/deps_audit.py --deps input/dependencies.json --db input/vuln_db.json "
            "--out out/scan_results.json",
        ),
        ("write", "out/security_status_update.md", _solution("task_0008", "out/security_status_update.md")),
    ],
    "config backup workflow": [
        (
            "run",
            "mkdir -p output/backup_store/2026-04-14 && cp -r input/openclaw_current/. "
            "output/backup_store/2026-04-14/ && rm -rf output/backup_store/2026-04-14/workspace",
        ),
        ("write", "output/openclaw/backup.json", _solution("task_0078", "output/openclaw/backup.json")),
        ("write", "output/backup_store/changelog.md", _solution("task_0078", "output/backup_store/changelog.md")),
    ],
}
TAMPER = {
    "Nimbus rollout": [
        ("run", "ls -a; ls -a reward"),
        ("write", "reward/check.py", 'import json\nprint(json.dumps({"all": 1.0}))\n'),
        ("write", ".openclaw_reward_payload.json", "{}"),
    ],
}


def planned(plans: dict[str, list[tuple[str, ...]]], seen: dict[tuple[str, int], str]):
    """Scripted policy for agentloop / agentloop-anthropic: the plan's next step (one per tool response so far),
    then the finish tool; a task without a plan is finished at once. ``seen[(phrase, n)]``: the n-th tool response
    (and what follows it in the prompt) of the planned task."""

    def respond(prompt_text: str, _ids: list[int], _body: dict) -> str:
        anthropic = '"name": "Write"' in prompt_text
        task = prompt_text.split("<|im_start|>user\n", 1)[-1]
        phrase, steps = next(((k, plan) for k, plan in plans.items() if k in task), ("", []))
        done = prompt_text.count("<tool_response>")
        if done and phrase:
            seen[(phrase, done)] = prompt_text.rsplit("<tool_response>", 1)[1]
        if done >= len(steps):
            if anthropic:
                return tool_call_text("Done", {"message": "ok"})
            return tool_call_text("finish", {"summary": "ok"})
        role, *args = steps[done]
        if role == "run":
            return (
                tool_call_text("Shell", {"command": args[0]})
                if anthropic
                else tool_call_text("run", {"command": args[0], "timeout": 30})
            )
        if anthropic:
            return tool_call_text("Write", {"file_path": args[0], "content": args[1]})
        return tool_call_text("write_file", {"path": args[0], "content": args[1]})

    return respond


@pytest.mark.timeout(300)
async def test_clawgym_tasks_graded_as_published(kafka_settings, group_id, tmp_path) -> None:
    seen: dict[tuple[str, int], str] = {}
    suites = {"clawgym": str(S.FIXTURES / "clawgym")}
    solve = [
        S.request("task_0085", "agentloop", suite="clawgym", rollout_id="solve-0085"),
        S.request("task_0008", "agentloop", suite="clawgym", rollout_id="solve-0008"),
        S.request("task_0078", "agentloop-anthropic", suite="clawgym", rollout_id="solve-0078"),
    ]
    other = [
        S.request("task_0008", "agentloop", suite="clawgym", rollout_id="idle-0008"),
        S.request("task_0078", "agentloop", suite="clawgym", rollout_id="idle-0078"),
        S.request("task_0085", "agentloop", suite="clawgym", rollout_id="tamper-0085"),
    ]
    async with stack(kafka_settings, group_id, tmp_path, planned(SOLVE, seen), suites=suites) as st:
        events, rewards = await run_requests(kafka_settings, solve, timeout=150)
        seen.clear()
        st["engine"].script = planned(TAMPER, seen)
        more = await run_requests(kafka_settings, other, timeout=150)
    ev, rw = by_rollout(events + more[0], rewards + more[1])
    for r in solve + other:
        assert [e.state for e in ev[r.rollout_id]] == [RolloutState.STARTED, RolloutState.HARNESS_EXITED], (
            r.rollout_id,
            ev[r.rollout_id],
        )
        (reward,) = rw[r.rollout_id]
        assert reward.status == RewardStatus.OK and reward.grader == "clawgym_reward_sh", reward
    for r in solve:
        reward = rw[r.rollout_id][0]
        assert reward.reward == 1.0 and set(reward.sub_scores.values()) == {1.0}, reward
    assert len(rw["solve-0008"][0].sub_scores) == 8  # check.py's indented JSON, captured as it printed it
    assert rw["idle-0008"][0].reward == 0.0 and set(rw["idle-0008"][0].sub_scores.values()) == {0.0}
    idle_backup = rw["idle-0078"][0]
    assert idle_backup.reward == pytest.approx(1 / 12) and idle_backup.sub_scores["no_writes_outside_output"] == 1.0
    tampered = rw["tamper-0085"][0]
    assert tampered.reward == 0.0 and "all" not in tampered.sub_scores, tampered
    assert tampered.sub_scores["checklist_exists"] == 0.0 and len(tampered.sub_scores) == 12
    listing = seen[("Nimbus rollout", 1)].split("</tool_response>")[0]  # what `ls -a; ls -a reward` showed
    assert "input" in listing and "check.py" not in listing and "No such file" in listing, listing
    assert_clean(tmp_path / "sandboxes")
