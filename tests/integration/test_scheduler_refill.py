"""Groups solved alike are dropped end to end, and the scheduler's refills still fill every batch with informative
groups; a scheduler killed after its first refill and restarted issues none twice; ``clawstream audit`` says CLEAN.

Real broker; the stack's launch code starts a real proxy, sandbox worker (the built-in ``agentloop`` on a native suite
written here, bubblewrap), the Faust streams worker (``zero_variance="drop"``, batches of 2 groups) and the scheduler
(groups of 2, 2 tasks a step, ``max_policy_lag`` 1, 3 steps); the model is the scripted engine, in this process. Half
the suite's tasks are always solved (their groups' rewards are all equal: dropped); the others are solved by every
other attempt (a 1 and a 0 in a group of 2: trained). No learner runs, so the weight version stays 0: steps 0 and 1
are issued, step 2 waits on the lag for good, and the refills of steps 0 and 1 must go out while it waits. Without
refills (the scheduler before them) steps 0 and 1 leave fewer than 4 informative groups: batch 1 never forms.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from clawstream.stack.process import Stack
from clawstream.stack.services import stack_for, start_rollout_side, start_scheduler, start_streams
from consumers.analytics.audit import read_run
from consumers.analytics.run_log import RunLog
from producers.scheduler.refill import REFILL_KEY
from tests.integration.test_scheduler_restart import _requests
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.scripted_engine import ScriptedEngine, tool_call_text

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
GROUP_SIZE, TASKS_PER_STEP, BATCHES = 2, 2, 2
GRADER = """import json, sys
from pathlib import Path
f = Path(sys.argv[1]) / {name!r}
print(json.dumps({{"content": float(f.is_file() and f.read_text().strip() == {content!r})}}))
"""


def _suite(root: Path) -> Path:
    """4 tasks the script always solves (e*) and 4 it solves every other time (h*)."""
    for kind in ("e", "h"):
        for i in range(4):
            name, content = f"{kind}{i}.txt", f"x{i}"
            task = root / f"{kind}{i}"
            (task / "workspace").mkdir(parents=True)
            (task / "workspace" / "README.md").write_text("scratch\n")
            prompt = f'Create the file "{name}" containing "{content}".'
            (task / "task.json").write_text(json.dumps({"prompt": prompt, "timeout_s": 60, "split": "train"}))
            (task / "grade.py").write_text(GRADER.format(name=name, content=content))
    return root


def _responder() -> Any:
    seen: Counter[str] = Counter()

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tool_response>" in prompt_text:
            return tool_call_text("finish", {"summary": "ok"})
        name, content = re.findall(r'"([^"]+)"', prompt_text.split("<|im_start|>user\n", 1)[-1])[:2]
        seen[name] += 1
        if name.startswith("h") and seen[name] % 2 == 0:
            content = "wrong"
        return tool_call_text("write_file", {"path": name, "content": content})

    return respond


def _batched_groups(log: RunLog) -> dict[str, dict[str, list[float | None]]]:
    """batch id → group id → its trained rewards."""
    out: dict[str, dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for e in log.batches:
        if e.kind != "SEAL" and e.trajectory is not None:
            out[e.batch_id][e.trajectory.group_id or ""].append(e.trajectory.reward)
    return out


async def _until(predicate: Any, timeout: float, what: str, stack: Stack) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := await asyncio.to_thread(predicate)):  # off the loop: the engine answers meanwhile
        for s in stack.services:
            assert s.proc is None or s.proc.poll() is None or s.may_finish, f"{s.name} died:\n{stack.tail(s)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.5)
    return value


async def test_groups_solved_alike_are_refilled_and_every_batch_fills_with_informative_groups(
    kafka_settings: KafkaSettings, tmp_path: Path
) -> None:
    S.require_bwrap()
    kafka, suites = kafka_settings, {"refill": f"native:{_suite(tmp_path / 'suite')}"}
    async with ScriptedEngine(H.tiny_tokenizer(), _responder()) as engine:
        stack = stack_for(kafka, tmp_path / "logs")
        stack.env["CLAWSTREAM_SANDBOX_SEEN_DIR"] = str(tmp_path / "seen")
        try:
            await asyncio.to_thread(start_rollout_side, stack, H.tiny_model_dir(), engine_url=engine.url, suites=suites)
            await asyncio.to_thread(
                start_streams,
                stack,
                tmp_path / "run",
                group_size=GROUP_SIZE,
                batch_groups=TASKS_PER_STEP,
                settle_interval_s=0.0,
                zero_variance="drop",
            )
            settings = {
                "suite": "refill",
                "suites": suites,
                "tasks_per_step": TASKS_PER_STEP,
                "group_size": GROUP_SIZE,
                "harness_mix": {"agentloop": 1.0},
                "max_policy_lag": 1,
                "zero_variance": "drop",
                "seed": 3,
            }
            scheduler = await asyncio.to_thread(start_scheduler, stack, BATCHES + 1, settings)
            refills = lambda: [r for r in _requests(kafka) if REFILL_KEY in r.metadata]  # noqa: E731
            await _until(refills, 150, "a first refill", stack)
            await asyncio.to_thread(stack.kill, scheduler)  # restarted, it rebuilds from the log: nothing twice
            await asyncio.to_thread(stack.restart, scheduler)
            await _until(lambda: len(_batched_groups(read_run(kafka))) >= BATCHES, 200, f"{BATCHES} batches", stack)
            requests = await asyncio.to_thread(_requests, kafka)
        finally:
            await asyncio.to_thread(stack.stop)
    log = read_run(kafka)
    batches = _batched_groups(log)
    for batch_id, groups in batches.items():  # full, and only groups with something to learn
        assert len(groups) == TASKS_PER_STEP, (batch_id, groups)
        for gid, rewards in groups.items():
            assert len(rewards) == GROUP_SIZE and len(set(rewards)) > 1, (batch_id, gid, rewards)
    assert all(r.step in (0, 1) for r in requests), "step 2 waits on the lag (no learner)"
    issued = Counter((r.rollout_id, r.attempt) for r in requests)
    assert max(issued.values()) == 1, [k for k, n in issued.items() if n > 1]
    by_group: dict[str, set[str]] = defaultdict(set)
    for r in requests:
        by_group[r.group_id].add(r.rollout_id)
    assert len(by_group) > BATCHES * TASKS_PER_STEP and all(len(m) == GROUP_SIZE for m in by_group.values())
    env = {**os.environ, "CLAWSTREAM_STREAMS_APP_ID": f"{kafka.topic_prefix}streams"}
    cmd = [sys.executable, "-m", "clawstream", "audit", "--topic-prefix", kafka.topic_prefix]
    done = subprocess.run(  # noqa: S603 - our own command
        [*cmd, "--bootstrap", bootstrap_servers(kafka)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "CLEAN" in done.stdout, done.stdout + done.stderr
