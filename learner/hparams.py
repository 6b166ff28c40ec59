"""Learner hyperparameters: one frozen dataclass with a help text per field, and ``--hp NAME=VALUE`` parsing.

Hyperparameters change what is learned (the service's settings: ``learner.settings``). Pure: no pydantic, no Kafka,
so the training step (``learner.step``) runs where only torch and transformers are installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from clawbase.errors import ConfigError
from learner.forward import DEFAULT_LOGPROB_CHUNK
from learner.losses import LossConfig


def _hp(default: Any, help: str) -> Any:  # noqa: A002 - "help" reads best in the table below
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Hyperparams:
    """What the learner optimises and how. Defaults suit the tiny CPU model; the paper's values are noted.

    Warm-up, clipping, clip range: ClawGym II (docs/method.md, ../shared/DESIGN.md) gives no learning-rate warm-up,
    gradient-clipping norm or PPO clip range. The defaults are then the peers' (verl, DAPO): no warm-up, a global
    gradient norm of 1.0, clip-higher at 0.2 / 0.28; these are the values the demo's recipe trains with."""

    algorithm: Literal["grpo", "ppo"] = _hp(
        "grpo", "grpo: group-normalised advantage per rollout. ppo: A_t = R - V(s_t) with a value head (γ = λ = 1)."
    )
    lr: float = _hp(1e-5, "AdamW learning rate (constant after the warm-up).")
    lr_warmup_steps: int = _hp(
        0,
        "Linear warm-up: training step k (from 0, counted over restarts) uses lr * min(1, (k + 1) / N); 0 = off "
        "(the paper names none). AdamW's first steps move every weight by about lr whatever its gradient's size.",
    )
    betas: tuple[float, float] = _hp((0.9, 0.999), "AdamW betas.")
    weight_decay: float = _hp(0.0, "AdamW weight decay.")
    max_grad_norm: float = _hp(
        1.0, "Gradient clipping by global norm; <= 0 disables it (the paper names no value; 1.0 as verl)."
    )
    token_budget: int = _hp(4096, "Tokens per micro-batch row of packed trees (first-fit decreasing; dense mask).")
    max_path_tokens: int = _hp(
        0,
        "Longest root-to-leaf path a row may hold (a tree over token_budget is trained path by path, without a "
        "dense mask); 0 = the model's context length. A longer path dead-letters its batch.",
    )
    share_prefix_min: int = _hp(
        16,
        "Trees in one micro-batch row store the root context they begin with in common (a dialect's system "
        "prompt and tool schemas, a group's user prompt) once, when at least this many tokens; 0 = off (each keeps "
        "its own copy). Exact: same logprobs and gradients, fewer tokens.",
    )
    kv_share_min: int = _hp(
        256,
        "Rows of their own (paths of trees over token_budget) that begin with at least this many tokens of the same "
        "context (a harness's system prompt and tools) compute it once: its keys and values, with gradient, are "
        "attended by every row (learner/kv_share.py); 0 = off. Exact; GRPO without activation checkpointing only.",
    )
    logprob_chunk: int = _hp(
        DEFAULT_LOGPROB_CHUNK,
        "Positions projected through the LM head at once (checkpointed; no row's (T, V) logits are held). Extra "
        "memory ≈ 5 x logprob_chunk x vocabulary x 4 bytes (9x with top-k/top-p); exact: same logprobs and gradients.",
    )
    mini_batches: int = _hp(1, "Optimizer steps per training batch (the batch is split into this many parts).")
    eps_low: float = _hp(
        0.2, "Lower clip of the ratio (1 - eps_low) for negative advantages (the paper names no value; DAPO's)."
    )
    eps_high: float = _hp(
        0.28, "Upper clip of the ratio (1 + eps_high) for positive advantages (clip-higher; DAPO's value)."
    )
    is_mode: Literal["tis", "masked", "none"] = _hp(
        "tis", "Off-policy correction: truncated IS min(pi_old/pi_rollout, c), masked IS (drop outside [1/c, c]), none."
    )
    is_cap: float = _hp(2.0, "c in TIS / masked IS (the paper leaves it configurable; peers default to 2).")
    aggregation: Literal["token_mean", "seq_mean_token_mean"] = _hp(
        "seq_mean_token_mean",
        "Loss aggregation: seq_mean_token_mean = mean over rollouts of each rollout's token mean (the paper's Eq. 6), "
        "token_mean = mean over all trainable tokens; a shared prefix counts once per rollout either way.",
    )
    kl_coef: float = _hp(0.0, "k3 KL to the reference (initial) policy; 0 = off, as in the paper.")
    neg_adv_scale: float = _hp(
        1.0,
        "GRPO: negative advantages are multiplied by this. 1 = GRPO as in the paper; 0 = reinforce only the "
        "rollouts better than their group's mean (positive-sample reinforcement: sharper, less diverse policy).",
    )
    logit_scale_lr: float = _hp(
        0.0,
        "AdamW lr of a learned logit scale (one scalar s: the final norm's output times exp(s), a temperature of "
        "exp(-s) built into the policy), trained by the same loss and folded into the norm's gain after every step, "
        "so the published model stays a plain Qwen3; 0 = off, as in the paper (learner/logit_scale.py says why).",
    )
    lora_rank: int = _hp(
        0,
        "Rank r of low-rank adapters on the lora_targets matrices; 0 = off (every weight trains). On: only the "
        "adapters train (lr lora_lr; lr then applies to a value head only), each published version is the frozen "
        "base plus (lora_alpha / r) B A, merged into plain weights (learner/lora.py). Also on ranks (data parallel).",
    )
    lora_alpha: float = _hp(32.0, "LoRA: the update is (lora_alpha / lora_rank) B A.")
    lora_lr: float = _hp(1e-4, "LoRA: AdamW lr of the adapters (about 10x a full fine-tune's is LoRA's usual best).")
    lora_targets: str = _hp(
        "attention,mlp",
        "LoRA: comma-separated Linear module names that get adapters (attention = q/k/v/o_proj, mlp = "
        "gate/up/down_proj).",
    )
    skip_zero_grad: bool = _hp(
        True,
        "Skip the optimizer step of a mini-batch whose whole gradient is exactly 0 (GRPO with every advantage 0 and "
        "kl_coef 0: all groups solved alike). AdamW's momentum would move every weight anyway, by 60-80 % of a real "
        "step (measured, bench/results/real_harness.md); false = step regardless, as runs before 2026-12-06 did.",
    )
    vf_coef: float = _hp(0.5, "PPO: weight of the value loss.")
    value_clip: float = _hp(0.0, "PPO: clip range of the value loss around the step's old values; 0 = plain MSE.")
    seed: int = _hp(0, "Seed for torch.")

    def __post_init__(self) -> None:
        if self.logprob_chunk < 1:
            raise ConfigError(f"logprob_chunk must be >= 1 (positions per LM-head chunk), got {self.logprob_chunk}")
        if not 0.0 <= self.neg_adv_scale <= 1.0:
            raise ConfigError(f"neg_adv_scale must be in [0, 1] (1 = GRPO as in the paper), got {self.neg_adv_scale}")
        if self.logit_scale_lr < 0:
            raise ConfigError(f"logit_scale_lr must be >= 0 (0 = off), got {self.logit_scale_lr}")
        if self.lora_rank < 0 or (self.lora_rank > 0 and (self.lora_alpha <= 0 or self.lora_lr <= 0)):
            raise ConfigError(
                f"lora_rank must be >= 0 (0 = off), and with it on lora_alpha and lora_lr > 0; got lora_rank="
                f"{self.lora_rank}, lora_alpha={self.lora_alpha}, lora_lr={self.lora_lr}"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate of training step ``step`` (0-based)."""
        if self.lr_warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, (step + 1) / self.lr_warmup_steps)

    def loss_config(self) -> LossConfig:
        return LossConfig(
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            is_mode=self.is_mode,
            is_cap=self.is_cap,
            aggregation=self.aggregation,
            kl_coef=self.kl_coef,
            vf_coef=self.vf_coef,
            value_clip=self.value_clip or None,
        )

    @classmethod
    def help_table(cls) -> str:
        name_width = max(len(f.name) for f in fields(cls))
        width = max(14, *(len(str(f.default)) for f in fields(cls)))  # seq_mean_token_mean is wider than 14
        return "\n".join(f"  {f.name:{name_width}} {f.default!s:{width}} {f.metadata['help']}" for f in fields(cls))


_BOOLS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def parse_hparams(pairs: list[str]) -> Hyperparams:
    """``["lr=1e-4", "is_mode=masked"]`` → Hyperparams, with errors naming the field."""
    known = {f.name: f for f in fields(Hyperparams)}
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or name not in known:
            raise ConfigError(f"--hp {pair!r}: expected NAME=VALUE with NAME one of {', '.join(known)}")
        default: Any = known[name].default  # every field has one (_hp)
        try:
            if isinstance(default, tuple):
                values[name] = tuple(float(x) for x in raw.split(","))
            elif isinstance(default, bool):  # bool("false") is True: spell the two values out
                values[name] = _BOOLS[raw.strip().lower()]
            else:
                values[name] = type(default)(raw)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"--hp {name}: {raw!r} is not a valid {type(default).__name__}") from exc
    return Hyperparams(**values)
