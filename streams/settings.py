"""Settings of the stream processors (assembler, grouper, batcher): env prefix ``CLAWSTREAM_STREAMS_``.

Kafka itself (bootstrap, security, topic prefix) comes from :class:`clawbase.settings.KafkaSettings`
(``CLAWSTREAM_KAFKA_*``). Load with ``clawbase.settings.load_settings(StreamsSettings)`` so a bad value is
reported with the variable to set. Pure: no Kafka or Faust import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from clawbase.settings import clawstream_home


class StreamsSettings(BaseSettings):
    """Configuration of the Faust app ``streams.app`` (one frozen object, shared by every stage)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_STREAMS_", frozen=True, extra="forbid")

    # ---- app -------------------------------------------------------------------------------------------------------
    app_id: str = Field(
        default="clawstream-streams",
        description="Faust app id: the consumer group, the prefix of internal topics (changelogs, ticks, by-group "
        "repartition) and of transactional ids. Two deployments sharing a cluster need different ids.",
    )
    store: str = Field(
        default="rocksdb://",
        description="Faust table store URL: 'rocksdb://' (rocksdict driver, survives restarts) or 'memory://' "
        "(tests; state is rebuilt from the changelog topics at every start).",
    )
    rocksdb_memory_mb: float = Field(
        default=16.0,
        ge=8,
        description="RocksDB memory of the worker's tables, all partitions together: one block cache with the "
        "memtables charged to it (Faust's default gives each of ~50 table partitions 64 MiB × 3 memtables and a "
        "2 GiB cache, and resident memory grew for hours). 16 fills within the first minutes of a 64-rollout soak, "
        "so the worker's memory is flat after warm-up (32 was still filling after 30 min: bench/results/soak.md); "
        "raise it for big tables that are read often.",
    )
    memory_report_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="How often the worker logs its RocksDB memory use and resident memory (INFO) and returns freed "
        "heap to the system (glibc malloc_trim).",
    )
    table_key_index_size: int = Field(
        default=256,
        ge=1,
        description="Keys per table whose partition Faust remembers (its key index; a key not in it is looked up in "
        "each of the worker's partition databases, a bloom-filtered read each). Faust's default of 1,000 held "
        "~4.4 KiB per key (its JSON key encoding allocates that much per key): 8 tables × 1,000 keys = ~35 MiB that "
        "filled slowly and read as unbounded growth in the soak.",
    )
    memory_trace_top: int = Field(
        default=0,
        ge=0,
        description="Diagnosis of memory growth: N > 0 makes the memory report also log the N Python allocation sites "
        "(tracemalloc) that grew most since the first report. Costs memory and CPU; 0 (off) in production.",
    )
    data_dir: Path = Field(
        default_factory=lambda: clawstream_home() / "streams",
        description="Faust data directory (RocksDB tables live under it).",
    )
    processing_guarantee: Literal["exactly_once", "at_least_once"] = Field(
        default="exactly_once",
        description="'exactly_once': outputs, table changelogs and input offsets of one partition number (all "
        "co-partitioned topics) commit in one Kafka transaction, between records (see streams/eos.py). "
        "'at_least_once': plain Faust commits.",
    )
    commit_interval_s: float = Field(
        default=0.2,
        gt=0,
        description="How often offsets (and, exactly-once, transactions) are committed; outputs "
        "become visible to read_committed consumers at the commit, so this adds to end-to-end latency (records wait "
        "while a commit runs: bench/results/streams.md measures the trade-off).",
    )
    producer_linger_s: float = Field(
        default=0.1,
        ge=0,
        description="Exactly-once only: how long the producers gather records into one request before sending; the "
        "commit sends what lingers, so this adds no latency there (at least once, outputs leave after 5 ms).",
    )
    session_timeout_s: float = Field(
        default=30.0,
        ge=6.0,
        description="Consumer group session timeout: how long a crashed worker holds its partitions.",
    )
    tick_interval_s: float = Field(
        default=0.1,
        gt=0,
        description="How often each worker sends itself a tick per owned partition to check settle/group deadlines "
        "(adds up to this much to settle → trajectory latency).",
    )
    # ---- assembler -------------------------------------------------------------------------------------------------
    settle_interval_s: float = Field(
        default=2.0,
        ge=0,
        description="Quiet period: a complete rollout settles once no record of it arrived for this long.",
    )
    settle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="After the terminal lifecycle event, how long to wait for the missing calls/reward before the "
        "rollout settles INCOMPLETE (also the inactivity limit once the rollout was seen, see rollout_timeout_s).",
    )
    rollout_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="A rollout with no terminal lifecycle event may stay silent this long (its request's timeout_s "
        "when known) plus settle_timeout_s before it is given up as INCOMPLETE.",
    )
    late_retention_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long a settled rollout (or closed group) keeps its whole state (calls held for a re-issue, "
        "member list) before it is compacted to a tombstone of a few dozen bytes. The tombstone is kept for good (in "
        "the changelogged table): a record replayed at any later time is dead-lettered as late, never opens a new "
        "one.",
    )
    max_leaves: int | None = Field(
        default=64, ge=1, description="Leaf cap of a rollout's tree ('none' in the environment: no cap)."
    )
    prune: Literal["carried", "strict", "none"] = Field(default="carried", description="Dead-end rule (streams/tree).")
    # ---- grouper ---------------------------------------------------------------------------------------------------
    group_size: int = Field(
        default=8,
        ge=1,
        description="Rollouts per GRPO group when a trajectory's metadata has no 'group_size' label.",
    )
    group_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="A group closes this long after its first trajectory even if rollouts are missing.",
    )
    advantage_estimator: Literal["grpo", "ppo"] = Field(
        default="grpo",
        description="The learner's algorithm (--hp algorithm=...). 'ppo' (one rollout per task, A = R − V(s)) "
        "emits every trainable rollout: groups of one and equal-reward groups are kept, zero_variance does not apply.",
    )
    zero_variance: Literal["drop", "keep"] = Field(
        default="drop",
        description="Groups whose rewards are all equal carry no GRPO signal: 'drop' them, or 'keep' them with "
        "advantage 0 (they still count tokens for the learner).",
    )
    advantage_eps: float = Field(default=1e-6, gt=0, description="ε in (R − μ) / (σ + ε).")
    # ---- batcher ---------------------------------------------------------------------------------------------------
    batch_groups: int = Field(default=32, ge=1, description="G: groups per training batch.")
    harness_mix: dict[str, float] = Field(
        default_factory=dict,
        description='Target share of each harness in a batch, e.g. {"claude-code": 0.5, "openclaw": 0.5} '
        "(JSON in the env variable; normalised). Empty: every harness weighs the same.",
    )
    mix_seed: int = Field(default=0, description="Seed of the batch mixing (batch n uses seed (mix_seed, n)).")
    max_policy_lag: int = Field(
        default=2,
        ge=0,
        description="Groups whose oldest policy version is more than this many versions behind the newest "
        "published weights are dropped as stale.",
    )

    @field_validator("max_leaves", mode="before")
    @classmethod
    def _no_cap(cls, value: object) -> object:
        # The environment can only say "no cap" in text; pydantic would refuse "none" for an int | None field.
        if isinstance(value, str) and value.strip().lower() in ("none", "null", ""):
            return None
        return value

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        if not value.startswith(("rocksdb://", "memory://")):
            raise ValueError("store must be 'rocksdb://' or 'memory://'")
        return value

    @field_validator("app_id")
    @classmethod
    def _check_app_id(cls, value: str) -> str:
        allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
        if not value or not set(value) <= allowed:
            raise ValueError("app_id names topics: use letters, digits, '.', '_' and '-' only")
        return value

    @field_validator("harness_mix")
    @classmethod
    def _check_mix(cls, value: dict[str, float]) -> dict[str, float]:
        if any(w < 0 for w in value.values()):
            raise ValueError("harness_mix weights must be >= 0")
        if value and sum(value.values()) <= 0:
            raise ValueError("harness_mix needs at least one positive weight")
        return value

    @model_validator(mode="after")
    def _check_times(self) -> StreamsSettings:
        if self.settle_timeout_s < self.settle_interval_s:
            raise ValueError(
                "settle_timeout_s must be >= settle_interval_s (a timeout shorter than the quiet period "
                "would give up on every rollout)"
            )
        return self
