"""Demonstrations through the real opencode binary, then SFT from the event log (#32 items 1 and 2).

Real parts: the Kafka broker, the serving proxy, one sandbox worker running opencode (npm ``opencode-ai``) in local
sandboxes, the streams worker (trajectories). The model is the shipped scripted teacher (``warmstart/teacher.py``
served by ``warmstart/scripted_engine.py``): it solves two built-in CPU tasks — a new file (opencode's ``write``
tool) and a word replaced in an existing file (its ``bash`` tool) — with opencode's own tool calls.

Asserts: both rollouts graded 1.0 with every sub-score 1.0, both on the trajectories topic with reward 1.0; the rows
``sft --from-topics`` trains on carry, as targets, exactly the generated tokens of the rollouts' main calls on the
calls topic; a few seeded SFT steps from that prefix lower the loss on those demonstrations and raise the model's
mean log-prob of the recorded assistant tokens; the model directory has its recipe and sha256.

opencode is installed from the npm registry on first use; without npm or the package the test SKIPS with the reason
(and FAILS under ``CI=true``, where the real harness must run).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from clawbase.kafka.clients import make_consumer
from producers.tasks.catalog import load_suite
from schemas.events import CallEvent, CallKind, RewardStatus, Trajectory
from schemas.topics import CALLS, TRAJECTORIES
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.harness_tasks import installed
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack
from tests.support.stream_harness import Worker as StreamsWorker
from warmstart.sft import weights_sha256
from warmstart.sft_rows import build_rows
from warmstart.sft_topics import TopicSFTConfig, sft_from_topics
from warmstart.teacher import Teacher

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
TASKS = ("train-000-write", "train-003-replace")  # a new file (write tool), an existing one changed (bash tool)


def _install_or_skip() -> None:
    try:
        installed("opencode")
    except pytest.skip.Exception as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: the real harness must run, but {exc.msg}", pytrace=False)
        raise


def _read(kafka, topic: str, decode, until, timeout: float) -> list:  # noqa: ANN001
    consumer = make_consumer(kafka, f"check-{os.urandom(4).hex()}")
    consumer.subscribe([kafka.topic(topic)])
    out: list = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(out):
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(decode(msg.value()))
    finally:
        consumer.close()
    return out


@pytest.mark.timeout(600)
@pytest.mark.serial  # assert_clean checks that no sandbox process is left anywhere on the machine (`make test` phase 3)
async def test_teacher_demos_through_opencode_then_sft_from_topics(kafka_settings, group_id, tmp_path) -> None:
    await asyncio.to_thread(_install_or_skip)
    from policy.tiny_model import init_tiny_model

    suite = load_suite("builtin:cpu")
    tasks = [suite.tasks[t] for t in TASKS]
    sandboxes = tmp_path / "sandboxes"
    teacher = Teacher("opencode", tasks, sandboxes)
    (tmp_path / "streams").mkdir()
    streams = StreamsWorker(
        kafka_settings,
        tmp_path / "streams",
        app_id=f"streams-{group_id}",
        store="memory://",
        group_size=2,
        batch_groups=1,
        settle_interval_s=1.0,
        commit_interval_s=0.5,
    )
    streams.start()
    reqs = [S.request(t, "opencode", suite="cpu", rollout_id=f"demo-{t}", timeout_s=180, step=1) for t in TASKS]
    ids = {r.rollout_id for r in reqs}
    try:
        async with stack(
            kafka_settings, group_id, tmp_path, teacher.respond, suites={"cpu": "builtin:cpu"}, concurrency=2
        ):
            events, rewards = await run_requests(kafka_settings, reqs, timeout=300)
        ev, rw = by_rollout(events, rewards)
        log = f"teacher {teacher.log}; events {ev}; rewards {rw}"
        for rid in ids:
            (reward,) = rw[rid]
            assert reward.status == RewardStatus.OK and reward.reward == 1.0, log
            assert set(reward.sub_scores.values()) == {1.0}, log
        assert_clean(sandboxes)

        def complete(got: list[Trajectory]) -> bool:
            return {t.rollout_id for t in got if t.reward is not None} >= ids

        got = await asyncio.to_thread(_read, kafka_settings, TRAJECTORIES, Trajectory.from_bytes, complete, 180)
        assert complete(got), streams.log_tail()
    finally:
        streams.stop()
    assert {t.harness for t in got if t.rollout_id in ids} == {"opencode"}
    assert all(t.reward == 1.0 for t in got if t.rollout_id in ids)

    # The rows' targets are exactly the generated tokens of the main calls the proxy recorded, in order.
    calls = await asyncio.to_thread(
        _read, kafka_settings, CALLS, CallEvent.from_bytes, lambda c: False, 8
    )  # everything published so far
    rows, _ = build_rows(got, min_reward=1.0)
    for rid in ids:
        mine = sorted((c for c in calls if c.rollout_id == rid and c.call_kind == CallKind.MAIN), key=lambda c: c.seq)
        recorded = [int(t) for c in mine for t in c.generated_tokens]
        (row,) = [r for r in rows if r.rollout_id == rid]
        assert [t for t, m in zip(row.ids, row.mask, strict=True) if m] == recorded, rid
        assert len(mine) == len(teacher_turns(teacher.log, rid)), (rid, teacher.log)

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
    out = tmp_path / "sft"
    cfg = TopicSFTConfig(prefix=kafka_settings.topic_prefix, steps=6, lr=1e-2, batch_size=2, seed=0, checkpoint_every=3)
    summary = await asyncio.to_thread(sft_from_topics, model, out, cfg, kafka_settings)
    print(json.dumps({k: summary[k] for k in ("rows", "before", "after", "history", "train_s")}))
    assert summary["rows"] == 2 and summary["rollouts"] == sorted(ids)
    assert summary["after"]["loss"] < summary["before"]["loss"] - 0.1, summary
    assert summary["after"]["target_logprob"] > summary["before"]["target_logprob"], summary
    written = json.loads((out / "sft_summary.json").read_text())
    assert written["sha256"] == weights_sha256(out) and written["recipe"]["prefix"] == kafka_settings.topic_prefix
    # --checkpoint-every 3 of 6 steps: step 3 saved on the way (other weights than the base and the end), step 6 is OUT
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-3"]
    mid = weights_sha256(out / "checkpoints" / "step-3")
    assert mid not in (written["sha256"], written["base_sha256"]), written
    assert (out / "checkpoints" / "step-3" / "tokenizer.json").is_file()


def teacher_turns(log: list[str], rollout_id: str) -> list[str]:
    """The teacher's main answers to one task (``task_id:turn``), from its log."""
    task = rollout_id.removeprefix("demo-")
    return [entry for entry in log if entry.startswith(f"{task}:")]


