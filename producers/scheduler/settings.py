"""The rollout scheduler's settings (env prefix ``CLAWSTREAM_SCHEDULER_``): the suite and split, step shape and
harness mix, policy-lag gating, re-issues, refills of groups that train nothing, sampling of rollouts, eval mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SchedulerSettings(BaseSettings):
    """Rollout scheduler configuration (env prefix ``CLAWSTREAM_SCHEDULER_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_SCHEDULER_", frozen=True, extra="forbid")

    suite: str = Field(default="cpu_builtin", description="Suite name (a key of suites).")
    suites: dict[str, str] = Field(
        default_factory=lambda: {"cpu_builtin": "builtin:cpu"},
        description="Suite name → spec, as the sandbox workers have them (JSON in env).",
    )
    split: str = Field(default="train", description="Split sampled for training steps.")
    curriculum: str = Field(
        default="",
        description="Training tasks drawn by family, FAMILY=WEIGHT,... (builtin:cpu: its templates; *=W: the rest); "
        "empty: uniform (producers/scheduler/curriculum.py).",
    )
    steps: int = Field(default=1, ge=0, description="Train until this step (exclusive).")
    start_step: int = Field(default=0, ge=0, description="First step to issue.")
    tasks_per_step: int = Field(default=32, ge=1, description="Training instances (task × harness) per step.")
    group_size: int = Field(default=8, ge=1, description="Rollouts per instance (the GRPO group).")
    harness_mix: dict[str, float] = Field(
        default_factory=lambda: {"agentloop": 1.0}, description="Harness → ratio of a step's instances (JSON in env)."
    )
    max_policy_lag: int = Field(default=1, ge=0, description="Issue step s once weight version ≥ s − lag.")
    initial_version: int = Field(default=0, description="Policy version assumed before any weights are published.")
    max_attempts: int = Field(default=3, ge=1, description="Attempts per rollout incl. infra-failure re-issues.")
    zero_variance: Literal["drop", "keep"] = Field(
        default="drop",
        description="What the streams do with a group whose rewards are all equal (set it as their "
        "CLAWSTREAM_STREAMS_ZERO_VARIANCE): 'drop' — the scheduler then issues a refill group of the same step and "
        "harness for each group that trains nothing (all rewards equal, or none), so batches still fill "
        "(producers/scheduler/refill.py); 'keep' — no refills (PPO keeps every group too: use 'keep' there).",
    )
    max_refills_per_step: int | None = Field(
        default=None,
        ge=0,
        description="Refill groups at most per step (their own refills included); null: 4 × tasks_per_step (a "
        "step then fills unless over 80 % of its groups train nothing); 0: none.",
    )
    timeout_s: float | None = Field(default=None, description="Wall-clock limit per rollout (default: the task's).")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature of rollouts (0 = greedy).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling of rollouts (1 = off).")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling of rollouts (0 = off).")
    max_tokens: int = Field(default=2048, description="Generation cap per model call.")
    seed: int = Field(default=0, description="Task / harness sampling seed.")
    drain_timeout_s: float = Field(
        default=0.0,
        description="Train mode, after the last step: wait this long for the last rewards (re-issues and refills "
        "need them), counted again from each reward read and each refill issued.",
    )
    eval_split: str = Field(default="heldout", description="Split run by eval mode.")
    eval_harnesses: list[str] = Field(default_factory=lambda: ["agentloop"], description="Harnesses eval runs.")
    eval_limit: int = Field(default=0, ge=0, description="Eval only the first N tasks (0: all).")
    eval_repeats: int = Field(default=1, ge=1, description="Rollouts per eval task × harness × mode.")
    eval_modes: list[Literal["greedy", "sampled"]] = Field(
        default_factory=lambda: ["sampled"],
        description="Decoding modes eval runs: greedy (temperature 0) and/or sampled (temperature/top_p/top_k).",
    )
    eval_timeout_s: float = Field(default=1800.0, description="Eval gives up waiting for rewards after this.")
    eval_seed: int | None = Field(
        default=0,
        description="Base of the eval rollouts' sampling seeds, one per task × harness × mode × sample, so a rerun "
        "draws the same (plan.eval_seed); null: unseeded.",
    )
    publish_timeout_s: float = Field(default=30.0, description="Delivery deadline of one request.")

    def refill_budget(self) -> int:
        """Refill groups a step may issue (0 with ``zero_variance="keep"``)."""
        if self.zero_variance == "keep":
            return 0
        return 4 * self.tasks_per_step if self.max_refills_per_step is None else self.max_refills_per_step
