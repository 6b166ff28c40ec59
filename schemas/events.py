"""Typed Python events mirroring ``schemas/*.avsc`` (the ``.avsc`` files are the source of truth).

Each event is a dataclass whose fields are exactly the Avro record's fields (a unit test checks the names match;
Python orders them required-first).
Token ids and logprobs are ``numpy`` arrays in Python and packed little-endian bytes on the wire
(``int32`` ids, ``float32`` logprobs). ``to_bytes`` / ``from_bytes`` go through the single-object codec.
Every event carries ``rollout_id``, ``policy_version`` and ``timestamp_ms``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

import numpy as np

from schemas.codec import AvroCodec, default_codec

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")


def now_ms() -> int:
    return int(time.time() * 1000)


def pack(values: Any, dtype: np.dtype) -> bytes:
    """Sequence or array → packed little-endian bytes of ``dtype``."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def unpack(data: bytes, dtype: np.dtype) -> np.ndarray:
    """Packed bytes → read-only numpy array (no copy)."""
    return np.frombuffer(data, dtype=dtype)


class RolloutState(StrEnum):
    STARTED = "STARTED"
    HARNESS_EXITED = "HARNESS_EXITED"
    TIMED_OUT = "TIMED_OUT"
    FAILED = "FAILED"


class Dialect(StrEnum):
    ANTHROPIC_MESSAGES = "ANTHROPIC_MESSAGES"
    OPENAI_CHAT = "OPENAI_CHAT"
    OPENAI_RESPONSES = "OPENAI_RESPONSES"
    GEMINI = "GEMINI"


class CallKind(StrEnum):
    MAIN = "MAIN"
    SIDE = "SIDE"
    SUBAGENT = "SUBAGENT"
    COMPACTION = "COMPACTION"


class RewardStatus(StrEnum):
    OK = "OK"
    INFRA_FAILURE = "INFRA_FAILURE"
    UNGRADED = "UNGRADED"


class TrajectoryStatus(StrEnum):
    COMPLETE = "COMPLETE"
    TIMED_OUT = "TIMED_OUT"
    INFRA_FAILURE = "INFRA_FAILURE"
    INCOMPLETE = "INCOMPLETE"
    DROPPED = "DROPPED"


class BatchRecordKind(StrEnum):
    TRAJECTORY = "TRAJECTORY"
    SEAL = "SEAL"


@dataclass
class _Record:
    """Dict conversion shared by events and nested records; subclasses list their packed and enum fields."""

    PACKED: ClassVar[dict[str, np.dtype]] = {}
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {}

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.PACKED:
                value = pack(value, self.PACKED[f.name])
            elif isinstance(value, StrEnum):
                value = value.value
            elif isinstance(value, list) and value and isinstance(value[0], _Record):
                value = [item.to_record() for item in value]
            out[f.name] = value
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Self:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = record[f.name]
            if f.name in cls.PACKED:
                value = unpack(value, cls.PACKED[f.name])
            elif f.name in cls.ENUMS:
                value = cls.ENUMS[f.name](value)
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclass
class Event(_Record):
    """A top-level topic value; ``SCHEMA`` names its ``.avsc`` record."""

    SCHEMA: ClassVar[str] = ""

    def to_bytes(self, codec: AvroCodec | None = None) -> bytes:
        return (codec or default_codec()).encode(self.SCHEMA, self.to_record())

    @classmethod
    def from_bytes(cls, data: bytes, codec: AvroCodec | None = None) -> Self:
        _, record = (codec or default_codec()).decode(data, expected=cls.SCHEMA)
        return cls.from_record(record)


