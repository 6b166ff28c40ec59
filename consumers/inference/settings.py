"""Settings of the inference worker (``clawstream infer``): env prefix ``CLAWSTREAM_INFER_``; its flags override.

Kafka itself (bootstrap, security, topic prefix) comes from :class:`clawbase.settings.KafkaSettings`
(``CLAWSTREAM_KAFKA_*``). Load with ``clawbase.settings.load_settings(InferenceWorkerSettings)`` so a bad value is
reported with the variable to set.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumers.inference.protocol import DEFAULT_MAX_LOGPROBS
from policy import DEFAULT_MODEL_NAME


class InferenceWorkerSettings(BaseSettings):
    """Inference worker configuration (env prefix ``CLAWSTREAM_INFER_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_INFER_", frozen=True, extra="forbid")

    model: Path | None = Field(default=None, description="Local Hugging Face model directory (required for cpu).")
    served_model_name: str = Field(
        default=DEFAULT_MODEL_NAME,
        description="Name served (/v1/models, responses) and the WeightVersion.model_name followed; the proxy's "
        "--engine-model and the learner's --model-name default to the same name. The CPU engine also accepts "
        "the model directory's name in requests.",
    )
    engine: Literal["cpu", "vllm"] = Field(default="cpu", description="cpu: serve here; vllm: drive a vLLM server.")
    engine_url: str | None = Field(default=None, description="Base URL of the vLLM server (engine=vllm).")
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8100, ge=0, le=65535, description="Port to listen on (0: any free port, printed).")
    device: str = Field(default="cpu", description="torch device of the CPU engine's model (cpu, cuda, cuda:1).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Model dtype.")
    max_batch_size: int = Field(default=32, ge=1, description="Most sequences decoded together.")
    max_prefill_tokens: int = Field(
        default=2048, ge=1, description="Token budget of one scheduler step (prompt chunks + one per decoding row)."
    )
    prefill_chunk_tokens: int = Field(
        default=256,
        ge=1,
        description="Most tokens of ONE prompt prefilled per step: a short request waits one such chunk, not a "
        "whole long prompt (lower: shorter waits, slightly slower long prefills).",
    )
    prefix_cache_gib: float = Field(
        default=2.0, ge=0, description="Memory for cached prompt KV blocks (automatic prefix caching; 0: off)."
    )
    prefix_block_size: int = Field(default=32, ge=1, description="Tokens per cached KV block.")
    max_model_len: int | None = Field(
        default=None, ge=1, description="Longest prompt + completion; default: the model's max_position_embeddings."
    )
    max_logprobs: int = Field(default=DEFAULT_MAX_LOGPROBS, ge=0, description="Largest `logprobs` accepted.")
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
        default="processed_logprobs",
        description="Reported log-probs: of the distribution sampled from (RL default) or vLLM's raw default.",
    )
    policy_version: int = Field(default=0, ge=0, description="Version of the weights in `model` at startup.")
    follow_weights: bool = Field(default=True, description="Consume clawstream.weights and apply new versions.")
    catch_up_timeout_s: float = Field(
        default=120.0,
        ge=0,
        description="Following weights, the port opens once the newest published version is applied (a restarted "
        "engine never answers a running loop with version 0; meanwhile a proxy's calls find it away and retry), "
        "or after this many seconds, serving what it has and still following. 0: open at once.",
    )
    worker_id: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Names this instance in metrics (source 'inference-worker/<id>').",
    )
    metrics_interval_s: float = Field(default=30.0, ge=0, description="Seconds between inference_stats (0: off).")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads (default: torch's).")
    vllm_timeout_s: float = Field(default=600.0, gt=0, description="Timeout of each request to the vLLM server.")
    vllm_pause: bool = Field(default=True, description="Pause/resume vLLM around a reload (needs /pause, /resume).")

    @model_validator(mode="after")
    def _check_engine(self) -> InferenceWorkerSettings:
        if self.engine == "cpu" and self.model is None:
            raise ValueError("engine=cpu needs the model directory: --model DIR or CLAWSTREAM_INFER_MODEL")
        if self.engine == "vllm" and not self.engine_url:
            raise ValueError("engine=vllm needs the server's URL: --engine-url URL or CLAWSTREAM_INFER_ENGINE_URL")
        return self

    def name(self) -> str:
        """The served model name (also the model name of the weight versions followed)."""
        return self.served_model_name

    def aliases(self) -> tuple[str, ...]:
        """Other names the CPU engine answers to: the model directory's name (what it served by default before)."""
        alias = Path(self.model).resolve().name if self.model else ""
        return (alias,) if alias and alias != self.served_model_name else ()
