"""Settings of the dashboard (``clawstream dashboard``): env prefix ``CLAWSTREAM_DASHBOARD_``; its flags override.

Kafka itself (bootstrap, security, topic prefix) comes from :class:`clawbase.settings.KafkaSettings`
(``CLAWSTREAM_KAFKA_*``).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class DashboardSettings(BaseSettings):
    """Dashboard configuration (env prefix ``CLAWSTREAM_DASHBOARD_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_DASHBOARD_", frozen=True, extra="forbid")

    host: str = Field(default="127.0.0.1", description="Interface to listen on (the page shows every rollout).")
    port: int = Field(default=8200, ge=0, le=65535, description="Port to listen on (0: any free port).")
    since_ms: int | None = Field(default=None, description="Read the topics from this time (epoch ms); default all.")
    bucket_s: int = Field(default=10, ge=1, description="Width of the throughput and lag buckets, in seconds.")
    refresh_ms: int = Field(default=2000, ge=200, description="How often the page asks for a new state.")