@dataclass
class RolloutRequest(Event):
    SCHEMA: ClassVar[str] = "RolloutRequest"

    rollout_id: str
    policy_version: int
    timestamp_ms: int
    suite: str
    task_id: str
    harness: str
    group_id: str
    step: int
    timeout_s: float
    attempt: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # call n sampled with seed + n; None: unseeded
    max_tokens: int = 2048
    deadline_ms: int | None = None
    min_policy_version: int = 0
    eval: bool = False
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class RolloutEvent(Event):
    SCHEMA: ClassVar[str] = "RolloutEvent"
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {"state": RolloutState}

    rollout_id: str
    policy_version: int
    timestamp_ms: int
    attempt_id: str
    state: RolloutState
    group_id: str
    harness: str
    attempt: int = 0
    worker_id: str = ""
    exit_code: int | None = None
    calls_served: int | None = None
    reason: str | None = None


@dataclass
class CallEvent(Event):
    SCHEMA: ClassVar[str] = "CallEvent"
    PACKED: ClassVar[dict[str, np.dtype]] = {
        "new_tokens": TOKEN_DTYPE,
        "generated_tokens": TOKEN_DTYPE,
        "logprobs": LOGPROB_DTYPE,
    }
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {"dialect": Dialect, "call_kind": CallKind}

    rollout_id: str
    policy_version: int
    timestamp_ms: int
    call_id: str
    seq: int
    dialect: Dialect
    requested_model: str
    call_kind: CallKind
    new_tokens: np.ndarray  # (N_new,) int32
    prompt_len: int
    generated_tokens: np.ndarray  # (N_gen,) int32
    logprobs: np.ndarray  # (N_gen,) float32
    finish_reason: str
    system_fingerprint: str = ""
    parent_call_id: str | None = None
    shared_prefix_len: int = 0
    flags: list[str] = field(default_factory=list)
    received_ms: float = 0.0
    render_ms: float = 0.0
    engine_ms: float = 0.0
    total_ms: float = 0.0
    cached_prompt_tokens: int | None = None  # engine's usage.prompt_tokens_details.cached_tokens; None: not reported
    gpu_utilization: float | None = None  # engine GPU utilisation (%) when it answered; None: no NVML / CPU engine
    gpu_memory_used_bytes: int | None = None  # engine GPU memory in use when it answered; None: as above
    attempt_id: str | None = None  # the attempt registered with the proxy; None: the registration named none
    # The sampling settings the engine was asked for; None in records written before they were recorded.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    # The conversation a follow-up extends (request messages + this answer): its length and digest chain (hex).
    conversation_messages: int | None = None
    conversation_digest: str | None = None
    tampered: bool = False  # the request held an assistant turn the proxy never generated (see the .avsc)


@dataclass
class RewardEvent(Event):
    SCHEMA: ClassVar[str] = "RewardEvent"
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {"status": RewardStatus}

    rollout_id: str
    policy_version: int
    timestamp_ms: int
    attempt_id: str
    status: RewardStatus
    grader: str
    reward: float | None = None
    sub_scores: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    grader_error_by_rollout: bool = False  # graded 0: the grader failed on what the rollout left (see the .avsc)


@dataclass
class TreeSegment(_Record):
    """One segment of a trajectory's prefix tree (Avro record ``io.clawstream.Segment``)."""

    PACKED: ClassVar[dict[str, np.dtype]] = {"tokens": TOKEN_DTYPE, "logprobs": LOGPROB_DTYPE}

    parent: int
    tokens: np.ndarray  # (N,) int32
    trainable: bool
    logprobs: np.ndarray  # (N,) float32 when trainable, else (0,)
    policy_version: int
    call_id: str | None = None
    # Trainable segments: their call's sampling settings (the learner recomputes logprobs of that distribution).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off


@dataclass
class Trajectory(Event):
    SCHEMA: ClassVar[str] = "Trajectory"
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {"status": TrajectoryStatus}

    rollout_id: str
    policy_version: int
    timestamp_ms: int
    attempt_id: str
    group_id: str
    task_id: str
    harness: str
    step: int
    status: TrajectoryStatus
    segments: list[TreeSegment]
    calls: int
    leaves: int
    unique_tokens: int
    path_tokens: int
    prefix_reuse_ratio: float
    reward: float | None = None
    drop_reason: str | None = None
    excluded_calls: dict[str, int] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Self:
        record = dict(record, segments=[TreeSegment.from_record(s) for s in record["segments"]])
        return super().from_record(record)


