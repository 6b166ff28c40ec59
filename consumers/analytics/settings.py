"""Settings of the analytics commands that take more than Kafka's: ``clawstream replay`` (env prefix
``CLAWSTREAM_REPLAY_``; its flags set the same). The dashboard's are ``consumers.analytics.dashboard.settings``.

Kafka itself (bootstrap, security, topic prefix) comes from :class:`clawbase.settings.KafkaSettings`
(``CLAWSTREAM_KAFKA_*``).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.topics import BATCHES


class ReplaySettings(BaseSettings):
    """What to replay where (env prefix ``CLAWSTREAM_REPLAY_``; the flags of ``clawstream replay`` set the same)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_REPLAY_", frozen=True, extra="forbid")

    to_prefix: str = Field(description="Destination topic prefix (must differ from the source's).")
    topics: list[str] = Field(default_factory=lambda: [BATCHES], description="Catalog topics to copy, in order.")
    from_offsets: list[str] = Field(default_factory=list, description="--from: OFFSET or PARTITION:OFFSET (first).")
    to_offsets: list[str] = Field(default_factory=list, description="--to: OFFSET or PARTITION:OFFSET (exclusive).")
    since: str | None = Field(default=None, description="First record time: epoch ms, ISO 8601, or an age (2h).")
    until: str | None = Field(default=None, description="Records before this time: epoch ms, ISO 8601, or an age.")
    rate: float | None = Field(default=None, description="Records per second (None = as fast as possible).")
    append: bool = Field(default=False, description="Copy into destination topics that already hold records.")
    keep_timestamps: bool = Field(default=False, description="Keep the source records' timestamps.")
    dry_run: bool = Field(default=False, description="Resolve the ranges and plan the batches; write nothing.")
    commit_every: int = Field(default=500, gt=0, description="Records per transaction outside the batches topic.")
    stall_timeout_s: float = Field(default=60.0, gt=0, description="Give up when a read makes no progress this long.")
