"""One training batch that mixes every harness adapter of the harness matrix (``HARNESSES``) on a real ClawGym-Bench
task — the paper's mix-harness setting at toy scale.

Real parts: the Kafka broker, the serving proxy, one sandbox worker running Claude Code, Codex, Qwen Code, OpenClaw
(Node 24), opencode, Gemini CLI, mini-swe-agent, agentloop and agentloop-anthropic as real processes in local
sandboxes, the streams worker (assembler → grouper → batcher, exactly-once), the learner process, and the CPU
inference worker following the weight versions. The model double is the scripted engine
(``tests/support/scripted_engine.py``): per harness, one rollout of its group of two solves ``task_0085`` with the
harness's own write tool (reward 1.0) and the other writes a wrong checklist and stops (reward well below 1), so every
group of two has reward variance and survives GRPO's zero-variance rule. Asserts: two graded rollouts and one group
(task × harness) per harness, one batch holding every group — two rollouts of each harness with advantages ±1 — that
the learner trains into weight version 1, which the inference worker then serves. Prints the per-harness table the
README shows (calls, tokens, tree leaves, prefix reuse, reward).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import bootstrap_servers, make_consumer
from schemas.events import BatchRecord, BatchRecordKind, RewardStatus, Trajectory, WeightVersion
from schemas.topics import BATCHES, TRAJECTORIES, WEIGHTS
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.harness_tasks import (
    CLAWGYM_PHRASE,
    FINAL,
    HARNESSES,
    RELATIVE,
    WRITE,
    final_answer,
    installed,
    solution_files,
    workspace_pattern,
)
from tests.support.inference import Worker as InferenceWorker
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack
from tests.support.scripted_engine import tool_call_text
from tests.support.stream_harness import Worker as StreamsWorker

# serial: assert_clean checks that no sandbox process is left anywhere on the machine (`make test` phase 3)
pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.serial]
ROOT = Path(__file__).resolve().parents[2]
UNSOLVED = "UNSOLVED checklist: nothing recovered yet\n"  # the failing rollout's only file


def mixed_responder(sandboxes: str, seen: list[str]):
    """Per harness, the first rollout to ask solves the task and the second fails it (see the module docstring).

    A harness is told apart by its tool block (normalised: it may name the sandbox's workspace); a conversation's
    path is told by what it already wrote (the failing path wrote :data:`UNSOLVED`)."""
    ws_re = workspace_pattern(sandboxes)
    solution = solution_files()
    starts: dict[str, int] = defaultdict(int)

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # title / side call
            seen.append("side")
            return '{"title": "Nimbus checklist"}'
        tools = ws_re.sub("<ws>", prompt_text.partition("XML tags:\n<tools>")[2].partition("</tools>")[0])
        name = harness_of(tools)
        if name == "qwen-code" and "Qwen Code" not in prompt_text:
            name = "gemini-cli"  # Qwen Code is a fork of Gemini CLI: the same write tool; its prompt names itself
        if name not in WRITE:
            seen.append(name)
            return f"{name}: no harness of the test has this tool set"  # fails the reward, shown in `seen`
        conversation = prompt_text.partition("<|im_start|>user")[2]
        assert CLAWGYM_PHRASE in conversation, "only task_0085 runs here"
        done = conversation.count("<tool_response>")
        found = ws_re.search(prompt_text)
        ws = found.group(0) if found else ""
        if done == 0:
            starts[name] += 1
            failing = starts[name] % 2 == 0
            seen.append(f"{name}:{'fail' if failing else 'solve'}")
            if found is None and name not in RELATIVE:
                return f"{name}: the harness prompt names no sandbox workspace"
            rel, content = (solution[0][0], UNSOLVED) if failing else solution[0]
            return tool_call_text(*WRITE[name](ws, rel, content))
        if UNSOLVED.strip() in conversation or done >= len(solution):
            return final_answer(name, FINAL["clawgym"])
        return tool_call_text(*WRITE[name](ws, *solution[done]))

    return respond


def harness_of(tools: str) -> str:
    """Which harness's tool block this is: the write tool's name and argument names decide (WRITE)."""
    for name in HARNESSES:
        tool, args = WRITE[name]("", "x/y", "")
        if re.search(rf'"name":\s*"{re.escape(tool)}"', tools) and all(f'"{a}"' in tools for a in args):
            if name in ("agentloop", "qwen-code") and ('"file_path"' in tools) != (name == "qwen-code"):
                continue  # both call it write_file: Qwen Code's takes file_path, the built-in loop's path
            if name in ("openclaw", "opencode") and ('"filePath"' in tools) != (name == "opencode"):
                continue  # both call it write: opencode's takes filePath, OpenClaw's path
            if name in ("claude-code", "agentloop-anthropic"):  # both call it Write (file_path, content)
                is_builtin = '"Shell"' in tools  # the built-in Anthropic loop's tool set: Read, Write, LS, Shell
                if is_builtin != (name == "agentloop-anthropic"):
                    continue
            return name
    return "unknown-" + hashlib.sha1(tools.encode()).hexdigest()[:8]


def _read(kafka, topics: list[str], until, timeout: float) -> list[tuple[str, bytes]]:  # noqa: ANN001
    """(topic, value) of every committed record of ``topics`` until ``until(records)`` holds or ``timeout``."""
    consumer = make_consumer(kafka, f"check-{os.urandom(4).hex()}")
    consumer.subscribe([kafka.topic(t) for t in topics])
    names = {kafka.topic(t): t for t in topics}
    out: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(out):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append((names[msg.topic()], msg.value()))
    finally:
        consumer.close()
    return out


def _served_version(url: str) -> int:
    body = {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as resp:  # noqa: S310 - loopback test server
        return int(json.loads(resp.read())["policy_version"])


def _table(trajectories: list[Trajectory], batch: list[BatchRecord]) -> str:
    in_batch = defaultdict(list)
    for rec in batch:
        in_batch[rec.harness].append(rec.advantage)
    rows = [
        "| harness | rollouts | calls | unique tokens | Σ path tokens | leaves | prefix reuse | rewards | "
        "advantages in the batch |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    by_harness: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        by_harness[t.harness].append(t)
    for name in HARNESSES:
        ts = sorted(by_harness[name], key=lambda t: -(t.reward or 0))
        rows.append(
            f"| {name} | {len(ts)} | {sum(t.calls for t in ts)} | {sum(t.unique_tokens for t in ts)} | "
            f"{sum(t.path_tokens for t in ts)} | {sum(t.leaves for t in ts)} | "
            f"{statistics.mean(t.prefix_reuse_ratio for t in ts):.2f} | "
            f"{' / '.join(f'{t.reward:.2f}' for t in ts)} | "
            f"{' / '.join(f'{a:+.2f}' for a in sorted(in_batch[name], reverse=True))} |"
        )
    return "\n".join(rows)


@pytest.mark.timeout(1800)
async def test_one_batch_mixes_all_harnesses_and_trains_a_version_the_engine_serves(
    kafka_settings, group_id, tmp_path
) -> None:
    for name in HARNESSES:
        await asyncio.to_thread(installed, name)
    from policy.tiny_model import init_tiny_model

    # The learner's policy: the proxy's tokenizer (same seed and corpus) on a one-layer net, so a step over
    # harness-sized trees (tens of thousands of tokens) stays short on CPU.
    model = init_tiny_model(
        tmp_path / "policy",
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        progress=None,
    )
    assert (model / "tokenizer.json").read_bytes() == (H.tiny_model_dir() / "tokenizer.json").read_bytes()
    kafka_env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(kafka_settings),
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    (tmp_path / "streams").mkdir()
    streams = StreamsWorker(
        kafka_settings,
        tmp_path / "streams",
        app_id=f"streams-{group_id}",
        store="memory://",
        group_size=2,
        batch_groups=len(HARNESSES),
        settle_interval_s=1.0,
        commit_interval_s=0.5,
    )
    streams.start()
    learner_log = open(tmp_path / "learner.log", "w+")  # noqa: SIM115 - the child's output, read at the end
    learner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "learner.train",
            "--model-dir",
            str(model),
            "--weight-store",
            str(tmp_path / "store"),
            "--max-steps",
            "1",
            "--idle-exit",
            "1200",
            "--hp",
            "lr=1e-3",
        ],
        cwd=ROOT,
        env={**os.environ, **kafka_env, "PYTHONPATH": str(ROOT)},
        stdout=learner_log,
        stderr=subprocess.STDOUT,
    )
    engine = InferenceWorker(
        ["--model", str(model), "--served-model-name", "policy", "--metrics-interval-s", "0"], kafka_env
    )
    sandboxes = tmp_path / "sandboxes"
    seen: list[str] = []
    reqs = [
        S.request("task_0085", name, suite="clawgym", rollout_id=f"mix-{name}-{k}", timeout_s=300, step=1)
        for name in HARNESSES
        for k in range(2)
    ]
    try:
        t0 = time.monotonic()
        async with stack(
            kafka_settings,
            group_id,
            tmp_path,
            mixed_responder(str(sandboxes), seen),
            suites={"clawgym": str(S.FIXTURES / "clawgym")},
            concurrency=4,
            policy_version=0,
        ) as st:
            events, rewards = await run_requests(kafka_settings, reqs, timeout=900)
            served = len(st["engine"].requests)
        rollouts_s = time.monotonic() - t0
        ev, rw = by_rollout(events, rewards)
        log = f"{served} engine calls {seen}; rewards { {k: [r.reward for r in v] for k, v in rw.items()} }"
        for name in HARNESSES:
            got = sorted(rw[f"mix-{name}-{k}"][0].reward for k in range(2))
            assert all(r.status == RewardStatus.OK for k in range(2) for r in rw[f"mix-{name}-{k}"]), log
            assert got[1] == 1.0 and got[0] < 0.5, (name, log)  # one solved, one failed: GRPO signal in the group
        assert sorted(seen.count(f"{n}:solve") for n in HARNESSES) == [1] * len(HARNESSES), log

        def sealed(records: list[tuple[str, bytes]]) -> bool:
            return any(t == BATCHES and BatchRecord.from_bytes(v).kind == BatchRecordKind.SEAL for t, v in records)

        out = await asyncio.to_thread(_read, kafka_settings, [BATCHES, TRAJECTORIES], sealed, 300)
        assert sealed(out), streams.log_tail()
        batch = [BatchRecord.from_bytes(v) for t, v in out if t == BATCHES]
        trajectories = [Trajectory.from_bytes(v) for t, v in out if t == TRAJECTORIES]
        records, [seal] = (
            [b for b in batch if b.kind == BatchRecordKind.TRAJECTORY],
            [b for b in batch if b.kind == BatchRecordKind.SEAL],
        )
        assert seal.harness_counts == {name: 2 for name in HARNESSES}, seal  # one group of two per harness
        assert sorted((r.harness, round(r.advantage)) for r in records) == sorted(
            (name, a) for name in HARNESSES for a in (1, -1)
        )
        assert len({r.group_id for r in records}) == len(HARNESSES) and all(
            t.status.value == "COMPLETE" for t in trajectories
        )

        table = _table(trajectories, records)
        print(f"\nrollouts {rollouts_s:.0f}s\n{table}", flush=True)
        learner.wait(timeout=900)
        learner_log.seek(0)
        learner_out = learner_log.read()
        assert learner.returncode == 0, learner_out[-4000:]
        versions = [
            WeightVersion.from_bytes(v)
            for _, v in await asyncio.to_thread(_read, kafka_settings, [WEIGHTS], lambda r: len(r) >= 1, 60)
        ]
        assert [(v.policy_version, v.batch_id) for v in versions] == [(1, seal.batch_id)], learner_out[-3000:]
        metrics = versions[0].metrics
        assert metrics["rollouts"] == 2 * len(HARNESSES) and metrics["trainable_tokens"] > 0
        assert {k for k in metrics if k.startswith("reward/")} >= {f"reward/{n}" for n in HARNESSES}
        deadline = time.monotonic() + 60
        while (version := _served_version(engine.url)) < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert version == 1, engine.log()[-3000:]
        assert_clean(sandboxes)
        print(
            f"\nrollouts {rollouts_s:.0f}s; learner step {metrics['step_seconds']:.1f}s, "
            f"{metrics['tokens']:.0f} tokens ({metrics['trainable_tokens']:.0f} trainable), "
            f"loss {metrics.get('loss', float('nan')):.3g}"
        )
    finally:
        engine.stop()
        if learner.poll() is None:
            learner.kill()
        learner_log.close()
        streams.stop()