@dataclass
class BatchRecord(Event):
    SCHEMA: ClassVar[str] = "BatchRecord"
    ENUMS: ClassVar[dict[str, type[StrEnum]]] = {"kind": BatchRecordKind}

    batch_id: str
    policy_version: int
    timestamp_ms: int
    kind: BatchRecordKind
    step: int
    index: int
    rollout_id: str | None = None
    group_id: str | None = None
    harness: str | None = None
    advantage: float = 0.0
    reward: float | None = None
    trajectory: bytes | None = None  # a Trajectory, single-object encoded
    harness_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class WeightVersion(Event):
    SCHEMA: ClassVar[str] = "WeightVersion"

    policy_version: int
    timestamp_ms: int
    model_name: str
    step: int
    uri: str
    sha256: str
    rollout_id: str | None = None
    size_bytes: int = 0
    batch_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


# The grouper's verdict on each group it closes (streams.group): a Metric from GROUPER named GROUP_METRIC, labels
# ``group_id`` and ``outcome``, ``values["trained"]`` = the rollouts it sent on to the batcher (0: the group trains
# nothing). The scheduler refills a group on it (producers.scheduler.refill): the rewards alone cannot show a member the
# tree filter drops, nor a group closed by its timeout.
GROUPER, GROUP_METRIC = "streams.grouper", "group"


@dataclass
class Metric(Event):
    SCHEMA: ClassVar[str] = "Metric"

    policy_version: int
    timestamp_ms: int
    source: str
    name: str
    values: dict[str, float]
    rollout_id: str | None = None
    step: int | None = None
    labels: dict[str, str] = field(default_factory=dict)


def group_verdict(metric: Metric) -> tuple[str, int] | None:
    """(group id, rollouts trained) when ``metric`` is the grouper's verdict on a group, else None."""
    if metric.source != GROUPER or metric.name != GROUP_METRIC or "group_id" not in metric.labels:
        return None
    return metric.labels["group_id"], int(metric.values.get("trained", 0.0))


@dataclass
class DeadLetter(Event):
    SCHEMA: ClassVar[str] = "DeadLetter"

    timestamp_ms: int
    source: str
    reason: str
    error_type: str
    original_topic: str
    original_partition: int = -1
    original_offset: int = -1
    rollout_id: str | None = None
    policy_version: int | None = None
    original_key: bytes | None = None
    original_value: bytes | None = None


@dataclass
class ProxyRegistration(Event):
    """The latest state of a rollout's registration with a proxy (compacted topic; never the secret, its sha256)."""

    SCHEMA: ClassVar[str] = "ProxyRegistration"

    rollout_id: str
    timestamp_ms: int
    proxy: str
    expires_at_ms: int
    policy_version: int | None = None
    attempt_id: str | None = None
    attempt: int | None = None
    finished: bool = False
    replica: str = ""  # the replica holding its state (several replicas behind one public URL); "": one proxy
    secret_sha256: str = ""
    registered_at_ms: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 0
    seed: int | None = None
    lease_s: float | None = None
    sealed: bool = False
    calls_served: int = 0
    infra_failure: str | None = None
    calls_offsets: dict[str, int] = field(default_factory=dict)  # partition (decimal) -> offset of clawstream.calls


ALL_EVENTS: tuple[type[Event], ...] = (
    RolloutRequest,
    RolloutEvent,
    CallEvent,
    RewardEvent,
    Trajectory,
    BatchRecord,
    WeightVersion,
    Metric,
    DeadLetter,
    ProxyRegistration,
)
