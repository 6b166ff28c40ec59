"""Settings of the MLflow tracker (env prefix ``CLAWSTREAM_TRACKER_``; the flags of ``clawstream track`` set the same).

Kafka itself (bootstrap, security, the run's topic prefix) comes from :class:`clawbase.settings.KafkaSettings`
(``CLAWSTREAM_KAFKA_*``).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrackerSettings(BaseSettings):
    """Where the run goes in MLflow and what the tracker adds to it (env prefix ``CLAWSTREAM_TRACKER_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_TRACKER_", frozen=True, extra="forbid")

    mlflow_uri: str = Field(description="MLflow tracking server, e.g. http://127.0.0.1:5000 (--mlflow).")
    experiment: str = Field(default="clawstream", description="MLflow experiment the run is filed under.")
    run_dir: Path | None = Field(
        default=None, description="A demo run's directory: its config as params, its report files as artifacts."
    )
    model_dir: Path | None = Field(
        default=None, description="Model directory whose tokenizer decodes the sampled trajectories' tokens."
    )
    params: dict[str, str] = Field(default_factory=dict, description="More params of the run (--param KEY=VALUE).")
    registered_model: str | None = Field(
        default=None, description="Registered model of the weight versions (default: clawstream-<model name>)."
    )
    samples_per_step: int = Field(default=2, ge=0, description="Trajectories logged per trained step.")
    once: bool = Field(default=False, description="Read the topics to their end, log the report files, stop.")
    poll_timeout_s: float = Field(default=1.0, gt=0, description="Seconds one poll of the topics waits.")

    @field_validator("mlflow_uri")
    @classmethod
    def _check_uri(cls, value: str) -> str:
        if not value.startswith(("http://", "https://", "databricks")):
            raise ValueError(
                f"{value!r}: give the tracking server's URL (http://HOST:PORT, from `mlflow server`); a file or "
                "sqlite store would be written by this process alone, outside the server the run is browsed in"
            )
        return value.rstrip("/")
