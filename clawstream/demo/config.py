"""The quickstart's sizes (``DemoConfig``: every ``clawstream demo`` flag) and the check that refuses sizes that cannot
work before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from clawbase.errors import ClawstreamError
from clawstream.demo.state import check_harnesses
from learner.hparams import Hyperparams

HARNESS_MIX = {"agentloop": 1.0, "agentloop-anthropic": 1.0}
LOGIT_SCALE_ON_LR = 0.1  # --logit-scale on: the learned logit scale's lr (the recipe before the skill recipe)


@dataclass(frozen=True)
class DemoConfig:
    """Every size of the quickstart. RL: ``steps`` × ``tasks_per_step`` GRPO groups of ``group_size`` rollouts."""

    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    lr: float = 2e-5  # learner AdamW learning rate
    # The learned logit scale (learner/logit_scale.py): its lr, 0 = off. Off is the skill recipe, as the paper: the
    # scale cannot change an argmax, only sharpen sampling (--logit-scale on = LOGIT_SCALE_ON_LR; runs reported apart).
    logit_scale_lr: float = 0.0
    hp: tuple[str, ...] = ()  # more learner hyperparameters, NAME=VALUE (Hyperparams; `clawstream learner --help`)
    max_policy_lag: int = 1  # step s+1's rollouts may run while step s trains
    train_temperature: float = 1.0  # RL rollouts' sampling (the learner recomputes logprobs at each call's own)
    eval_temperature: float = 1.0  # the sampled held-out evaluation's (greedy is temperature 0)
    zero_variance: str = "drop"  # groups whose rewards are all equal: drop (the scheduler refills them) or keep
    max_tokens: int = 256  # per model call
    concurrency: int = 8  # rollouts at once (sandbox worker)
    rollout_timeout_s: float | None = None  # every task's rollout timeout (None: the task's own, 60 s on builtin:cpu)
    settle_interval_s: float = 0.0  # the built-in loop's rollouts are complete at HARNESS_EXITED: no quiet period
    seed: int = 0  # scheduler's task sampling and the learner's torch seed
    curriculum: str = ""  # training tasks by family, FAMILY=WEIGHT,... (producers/scheduler/curriculum.py); "": uniform
    train_grader: str = ""  # "partial": the sandbox worker's builtin:cpu?train_grader=partial (training only)
    harnesses: tuple[str, ...] = tuple(HARNESS_MIX)  # mixed in equal shares; evaluated each (--harnesses)
    model: Path | None = None  # start RL from this model directory instead of the tiny model's warm start below
    sft_steps: int | None = None  # None: the shipped warm start (its recipe: sft.SHIPPED_RECIPE); N: an N-step
    # single-stage recipe with the sizes below; 0: RL from the random model
    sft_seed: int = 0
    sft_batch_size: int = 16
    sft_n_tasks: int = 1024
    eval_tasks: int = 256  # held-out tasks per harness and mode, before and after (0: no evaluation)
    eval_modes: tuple[str, ...] = ("greedy", "sampled")
    evidence: bool = True  # per-version held-out evidence in a background process (clawstream/demo/evidence.py)
    evidence_tasks: int = 64  # held-out correct episodes scored per version, x 2 dialects
    evidence_greedy_tasks: int = 16  # held-out tasks run greedily per version, x 2 dialects (0: none)
    timeout_s: float = 3600.0  # for the RL part
    engine: str = "cpu"
    progress: bool = True
    track: str | None = None  # MLflow tracking server: the tracker follows the run into it (--track, consumers/tracker)


def check(cfg: DemoConfig) -> None:
    """Refuse sizes that cannot work, with the flag to change."""
    if cfg.steps < 1 or cfg.tasks_per_step < 1 or cfg.group_size < 1:
        raise ClawstreamError("--steps, --tasks-per-step and --group-size must be >= 1")
    if cfg.rollout_timeout_s is not None and cfg.rollout_timeout_s <= 0:
        raise ClawstreamError(f"--rollout-timeout must be > 0 seconds, got {cfg.rollout_timeout_s}")
    if cfg.group_size < 2:
        raise ClawstreamError("--group-size must be >= 2: GRPO needs rollouts to compare within a group")
    check_harnesses(cfg.harnesses, cfg.tasks_per_step)
    if cfg.zero_variance not in ("drop", "keep"):
        raise ClawstreamError(f"--zero-variance must be drop or keep, got {cfg.zero_variance!r}")
    if cfg.train_temperature <= 0 or cfg.eval_temperature < 0:
        raise ClawstreamError(
            "--train-temperature must be > 0 (greedy rollouts of a group are alike: nothing to learn) and "
            f"--eval-temperature >= 0; got {cfg.train_temperature:g} and {cfg.eval_temperature:g}"
        )
    if cfg.curriculum:  # refused here, not by a scheduler that would restart on it: names the families
        from producers.scheduler.curriculum import parse
        from producers.tasks.cpu import cpu_suite

        parse(cfg.curriculum, cpu_suite().split("train"))
    if cfg.evidence and (cfg.evidence_tasks < 2 or cfg.evidence_greedy_tasks < 0):
        raise ClawstreamError("evidence_tasks must be >= 2 and evidence_greedy_tasks >= 0 (or --evidence off)")
    known = {f.name for f in fields(Hyperparams)} - {"lr", "seed"}
    for h in cfg.hp:
        name = h.split("=", 1)[0]
        if "=" not in h or name not in known:
            raise ClawstreamError(
                f"--hp {h!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(known))} "
                "(--lr and --seed have their own flags)"
            )


def recipe(cfg: DemoConfig) -> str:
    """The run's recipe in words, for its summary and the headers of its tables."""
    lr = float(dict(h.split("=", 1) for h in cfg.hp).get("logit_scale_lr", cfg.logit_scale_lr))  # --hp wins
    scale = f"on (lr {lr:g})" if lr > 0 else "off"
    groups = "dropped, refilled" if cfg.zero_variance == "drop" else "kept at advantage 0"
    return (
        f"logit scale {scale}; groups with equal rewards {groups}; train temperature {cfg.train_temperature:g}, "
        f"sampled-eval temperature {cfg.eval_temperature:g}"
    )
