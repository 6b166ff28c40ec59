"""Sample events of every type, shared by unit and integration tests."""

from __future__ import annotations

import time

import numpy as np

from schemas.events import (
    BatchRecord,
    BatchRecordKind,
    CallEvent,
    CallKind,
    DeadLetter,
    Dialect,
    Event,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
    TrajectoryStatus,
    TreeSegment,
    WeightVersion,
)

# Record timestamps for tests that write them to the broker: the start of the previous hour, not a fixed date. The
# catalog's topics keep a week by time (schemas/topics.py), so the broker's retention deletes records stamped with an
# older date while a test reads them: with a fixed 2026-09-22 T0, from 2026-09-29 on a tail test lost its first
# records to a deleted segment ("Offset out of range", CI of stop 25). Within the hour keeps +offsets in the past.
T0 = (int(time.time()) // 3600 - 1) * 3_600_000


def sample_trajectory(rollout_id: str = "r-1") -> Trajectory:
    seg = [
        TreeSegment(
            parent=-1,
            tokens=np.array([1, 2, 3, 10, 11]),
            trainable=False,
            logprobs=np.zeros(0),
            policy_version=3,
            call_id="c-0",
        ),
        TreeSegment(
            parent=0,
            tokens=np.array([100, 101]),
            trainable=True,
            logprobs=np.array([-0.5, -0.25]),
            policy_version=3,
            call_id="c-0",
            temperature=0.75,
            top_p=0.875,
            top_k=40,
        ),
        TreeSegment(
            parent=1,
            tokens=np.array([200, 201]),
            trainable=False,
            logprobs=np.zeros(0),
            policy_version=3,
            call_id="c-1",
        ),
    ]
    return Trajectory(
        rollout_id=rollout_id,
        policy_version=3,
        timestamp_ms=T0,
        attempt_id="a-1",
        group_id="t07|agentloop|5",
        task_id="t07",
        harness="agentloop",
        step=5,
        status=TrajectoryStatus.COMPLETE,
        segments=seg,
        calls=2,
        leaves=1,
        unique_tokens=9,
        path_tokens=9,
        prefix_reuse_ratio=1.0,
        reward=1.0,
        excluded_calls={"SIDE": 1},
        metadata={"exp": "unit"},
    )


def sample_events(rollout_id: str = "r-1") -> list[Event]:
    """One event of each of the nine types, with non-default values in most fields."""
    return [
        RolloutRequest(
            rollout_id=rollout_id,
            policy_version=3,
            timestamp_ms=T0,
            suite="cpu-builtin",
            task_id="t07",
            harness="agentloop",
            group_id="t07|agentloop|5",
            step=5,
            timeout_s=60.0,
            attempt=1,
            temperature=0.75,
            top_p=0.875,
            top_k=40,
            deadline_ms=T0 + 60_000,
            min_policy_version=2,
            metadata={"seed": "1"},
        ),
        RolloutEvent(
            rollout_id=rollout_id,
            policy_version=3,
            timestamp_ms=T0 + 1,
            attempt_id="a-1",
            state=RolloutState.HARNESS_EXITED,
            group_id="t07|agentloop|5",
            harness="agentloop",
            exit_code=0,
            calls_served=2,
            worker_id="w-0",
        ),
        CallEvent(
            rollout_id=rollout_id,
            policy_version=3,
            timestamp_ms=T0 + 2,
            call_id="c-1",
            seq=1,
            dialect=Dialect.ANTHROPIC_MESSAGES,
            requested_model="policy",
            call_kind=CallKind.MAIN,
            new_tokens=np.array([200, 201, 7]),
            prompt_len=10,
            generated_tokens=np.array([102, 103, 2]),
            logprobs=np.array([-0.125, -2.5, -0.0078125]),
            finish_reason="stop",
            parent_call_id="c-0",
            shared_prefix_len=7,
            flags=["malformed_tool_json"],
            engine_ms=12.5,
            system_fingerprint="ab12",
            cached_prompt_tokens=7,
            gpu_utilization=42.5,
            gpu_memory_used_bytes=3_000_000_000,
            temperature=0.75,
            top_p=0.875,
            top_k=40,
        ),
        RewardEvent(
            rollout_id=rollout_id,
            policy_version=3,
            timestamp_ms=T0 + 3,
            attempt_id="a-1",
            status=RewardStatus.OK,
            grader="native",
            reward=0.75,
            sub_scores={"file": 1.0, "content": 0.5},
        ),
        sample_trajectory(rollout_id),
        BatchRecord(
            batch_id="b-5",
            policy_version=3,
            timestamp_ms=T0 + 4,
            kind=BatchRecordKind.TRAJECTORY,
            step=5,
            index=0,
            rollout_id=rollout_id,
            group_id="t07|agentloop|5",
            harness="agentloop",
            advantage=0.7071,
            reward=1.0,
            trajectory=sample_trajectory(rollout_id).to_bytes(),
        ),
        WeightVersion(
            policy_version=4,
            timestamp_ms=T0 + 5,
            model_name="policy",
            step=5,
            uri="file:///tmp/w/v4.safetensors",
            sha256="0" * 64,
            size_bytes=1234,
            batch_id="b-5",
            metrics={"loss": 0.25},
        ),
        Metric(
            policy_version=4,
            timestamp_ms=T0 + 6,
            source="learner",
            name="train_step",
            step=5,
            values={"loss": 0.25, "reward/agentloop": 0.5},
            labels={"model": "policy"},
        ),
        DeadLetter(
            timestamp_ms=T0 + 7,
            source="streams",
            reason="undecodable",
            error_type="CorruptRecordError",
            original_topic="clawstream.calls",
            original_partition=2,
            original_offset=17,
            rollout_id=rollout_id,
            original_key=b"r-1",
            original_value=b"\x00garbage",
        ),
    ]
