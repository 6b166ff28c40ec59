"""The quickstart run: warm start → RL through the whole system → held-out before/after → table, plot, timeline.

See the package docstring for what a user sees; ``DemoConfig`` for every size (``clawstream demo --help``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from clawbase.settings import clawstream_home
from clawstream.demo import report
from clawstream.demo.costs import read_costs
from clawstream.demo.state import (
    Summary,
    check_harnesses,
    harness_mix,
    load_state,
    real_harnesses,
    save_state,
)
from clawstream.demo.timeline import read_timeline, timeline_rows, timeline_table
from clawstream.demo.watch import Watcher
from clawstream.stack.evaluate import EvalConfig, EvalResult, run_eval
from clawstream.stack.services import (
    run_kafka,
    stack_for,
    start_dashboard,
    start_learner,
    start_rollout_side,
    start_scheduler,
    start_streams,
)
from learner.hparams import Hyperparams
from warmstart.sft import SHIPPED_RECIPE

HARNESS_MIX = {"agentloop": 1.0, "agentloop-anthropic": 1.0}


@dataclass(frozen=True)
class DemoConfig:
    """Every size of the quickstart. RL: ``steps`` × ``tasks_per_step`` GRPO groups of ``group_size`` rollouts."""

    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    lr: float = 2e-5  # learner AdamW learning rate
    logit_scale_lr: float = 0.1  # learner's learned logit scale (learner/logit_scale.py); --hp logit_scale_lr=X
    hp: tuple[str, ...] = ()  # more learner hyperparameters, NAME=VALUE (Hyperparams; `clawstream learner --help`)
    max_policy_lag: int = 1  # step s+1's rollouts may run while step s trains
    temperature: float = 1.0
    max_tokens: int = 256  # per model call
    concurrency: int = 8  # rollouts at once (sandbox worker)
    rollout_timeout_s: float | None = None  # every task's rollout timeout (None: the task's own, 60 s on builtin:cpu)
    settle_interval_s: float = 0.0  # the built-in loop's rollouts are complete at HARNESS_EXITED: no quiet period
    seed: int = 0  # scheduler's task sampling and the learner's torch seed
    harnesses: tuple[str, ...] = tuple(HARNESS_MIX)  # mixed in equal shares; evaluated each (--harnesses)
    model: Path | None = None  # start RL from this model directory instead of the tiny model's warm start below
    sft_steps: int | None = None  # None: the shipped warm start (its recipe: sft.SHIPPED_RECIPE); N: an N-step
    # single-stage recipe with the sizes below; 0: RL from the random model
    sft_seed: int = 0
    sft_batch_size: int = 16
    sft_n_tasks: int = 1024
    eval_tasks: int = 256  # held-out tasks per harness and mode, before and after (0: no evaluation)
    eval_modes: tuple[str, ...] = ("greedy", "sampled")
    timeout_s: float = 3600.0  # for the RL part
    engine: str = "cpu"
    progress: bool = True


def _claim_run_dir(parent: Path, name: str) -> str:
    """A run name no other demo has: two demos started in the same second shared a directory and a topic prefix
    (one's streams then died, the other's topics held both runs' rollouts). mkdir is the atomic claim."""
    parent.mkdir(parents=True, exist_ok=True)
    for k in range(1, 1000):
        candidate = name if k == 1 else f"{name}-{k}"
        try:
            (parent / candidate).mkdir()
        except FileExistsError:
            continue
        return candidate
    raise ClawstreamError(f"no free run directory for {name} under {parent}")


def warm_start_dir(models: Path, cfg: DemoConfig) -> Path:
    """Where the warm start of this recipe is cached: the recipe is in the name, so another recipe trains anew."""
    if cfg.sft_steps is None:
        digest = hashlib.sha256(json.dumps(list(SHIPPED_RECIPE), sort_keys=True).encode()).hexdigest()[:8]
        return models / f"tiny-qwen3-sft-shipped-recipe-{digest}"
    recipe = {
        "steps": cfg.sft_steps,
        "seed": cfg.sft_seed,
        "batch_size": cfg.sft_batch_size,
        "n_tasks": cfg.sft_n_tasks,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    return models / f"tiny-qwen3-sft-{cfg.sft_steps}steps-seed{cfg.sft_seed}-{digest}"


def prepare_model(models: Path, cfg: DemoConfig, say: Any = print) -> Path:
    """The warm start RL begins from: by default the repository's shipped checkpoint (when intact; else its recipe
    is trained once and cached), or the single-stage recipe of ``cfg.sft_steps`` (trained once; cached; 0: the tiny
    base model itself)."""
    from policy.tiny_model import init_tiny_model, is_current
    from warmstart import sft

    if cfg.sft_steps is None:  # the shipped checkpoint: RL starts at once
        shipped, why = sft.shipped_warm_start()
        if shipped is not None:
            say(f"==> warm start: {shipped} (shipped; {why})")
            return shipped
        say(f"==> warm start: not using the shipped checkpoint: {why}")
    base = models / "tiny-qwen3"
    if not is_current(base):  # missing, or built by an older builder (e.g. fewer positions): rebuild all of it
        for stale in models.glob("tiny-qwen3-sft*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        say(f"==> building the tiny Qwen3-architecture model into {base}")
        init_tiny_model(base, seed=0, progress=lambda _msg: None)
    if cfg.sft_steps is not None and cfg.sft_steps <= 0:
        return base
    _quiet_transformers()
    warm = warm_start_dir(models, cfg)
    if (warm / "sft_summary.json").exists():
        summary = json.loads((warm / "sft_summary.json").read_text())
        say(f"==> warm start: {warm} (cached; {summary.get('steps')} SFT steps)")
        return warm
    partial = warm.with_name(warm.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if cfg.sft_steps is None:
        total = sum(stage["steps"] for stage in SHIPPED_RECIPE)
        say(
            f"==> warm start: training the shipped recipe ({total} SFT steps in {len(SHIPPED_RECIPE)} stages; about "
            f"an hour on 2 cores), once → {warm}"
        )
        sft.train_recipe(base, partial, eval_tasks=0, progress=cfg.progress)
    else:
        say(
            f"==> warm start: {cfg.sft_steps} SFT steps (seed {cfg.sft_seed}) on synthetic agent demonstrations, "
            f"once → {warm}"
        )
        sft.sft(
            base,
            partial,
            steps=cfg.sft_steps,
            seed=cfg.sft_seed,
            batch_size=cfg.sft_batch_size,
            n_tasks=cfg.sft_n_tasks,
            eval_tasks=0,
            progress=cfg.progress,
        )
    partial.rename(warm)  # only a finished warm start is ever found in the cache
    return warm


def export_version(model: Path, weights: Path, version: int, out: Path) -> Path:
    """A served weight version as a model directory (``model``'s config and tokenizer, the version's weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from policy.weight_store import copy_into, load_checked, version_path
    from warmstart.sft import save_model

    _quiet_transformers()
    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    copy_into(net, load_checked(version_path(weights, "policy", version), net))
    save_model(net, None, model, out)
    return out


def eval_cache_path(model: Path, cfg: EvalConfig, cache: Path, today: str | None = None) -> Path:
    """Where a complete evaluation of ``model`` under ``cfg`` is kept. With a real harness the UTC day is part of
    the name: the harness puts the date in its prompt (opencode's system prompt: "Today's date: Sun Dec 06 2026"),
    so a result from another day was measured on other prompts and is not reused as this day's "before"."""
    from warmstart.sft import weights_sha256

    name = f"{weights_sha256(model)[:16]}-{cfg.key()}"
    if real_harnesses(cfg.harnesses):
        name += "-" + (today or time.strftime("%Y-%m-%d", time.gmtime()))
    return cache / f"{name}.json"


def cached_eval(model: Path, cfg: EvalConfig, cache: Path, **kwargs: Any) -> EvalResult:
    """``run_eval``, reused when this exact model (weights sha256) was evaluated with this exact config before (the
    same UTC day, with a real harness)."""
    path = eval_cache_path(model, cfg, cache)
    if path.exists():
        result = EvalResult.from_json(json.loads(path.read_text()))
        kwargs.get("say", print)(f"==> {kwargs.get('label', 'eval')}: cached result of this model and config ({path})")
        return result
    result = run_eval(model, cfg, **kwargs)
    if all(r.pending == 0 and r.infra == 0 for r in result.rows):  # only a complete measurement is worth reusing
        cache.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def service_threads() -> int:
    """Torch threads for each of the CPU engine and the learner, which run at once on the same cores: half each.

    Measured on 2 cores (a 2048-token forward + backward of the warm start): one process alone 0.63 s with 2 threads;
    two at once 1.8-1.9 s each with 2 threads, 1.05-1.1 s each with 1 thread. Oversubscribed, the learner's step
    ran at 200-300 tokens/s while rollouts were in flight and at ~2,500 when they were not."""
    return max(1, (os.cpu_count() or 2) // 2)


def run_demo(cfg: DemoConfig | None = None, *, resume: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the quickstart; returns what happened (prefix, run dir, per-step metrics, versions served, evaluations).

    ``resume``: the name of an earlier run (``$CLAWSTREAM_HOME/demo/<name>``) to continue with its recorded config
    (``overrides`` may change only ``state.RESUMABLE``): its services resume from its topics and weight store, its
    evaluations are reused where cached."""
    say = _say
    t0 = time.monotonic()
    home = clawstream_home()
    if resume is not None:
        run_dir, prefix, cfg = load_state(home, resume, DemoConfig, overrides)
        run = resume
    else:
        cfg = replace(cfg or DemoConfig(), **overrides)
    assert cfg is not None  # both branches set it (for mypy, which does not follow the narrowing into closures)
    check(cfg)
    if resume is None:
        run = _claim_run_dir(home / "demo", time.strftime("%Y%m%d-%H%M%S"))
        run_dir = home / "demo" / run
        prefix = f"demo-{run}."
    summary = Summary(run_dir)
    summary.update(prefix=prefix, run_dir=str(run_dir), config=asdict(cfg), resumed=summary.data.get("resumed", 0))
    if resume is not None:
        summary.update(resumed=summary.data["resumed"] + 1)
        say(f"==> resuming run {run} (prefix '{prefix}'; {run_dir})")
    kafka = run_kafka(prefix, say)
    say(f"==> topics {'found' if resume else 'created'} under prefix '{prefix}'")
    if cfg.model is not None:
        from warmstart.sft import verify_recorded_sha256

        model = Path(cfg.model)
        say(f"==> model: {model} ({verify_recorded_sha256(model)})")
    else:
        model = prepare_model(home / "models", cfg, say)
    if not (model / "config.json").exists():
        raise ClawstreamError(f"--model {model}: not a model directory (no config.json)")
    if resume is None:
        save_state(run_dir, prefix, replace(cfg, model=model))  # the model resolved: a resume starts from the same
    mix = harness_mix(cfg.harnesses)

    stack = stack_for(kafka, run_dir / "logs")
    rollouts_per_step = cfg.tasks_per_step * cfg.group_size
    watcher = Watcher(
        kafka,
        cfg.steps,
        rollouts_per_step,
        progress=cfg.progress,
        say=say,
        on_step=lambda trained: summary.update(trained=[_metric(m) for m in trained]),
    )
    try:
        threads = service_threads()
        plural = "s" if threads > 1 else ""
        say(
            f"==> starting services (logs in {run_dir / 'logs'}; "
            f"engine and learner: {threads} torch thread{plural} each)"
        )
        start_rollout_side(
            stack,
            model,
            engine=cfg.engine,
            concurrency=cfg.concurrency,
            max_batch_size=max(16, cfg.concurrency),
            torch_threads=threads,
            task_timeout_s=cfg.rollout_timeout_s,
        )
        start_streams(
            stack,
            run_dir,
            group_size=cfg.group_size,
            batch_groups=cfg.tasks_per_step,
            settle_interval_s=cfg.settle_interval_s,
            harness_mix=mix,
            group_timeout_s=max(300.0, 2 * (cfg.rollout_timeout_s or 0.0)),  # a group outlives its slowest rollout
        )
        hparams = {
            "lr": cfg.lr,
            "seed": cfg.seed,
            "logit_scale_lr": cfg.logit_scale_lr,
            **dict(h.split("=", 1) for h in cfg.hp),
        }
        start_learner(stack, model, run_dir, hparams, torch_threads=threads)
        try:  # a view of the run, not part of it: the demo goes on without it
            say(f"==> dashboard: {start_dashboard(stack)}  (reward, statuses, trees, capture health, weights)")
        except ClawstreamError as exc:
            say(f"==> dashboard did not start ({exc}); the run goes on without it")
        start_scheduler(
            stack,
            cfg.steps,
            {
                "tasks_per_step": cfg.tasks_per_step,
                "group_size": cfg.group_size,
                "harness_mix": mix,
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
                "max_policy_lag": cfg.max_policy_lag,
                "seed": cfg.seed,
                "drain_timeout_s": 120,
                **({"timeout_s": cfg.rollout_timeout_s} if cfg.rollout_timeout_s is not None else {}),
            },
        )
        rl_started = time.monotonic() - t0
        say(
            f"==> RL begins {rl_started:.0f} s after the start: {cfg.steps} steps of {cfg.tasks_per_step} tasks × "
            f"{cfg.group_size} rollouts, harnesses {' + '.join(mix)}"
        )
        trained, applied = watcher.follow(stack, cfg.timeout_s, started=t0)
    finally:
        watcher.close()
        say("==> stopping services")
        stack.stop()
    rl_seconds = time.monotonic() - t0 - rl_started
    result: dict[str, Any] = {
        "prefix": prefix,
        "run_dir": str(run_dir),
        "trained": trained,
        "applied": applied,
        "config": asdict(cfg),
        "model": str(model),
        "rl_started_s": round(rl_started, 1),
        "rl_seconds": round(rl_seconds, 1),
    }
    timeline = read_timeline(kafka)
    (run_dir / "timeline.md").write_text(timeline_table(timeline) + "\n")
    say(f"==> where each step's time went (seconds; {run_dir / 'timeline.md'}):\n{timeline_table(timeline)}")
    costs = read_costs(kafka)
    say(f"==> cost per rollout by harness (means over the run's rollouts): {json.dumps(costs)}")
    summary.update(
        **{k: v for k, v in result.items() if k != "trained"},
        trained=[_metric(m) for m in trained],
        timeline=timeline_rows(timeline),
        rollout_costs=costs,
    )

    before = after = None
    if cfg.eval_tasks > 0 and trained:
        final = export_version(model, run_dir / "weights", max(applied), run_dir / "final-model")
        ecfg = EvalConfig(
            harnesses=cfg.harnesses,
            tasks=cfg.eval_tasks,
            modes=cfg.eval_modes,
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            engine=cfg.engine,
            # The built-in loops' calls are short: 12 at once keep the engine's batches full. A real harness's first
            # call prefills ~14k tokens: 12 opencode rollouts at once on 2 cores left calls in flight past a 300 s
            # rollout timeout (at 4 at once in training: 46 s per rollout), so then --concurrency holds.
            concurrency=cfg.concurrency if real_harnesses(cfg.harnesses) else max(cfg.concurrency, 12),
            rollout_timeout_s=cfg.rollout_timeout_s,
        )
        # The warm start's score does not change between runs: measured once per model and config, then reused;
        # the final model's likewise, so a resumed run that had finished its evaluation does not run it again.
        before = cached_eval(
            model,
            ecfg,
            home / "eval-cache",
            kafka=kafka,
            run_dir=run_dir / "eval-before",
            label="held-out eval, before RL (v0)",
            progress=cfg.progress,
            say=say,
        )
        summary.update(before=before.to_json())
        after = cached_eval(
            final,
            ecfg,
            home / "eval-cache",
            kafka=kafka,
            run_dir=run_dir / "eval-after",
            progress=cfg.progress,
            say=say,
            label=f"held-out eval, after RL (v{max(applied)})",
        )
        table = report.before_after_table(before, after)
        (run_dir / "before_after.md").write_text(table + "\n")
        say(
            f"==> held-out mean reward per harness, before → after RL ({cfg.eval_tasks} tasks each; ± 1 s.e., "
            f"paired over the same tasks where both runs graded them):\n{table}"
        )
        result.update(
            before=before.to_json(), after=after.to_json(), before_after=report.before_after_rows(before, after)
        )
        summary.update(after=result["after"], before_after=result["before_after"])
        report.tensorboard_eval(run_dir / "tensorboard", before, after, max(m.step or 0 for m in trained) + 1)
    png = report.plot(run_dir / "learning.png", trained, before, after)
    say(f"==> plot: {png}\n    TensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    result["total_s"] = round(time.monotonic() - t0, 1)
    summary.update(total_s=result["total_s"])
    say(f"==> done in {result['total_s'] / 60:.1f} min (RL began at {rl_started:.0f} s, took {rl_seconds:.0f} s)")
    return result


def _quiet_transformers() -> None:
    """transformers' own load/save progress bars would interleave with the demo's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _metric(m: Any) -> dict[str, Any]:
    return {"step": m.step, "policy_version": m.policy_version, "values": m.values}


def _say(message: str) -> None:
    print(message, flush=True)


def check(cfg: DemoConfig) -> None:
    """Refuse sizes that cannot work, with the flag to change."""
    if cfg.steps < 1 or cfg.tasks_per_step < 1 or cfg.group_size < 1:
        raise ClawstreamError("--steps, --tasks-per-step and --group-size must be >= 1")
    if cfg.rollout_timeout_s is not None and cfg.rollout_timeout_s <= 0:
        raise ClawstreamError(f"--rollout-timeout must be > 0 seconds, got {cfg.rollout_timeout_s}")
    if cfg.group_size < 2:
        raise ClawstreamError("--group-size must be >= 2: GRPO needs rollouts to compare within a group")
    check_harnesses(cfg.harnesses, cfg.tasks_per_step)
    known = {f.name for f in fields(Hyperparams)} - {"lr", "seed"}
    for h in cfg.hp:
        name = h.split("=", 1)[0]
        if "=" not in h or name not in known:
            raise ClawstreamError(
                f"--hp {h!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(known))} "
                "(--lr and --seed have their own flags)"
            )
