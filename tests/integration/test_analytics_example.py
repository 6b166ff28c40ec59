"""The custom analytics consumer example (consumers/analytics/examples/harness_report.py) on a recorded run.

The run: rollouts of three harnesses whose trees are built by the streams' own prefix-tree builder from synthetic
model calls (append-only chains, and branching ones like OpenClaw's), plus an infrastructure failure, an ungraded
rollout and an undecodable record, on the real broker. The example runs as its own process; the numbers it prints
must equal those computed here from the segments themselves (paths walked by hand, not the trajectories' stats).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from schemas.events import Trajectory, TrajectoryStatus, TreeSegment
from schemas.topics import TRAJECTORIES
from streams.tree import TreeCall, build_tree

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _calls(rng: np.random.Generator, turns: int, branches: int) -> list[TreeCall]:
    """A rollout's main calls: a chain of ``turns`` (each prompt = previous prompt + answer + tool output), then
    ``branches`` calls that fork from the first prompt's middle (history laid out anew)."""

    def toks(n: int) -> list[int]:
        return rng.integers(10, 5000, n).tolist()

    calls, context = [], []
    for seq in range(turns):
        new, gen = toks(int(rng.integers(20, 60))), toks(int(rng.integers(5, 15)))
        calls.append(
            TreeCall(
                call_id=f"c{seq}",
                seq=seq,
                parent_call_id=f"c{seq - 1}" if seq else None,
                shared_prefix_len=len(context),
                new_tokens=new,
                generated_tokens=gen,
                logprobs=[-0.5] * len(gen),
                call_kind="main",
                policy_version=1,
            )
        )
        context = context + new + gen
    first = len(calls[0].new_tokens)
    for b in range(branches):
        new, gen = toks(int(rng.integers(30, 80))), toks(8)
        calls.append(
            TreeCall(
                call_id=f"b{b}",
                seq=turns + b,
                parent_call_id="c0",
                shared_prefix_len=first // 2,
                new_tokens=new,
                generated_tokens=gen,
                logprobs=[-1.0] * 8,
                call_kind="main",
                policy_version=1,
            )
        )
    return calls


def _trajectory(
    rollout: str,
    harness: str,
    reward: float | None,
    rng: np.random.Generator,
    *,
    branches: int = 0,
    status: TrajectoryStatus = TrajectoryStatus.COMPLETE,
) -> Trajectory:
    tree = build_tree(_calls(rng, int(rng.integers(2, 5)), branches), prune="none")
    segments = [
        TreeSegment(
            parent=s.parent,
            tokens=np.asarray(s.tokens, dtype="<i4"),
            trainable=s.trainable,
            logprobs=np.asarray(s.logprobs, dtype="<f4"),
            policy_version=s.policy_version,
            call_id=s.call_id,
        )
        for s in tree.segments
    ]
    st = tree.stats
    return Trajectory(
        rollout_id=rollout,
        policy_version=1,
        timestamp_ms=1_790_000_000_000,
        attempt_id=f"{rollout}-a",
        group_id=f"t1|{harness}|1",
        task_id="t1",
        harness=harness,
        step=1,
        status=status,
        segments=segments,
        calls=len(tree.segments),
        leaves=st.leaves,
        unique_tokens=st.unique_tokens,
        path_tokens=st.path_tokens,
        prefix_reuse_ratio=st.prefix_reuse_ratio,
        reward=reward,
    )


def _tokens_by_hand(t: Trajectory) -> tuple[int, int]:
    """(Σ path tokens, unique tokens) from the segments: every leaf's root path summed."""
    parents = {s.parent for s in t.segments}
    unique = sum(len(s.tokens) for s in t.segments)
    path = 0
    for i in range(len(t.segments)):
        if i in parents:
            continue
        node = i
        while node != -1:
            path += len(t.segments[node].tokens)
            node = t.segments[node].parent
    return path, unique


def test_harness_report_prints_reuse_and_reward_per_harness(kafka_settings: KafkaSettings) -> None:
    rng = np.random.default_rng(11)
    run = [
        _trajectory("r-0", "claude-code", 1.0, rng),
        _trajectory("r-1", "claude-code", 0.25, rng),
        _trajectory("r-2", "claude-code", None, rng, status=TrajectoryStatus.DROPPED),  # ungraded: no reward
        _trajectory("r-3", "openclaw", 0.5, rng, branches=2),
        _trajectory("r-4", "openclaw", 0.0, rng, branches=1),
        _trajectory("r-5", "agentloop", 0.75, rng),
        _trajectory("r-6", "agentloop", 1.0, rng, status=TrajectoryStatus.INFRA_FAILURE),  # left out
    ]
    assert any(t.leaves > 1 for t in run), "the branching rollouts must share prefixes"
    producer = make_producer(kafka_settings)
    for t in run:
        producer.produce(kafka_settings.topic(TRAJECTORIES), key=t.rollout_id.encode(), value=t.to_bytes())
    producer.produce(kafka_settings.topic(TRAJECTORIES), key=b"r-bad", value=b"\x00not a trajectory")
    assert producer.flush(30) == 0

    path, unique, rewards, count = defaultdict(int), defaultdict(int), defaultdict(list), defaultdict(int)
    for t in run:
        if t.status is TrajectoryStatus.INFRA_FAILURE:
            continue
        p, u = _tokens_by_hand(t)
        path[t.harness] += p
        unique[t.harness] += u
        count[t.harness] += 1
        if t.reward is not None:
            rewards[t.harness].append(t.reward)
    expected = {h: (str(count[h]), f"{path[h] / unique[h]:.3f}", f"{np.mean(rewards[h]):.3f}") for h in count}
    assert float(expected["openclaw"][1]) > 1.0 and expected["claude-code"][1] == "1.000"

    cmd = [
        sys.executable,
        "-m",
        "consumers.analytics.examples.harness_report",
        "--bootstrap",
        kafka_settings.bootstrap_servers or "",
        "--topic-prefix",
        kafka_settings.topic_prefix,
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.strip().splitlines()
    assert header.split() == ["harness", "rollouts", "prefix", "reuse", "mean", "reward"]
    printed = {cells[0]: tuple(cells[1:]) for cells in (row.split() for row in rows)}
    assert printed == expected
    assert "skipped " in done.stderr and "[" in done.stderr and "@" in done.stderr  # the bad record, by position
