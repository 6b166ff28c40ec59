"""Small models and scored trajectories for learner tests (no Kafka)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from schemas.events import BatchRecord, BatchRecordKind, Trajectory, TrajectoryStatus, TreeSegment


def small_model(out: Path) -> Path:
    """A 2-layer tiny Qwen3 (the project's builder, shrunk for speed)."""
    from policy.tiny_model import init_tiny_model

    if not (out / "config.json").exists():
        init_tiny_model(out, hidden_size=64, intermediate_size=128, num_layers=2, num_documents=500, progress=None)
    return out


# The sampling settings a trainable segment records (the proxy's defaults: temperature 1, no top-p, no top-k).
PLAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def branching_trajectory(rollout_id: str, rng: np.random.Generator, harness: str = "agentloop") -> Trajectory:
    """A tree with a shared prompt, two generated turns and a retry branch (token ids < 2000)."""

    def toks(n: int) -> np.ndarray:
        return rng.integers(3, 2000, n).astype("<i4")

    def lps(n: int) -> np.ndarray:
        return (-rng.random(n) * 3).astype("<f4")

    segs = [
        TreeSegment(parent=-1, tokens=toks(24), trainable=False, logprobs=np.zeros(0, "<f4"), policy_version=0),
        TreeSegment(parent=0, tokens=toks(6), trainable=True, logprobs=lps(6), policy_version=0, **PLAIN),
        TreeSegment(parent=1, tokens=toks(8), trainable=False, logprobs=np.zeros(0, "<f4"), policy_version=0),
        TreeSegment(parent=2, tokens=toks(5), trainable=True, logprobs=lps(5), policy_version=0, **PLAIN),
        TreeSegment(parent=0, tokens=toks(7), trainable=True, logprobs=lps(7), policy_version=0, **PLAIN),
    ]
    return Trajectory(
        rollout_id=rollout_id,
        policy_version=0,
        timestamp_ms=0,
        attempt_id=f"{rollout_id}-a",
        group_id="g",
        task_id="t",
        harness=harness,
        step=0,
        status=TrajectoryStatus.COMPLETE,
        segments=segs,
        calls=3,
        leaves=2,
        unique_tokens=50,
        path_tokens=74,
        prefix_reuse_ratio=1.48,
        reward=1.0,
    )


def batch_records(batch_id: str, step: int, n: int, seed: int) -> list[BatchRecord]:
    """``n`` TRAJECTORY records with alternating ±1 advantages across two harnesses, then the SEAL."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        harness = "agentloop" if i % 2 == 0 else "agentloop-anthropic"
        traj = branching_trajectory(f"{batch_id}-r{i}", rng, harness)
        out.append(
            BatchRecord(
                batch_id=batch_id,
                policy_version=0,
                timestamp_ms=0,
                kind=BatchRecordKind.TRAJECTORY,
                step=step,
                index=i,
                rollout_id=traj.rollout_id,
                group_id="g",
                harness=harness,
                advantage=1.0 if i % 2 == 0 else -1.0,
                reward=float(i % 2 == 0),
                trajectory=traj.to_bytes(),
            )
        )
    counts = {"agentloop": (n + 1) // 2, "agentloop-anthropic": n // 2}
    seal = BatchRecord(
        batch_id=batch_id,
        policy_version=0,
        timestamp_ms=0,
        kind=BatchRecordKind.SEAL,
        step=step,
        index=n,
        harness_counts=counts,
    )
    out.append(seal)
    return out