def _running(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (not gone, not a zombie)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] != "Z":
                    out.add(pid)
        except FileNotFoundError:
            pass
    return out


def _children(pid: int) -> set[int]:
    kids: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(x) for x in f.read().split()}
    return kids


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_ends_a_recording_at_once_with_its_processes(kafka_settings, tmp_path, signame: str) -> None:
    """`clawstream model demos` interrupted (Ctrl-C, or `kill`) once its first demonstration is on the topics: it exits
    130 within seconds (it polled on to its deadline, ~1 h for 400 tasks, and then waited for the rollouts in flight),
    and the streams worker it started is gone (SIGTERM ended it at once, without its ``finally``)."""
    import signal
    import subprocess
    import sys

    _install_or_skip()
    argv = [sys.executable, "-u", "-m", "warmstart.record", "--harness", "opencode", "--tasks", "6"]
    argv += ["--concurrency", "1", "--prefix", kafka_settings.topic_prefix]
    argv += ["--bootstrap", kafka_settings.bootstrap_servers]
    # A terminal's Ctrl-C reaches a foreground process whose SIGINT is at its default. Started from a background
    # shell (CI's `.ci/run &`) every child inherits SIGINT *ignored*, Python then installs no KeyboardInterrupt
    # handler and the signal below would do nothing (CI: the recording ran on to 6/6); give the child the default.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("[demos] 1/6"):  # the state that chooses the moment: one demonstration recorded
                break
        assert lines and lines[-1].startswith("[demos] 1/6"), "".join(lines[-20:])
        kids = _children(proc.pid)
        assert kids, "the recording's streams worker should be its child"
        proc.send_signal(getattr(signal, signame))
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        waited = time.monotonic() - sent
        assert proc.returncode == 130 and "interrupted" in out, out[-2000:]
        assert waited < 60, f"{waited:.0f} s from Ctrl-C to exit"
        # The proxy's body-precheck forkserver is a child too: it can only see its parent's death once that happened
        # (its pipe's EOF), so it gets a moment after the recording is reaped; one that stays is a leak.
        left = _running(kids)
        grace = time.monotonic() + 15
        while left and time.monotonic() < grace:
            time.sleep(0.1)
            left = _running(kids)
        assert not left, f"processes left running: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
