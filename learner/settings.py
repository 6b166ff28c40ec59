"""The learner service's settings (pydantic); its hyperparameters are ``learner.hparams.Hyperparams``.

Hyperparameters change what is learned; settings change where the learner reads, writes and logs. Both are printed
by ``clawstream learner --help``. The hyperparameters live apart so that the pure training step imports no pydantic
(bench/gpu_checks.py runs on a machine with only torch and transformers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from policy import DEFAULT_MODEL_NAME


class LearnerSettings(BaseSettings):
    """Where the learner reads batches, keeps weights and writes logs (env prefix ``CLAWSTREAM_LEARNER_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_LEARNER_", frozen=True, extra="forbid")

    model_dir: Path = Field(description="Initial policy in HF format (e.g. from `clawstream model init`).")
    weight_store: Path = Field(description="Directory where every published version's safetensors file is kept.")
    model_name: str = Field(
        default=DEFAULT_MODEL_NAME,
        description="Served model name; key of clawstream.weights records (the engine follows its served name).",
    )
    group_id: str = Field(
        default="", description="Consumer group for batches (default: <topic prefix>clawstream-learner-<model>)."
    )
    transactional_id: str = Field(
        default="", description="Kafka transactional.id (default: <prefix>clawstream-learner-<model>); fences zombies."
    )
    tensorboard_dir: Path | None = Field(default=None, description="Write TensorBoard scalars here; unset = off.")
    value_head: Path | None = Field(
        default=None, description="PPO: pretrained value head (`python -m learner.value`); unset = zero-initialised."
    )
    device: str = Field(default="auto", description="'cpu', 'cuda' or 'auto' (cuda when available).")
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads (default: torch's, all cores). Beside a CPU engine on the same cores, "
        "give each a share: two processes with a thread per core each ran 1.7x slower than with half each.",
    )
    max_steps: int | None = Field(default=None, description="Stop after this many steps (None = run forever).")
    idle_exit_s: float | None = Field(default=None, description="Exit after this long without a batch (None = never).")
    max_step_attempts: int = Field(
        default=2,
        ge=1,
        description="Dead-letter a batch untrained once the learner died out of memory during its training this many "
        "times, on evidence (the supervisor's record of the kernel's OOM kill, or the memory cgroup's oom_kill "
        "counter; learner/attempts.py). Any other death in a step (SIGKILL, SIGTERM, preemption) trains the batch "
        "again, however often. A step that raises is dead-lettered at once.",
    )
    activation_checkpointing: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Recompute each decoder layer in the backward pass instead of keeping its activations (exact; "
        "1.3-1.5x the step's compute). auto: only for a batch whose largest row would not fit otherwise "
        "(learner/memory.py); on: always; off: never.",
    )
    memory_limit_gib: float | None = Field(
        default=None,
        gt=0,
        description="Memory a step may allocate beyond what the learner holds; a batch estimated to need more is "
        "dead-lettered (InsufficientMemory) before any update, never killed. Unset: what the device has free at "
        "each step (CPU: MemAvailable or the cgroup's room; CUDA: free + reserved-unused).",
    )
    max_step_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        le=86_400,
        description="Longest a training step may take between two polls of the batches topic (the consumer's "
        "max.poll.interval.ms). Past it the broker takes the learner out of its group and the step's commit is "
        "refused (ILLEGAL_GENERATION); librdkafka's 300 s default was passed by a real-harness batch on a loaded "
        "machine, and is short for any real model.",
    )

    weights_http_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve the weight store's version files over HTTP on this port (read-only, "
        "learner/weights_http.py) and publish http:// URIs, so engines on other hosts need no shared "
        "filesystem. Unset: file:// URIs.",
    )
    weights_base_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        description="Base of the published weight URIs (<base>/<model>/v<version>/model.safetensors): how "
        "engines reach the store. Default with weights_http_port: http://<this host's name>:<port>; alone: "
        "another server of the store directory (nginx, an object store's HTTP endpoint).",
    )

    def consumer_config(self, topic_prefix: str = "") -> dict[str, str | int]:
        """The batches consumer's overrides: static membership (a restarted learner takes over its old member's
        partitions at once) and room for a long step."""
        return {
            "group.instance.id": self.resolved_transactional_id(topic_prefix),
            "max.poll.interval.ms": int(self.max_step_s * 1000),
        }

    # Defaults carry the topic prefix so isolated runs (tests, experiments) on one cluster never share a group.
    def resolved_group_id(self, topic_prefix: str = "") -> str:
        return self.group_id or f"{topic_prefix}clawstream-learner-{self.model_name}"

    def resolved_transactional_id(self, topic_prefix: str = "") -> str:
        return self.transactional_id or f"{topic_prefix}clawstream-learner-{self.model_name}"
