"""The quickstart run: warm start → RL through the whole system → held-out before/after → table, plot, timeline.

``run_demo`` is the list of phases (open the run, start the services, train, evaluate, report), each a function below
it. See the package docstring for what a user sees; ``config.DemoConfig`` for every size (``clawstream demo --help``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from clawbase.settings import KafkaSettings, clawstream_home
from clawstream.demo import families, report
from clawstream.demo.config import DemoConfig, check, recipe
from clawstream.demo.costs import read_costs
from clawstream.demo.evidence import finish_evidence, start_evidence
from clawstream.demo.models import export_version, prepare_model
from clawstream.demo.state import (
    STATE,
    Summary,
    harness_mix,
    load_state,
    real_harnesses,
    save_state,
)
from clawstream.demo.timeline import read_timeline, timeline_rows, timeline_table
from clawstream.demo.watch import Watcher
from clawstream.stack import Stack
from clawstream.stack.evaluate import EvalConfig, EvalResult, run_eval
from clawstream.stack.services import (
    run_kafka,
    stack_for,
    start_dashboard,
    start_learner,
    start_rollout_side,
    start_scheduler,
    start_streams,
    start_tracker,
    track_to_end,
)
from schemas.events import Metric


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


def eval_cache_path(model: Path, cfg: EvalConfig, cache: Path, today: str | None = None) -> Path:
    """Where a complete evaluation of ``model`` under ``cfg`` is kept. With a real harness the UTC day is part of
    the name: the harness puts the date in its prompt (opencode's system prompt: "Today's date: Sun Dec 06 2026"),
    so a result from another day was measured on other prompts and is not reused as this day's "before"."""
    from warmstart.sft import weights_sha256

    name = f"{weights_sha256(model)[:16]}-{cfg.key()}"
    if real_harnesses(cfg.harnesses):
        name += "-" + (today or time.strftime("%Y-%m-%d", time.gmtime()))
    return cache / f"{name}.json"


# The share of an evaluation's rollouts killed at the task timeout above which it is not cached: a 2-step demo beside
# eight busy test workers once had 29 of 32 at the 60 s timeout, and that "before" would have served every later run.
MAX_CACHED_TIMEOUT_SHARE = 0.02


def cached_eval(model: Path, cfg: EvalConfig, cache: Path, **kwargs: Any) -> EvalResult:
    """``run_eval``, reused when this exact model (weights sha256) was evaluated with this exact config before (the
    same UTC day, with a real harness)."""
    path = eval_cache_path(model, cfg, cache)
    if path.exists():
        result = EvalResult.from_json(json.loads(path.read_text()))
        kwargs.get("say", print)(f"==> {kwargs.get('label', 'eval')}: cached result of this model and config ({path})")
        return result
    result = run_eval(model, cfg, **kwargs)
    if not all(r.pending == 0 and r.infra == 0 for r in result.rows):  # only a complete measurement is worth reusing
        return result
    rollouts = sum(r.rollouts for r in result.rows)
    if result.timed_out() > MAX_CACHED_TIMEOUT_SHARE * rollouts:
        kwargs.get("say", print)(
            f"    not cached for reuse: {result.timed_out()} of {rollouts} rollouts hit the task timeout (a loaded "
            f"machine's timeouts are graded 0 like the policy's; over {MAX_CACHED_TIMEOUT_SHARE:.0%} it is not "
            "reused as another run's 'before')"
        )
        return result
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return result


def service_threads() -> int:
    """Torch threads for each of the CPU engine and the learner, which run at once on the same cores: half each.

    Measured on 2 cores (a 2048-token forward + backward of the warm start): one process alone 0.63 s with 2 threads;
    two at once 1.8-1.9 s each with 2 threads, 1.05-1.1 s each with 1 thread. Oversubscribed, the learner's step
    ran at 200-300 tokens/s while rollouts were in flight and at ~2,500 when they were not."""
    return max(1, (os.cpu_count() or 2) // 2)


@dataclass(frozen=True)
class DemoRun:
    """An opened run: its config, name, directory, topic prefix and summary.json, and the clock it is timed by."""

    cfg: DemoConfig
    name: str
    run_dir: Path
    prefix: str
    home: Path
    summary: Summary
    t0: float  # time.monotonic() at the start: every printed time is seconds since then
    resumed: bool

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.t0


@dataclass(frozen=True)
class Training:
    """What the RL part left: the trained steps' metrics, the weight versions the engine served, when RL began and
    when the services had stopped (seconds after ``DemoRun.t0``)."""

    trained: list[Metric]
    applied: list[int]
    rl_started: float
    stopped: float = 0.0  # set by ended() once the services have stopped

    def ended(self, stopped: float) -> Training:
        """This training, its services stopped ``stopped`` seconds after the start."""
        return replace(self, stopped=stopped)

    @property
    def rl_seconds(self) -> float:
        """The RL part's length, stopping the services included."""
        return self.stopped - self.rl_started


def run_demo(cfg: DemoConfig | None = None, *, resume: str | None = None, **overrides: Any) -> dict[str, Any]:
    """Run the quickstart; returns what happened (prefix, run dir, per-step metrics, versions served, evaluations).

    ``resume``: the name of an earlier run (``$CLAWSTREAM_HOME/demo/<name>``) to continue with its recorded config
    (``overrides`` may change only ``state.RESUMABLE``): its services resume from its topics and weight store, its
    evaluations are reused where cached."""
    say = _say
    run = open_run(cfg, resume, overrides, say)
    kafka = open_topics(run, say)
    model = resolve_model(run, say)
    stack = stack_for(kafka, run.run_dir / "logs")
    evidence = start_evidence(run.cfg, run.run_dir, model, say)
    watcher = watch_training(run, kafka, say, evidence)
    try:
        start_services(run, stack, model, say)
        training = train(run, stack, watcher, say)
    except BaseException:
        if evidence is not None:  # otherwise finish_evidence waits for the newest version
            evidence.close()
        raise
    finally:
        stop_services(stack, watcher, say)
    training = training.ended(run.elapsed())
    result = report_training(run, kafka, model, training, say)
    finish_evidence(evidence, run.run_dir, run.summary, say)
    evaluation = evaluate(run, kafka, model, training, say)
    if evaluation is not None:
        report_evaluation(run, result, training, evaluation, say)
    report_run(run, result, training, evaluation, say)
    if run.cfg.track:  # the last steps, the before/after table and the plot into the MLflow run
        code = track_to_end(stack, run.cfg.track, run.run_dir, model)
        say(f"==> MLflow: {'run complete' if code == 0 else f'tracker failed ({code})'}: {run.run_dir / 'logs'}")
    return result


def open_run(
    cfg: DemoConfig | None, resume: str | None, overrides: dict[str, Any], say: Callable[[str], None]
) -> DemoRun:
    """A new run (a fresh directory and topic prefix, ``cfg`` with ``overrides``) or run ``resume`` again (its
    recorded config with ``overrides``); the config is checked before anything is created."""
    t0 = time.monotonic()
    home = clawstream_home()
    if resume is not None:
        run_dir, prefix, config = load_state(home, resume, DemoConfig, overrides)
        if "zero_variance" not in json.loads((run_dir / STATE).read_text())["config"]:
            config = replace(config, zero_variance="keep")  # recorded before the flag: its groups were kept
        check(config)
        name = resume
    else:
        config = replace(cfg or DemoConfig(), **overrides)
        check(config)
        name = _claim_run_dir(home / "demo", time.strftime("%Y%m%d-%H%M%S"))
        run_dir = home / "demo" / name
        prefix = f"demo-{name}."
    summary = Summary(run_dir)
    summary.update(
        prefix=prefix,
        run_dir=str(run_dir),
        config=asdict(config),
        recipe=recipe(config),
        resumed=summary.data.get("resumed", 0),
    )
    if resume is not None:
        summary.update(resumed=summary.data["resumed"] + 1)
        say(f"==> resuming run {name} (prefix '{prefix}'; {run_dir})")
    return DemoRun(config, name, run_dir, prefix, home, summary, t0, resumed=resume is not None)


def open_topics(run: DemoRun, say: Callable[[str], None]) -> KafkaSettings:
    """The broker (started, or the one already running) and the run's topic catalog under its prefix."""
    kafka = run_kafka(run.prefix, say)
    say(f"==> topics {'found' if run.resumed else 'created'} under prefix '{run.prefix}'")
    return kafka


def resolve_model(run: DemoRun, say: Callable[[str], None]) -> Path:
    """The model RL starts from: ``--model`` (its recorded sha256 checked) or the warm start; a new run records it in
    its state, so a resume starts from the same."""
    if run.cfg.model is not None:
        from warmstart.sft import verify_recorded_sha256

        model = Path(run.cfg.model)
        say(f"==> model: {model} ({verify_recorded_sha256(model)})")
    else:
        model = prepare_model(run.home / "models", run.cfg, say)
    if not (model / "config.json").exists():
        raise ClawstreamError(f"--model {model}: not a model directory (no config.json)")
    if not run.resumed:
        save_state(run.run_dir, run.prefix, replace(run.cfg, model=model))
    return model


def watch_training(run: DemoRun, kafka: KafkaSettings, say: Callable[[str], None], evidence: Any = None) -> Watcher:
    """The live view of the RL part; each trained step also lands in summary.json as it arrives; each published
    version goes to ``evidence`` (when on)."""
    return Watcher(
        kafka,
        run.cfg.steps,
        run.cfg.tasks_per_step * run.cfg.group_size,
        progress=run.cfg.progress,
        say=say,
        on_step=lambda trained: run.summary.update(trained=[_metric(m) for m in trained]),
        evidence=evidence,
    )


def start_services(run: DemoRun, stack: Stack, model: Path, say: Callable[[str], None]) -> None:
    """Every service as its own process, the scheduler last: its first requests start the RL part."""
    cfg = run.cfg
    mix = harness_mix(cfg.harnesses)
    threads = service_threads()
    plural = "s" if threads > 1 else ""
    say(
        f"==> starting services (logs in {run.run_dir / 'logs'}; "
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
        suites={"cpu_builtin": f"builtin:cpu?train_grader={cfg.train_grader}"} if cfg.train_grader else None,
    )
    start_streams(
        stack,
        run.run_dir,
        group_size=cfg.group_size,
        batch_groups=cfg.tasks_per_step,
        settle_interval_s=cfg.settle_interval_s,
        harness_mix=mix,
        group_timeout_s=max(300.0, 2 * (cfg.rollout_timeout_s or 0.0)),  # a group outlives its slowest rollout
        zero_variance=cfg.zero_variance,
    )
    start_learner(stack, model, run.run_dir, learner_hparams(cfg), torch_threads=threads)
    try:  # a view of the run, not part of it: the demo goes on without it
        say(f"==> dashboard: {start_dashboard(stack)}  (reward, statuses, trees, capture health, weights)")
    except ClawstreamError as exc:
        say(f"==> dashboard did not start ({exc}); the run goes on without it")
    if cfg.track:
        say(f"==> MLflow: run {start_tracker(stack, cfg.track, run.run_dir, model).found} at {cfg.track}")
    start_scheduler(stack, cfg.steps, scheduler_settings(cfg, mix))


def learner_hparams(cfg: DemoConfig) -> dict[str, Any]:
    """The learner's hyperparameters: the flags that have their own, then every ``--hp NAME=VALUE``."""
    return {
        "lr": cfg.lr,
        "seed": cfg.seed,
        "logit_scale_lr": cfg.logit_scale_lr,
        **dict(h.split("=", 1) for h in cfg.hp),
    }


def scheduler_settings(cfg: DemoConfig, mix: dict[str, float]) -> dict[str, Any]:
    """The scheduler's settings: what each step asks for, how it is sampled, how far rollouts may run ahead."""
    return {
        "tasks_per_step": cfg.tasks_per_step,
        "group_size": cfg.group_size,
        "harness_mix": mix,
        **({"curriculum": cfg.curriculum} if cfg.curriculum else {}),
        "max_tokens": cfg.max_tokens,
        "temperature": cfg.train_temperature,
        "max_policy_lag": cfg.max_policy_lag,
        "zero_variance": cfg.zero_variance,  # as the streams: with drop, it refills the groups they drop
        "seed": cfg.seed,
        # After the last step: its re-issues and refills, counted again from each reward and refill; never shorter
        # than two rollout timeouts (no reward can be that far behind the one before while rollouts run).
        "drain_timeout_s": max(120.0, 2 * (cfg.rollout_timeout_s or 60.0)),
        **({"timeout_s": cfg.rollout_timeout_s} if cfg.rollout_timeout_s is not None else {}),
    }


def stop_services(stack: Stack, watcher: Watcher, say: Callable[[str], None]) -> None:
    """Whatever happened: the live view closed, every service stopped."""
    watcher.close()
    say("==> stopping services")
    stack.stop()


def train(run: DemoRun, stack: Stack, watcher: Watcher, say: Callable[[str], None]) -> Training:
    """Follow the RL part until every step is trained and its weight version served (or ``cfg.timeout_s`` passes)."""
    cfg = run.cfg
    rl_started = run.elapsed()
    say(
        f"==> RL begins {rl_started:.0f} s after the start: {cfg.steps} steps of {cfg.tasks_per_step} tasks × "
        f"{cfg.group_size} rollouts, harnesses {' + '.join(harness_mix(cfg.harnesses))}; {recipe(cfg)}"
    )
    trained, applied = watcher.follow(stack, cfg.timeout_s, started=run.t0)
    return Training(trained, applied, rl_started)


def report_training(
    run: DemoRun, kafka: KafkaSettings, model: Path, training: Training, say: Callable[[str], None]
) -> dict[str, Any]:
    """After the services stopped: where each step's time went and what a rollout cost, printed, written to
    timeline.md and summary.json; the start of the result ``run_demo`` returns."""
    result: dict[str, Any] = {
        "prefix": run.prefix,
        "run_dir": str(run.run_dir),
        "trained": training.trained,
        "applied": training.applied,
        "config": asdict(run.cfg),
        "model": str(model),
        "rl_started_s": round(training.rl_started, 1),
        "rl_seconds": round(training.rl_seconds, 1),
    }
    timeline = read_timeline(kafka)
    (run.run_dir / "timeline.md").write_text(timeline_table(timeline) + "\n")
    say(f"==> where each step's time went (seconds; {run.run_dir / 'timeline.md'}):\n{timeline_table(timeline)}")
    costs = read_costs(kafka)
    say(f"==> cost per rollout by harness (means over the run's rollouts): {json.dumps(costs)}")
    run.summary.update(
        **{k: v for k, v in result.items() if k != "trained"},
        trained=[_metric(m) for m in training.trained],
        timeline=timeline_rows(timeline),
        rollout_costs=costs,
    )
    return result


def eval_config(cfg: DemoConfig) -> EvalConfig:
    """The held-out evaluation of the warm start and of the final policy (the same config for both)."""
    return EvalConfig(
        harnesses=cfg.harnesses,
        tasks=cfg.eval_tasks,
        modes=cfg.eval_modes,
        temperature=cfg.eval_temperature,
        max_tokens=cfg.max_tokens,
        engine=cfg.engine,
        # The built-in loops' calls are short: 12 at once keep the engine's batches full. A real harness's first
        # call prefills ~14k tokens: 12 opencode rollouts at once on 2 cores left calls in flight past a 300 s
        # rollout timeout (at 4 at once in training: 46 s per rollout), so then --concurrency holds.
        concurrency=cfg.concurrency if real_harnesses(cfg.harnesses) else max(cfg.concurrency, 12),
        rollout_timeout_s=cfg.rollout_timeout_s,
    )


def evaluate(
    run: DemoRun, kafka: KafkaSettings, model: Path, training: Training, say: Callable[[str], None]
) -> tuple[EvalResult, EvalResult] | None:
    """The warm start and the last served version on the same held-out tasks: (before, after); None with
    ``--eval-tasks 0`` or when no step was trained."""
    cfg = run.cfg
    if cfg.eval_tasks <= 0 or not training.trained:
        return None
    last = max(training.applied)
    final = export_version(model, run.run_dir / "weights", last, run.run_dir / "final-model")
    ecfg = eval_config(cfg)
    # The warm start's score does not change between runs: measured once per model and config, then reused;
    # the final model's likewise, so a resumed run that had finished its evaluation does not run it again.
    before = cached_eval(
        model,
        ecfg,
        run.home / "eval-cache",
        kafka=kafka,
        run_dir=run.run_dir / "eval-before",
        label="held-out eval, before RL (v0)",
        progress=cfg.progress,
        say=say,
    )
    run.summary.update(before=before.to_json())
    after = cached_eval(
        final,
        ecfg,
        run.home / "eval-cache",
        kafka=kafka,
        run_dir=run.run_dir / "eval-after",
        progress=cfg.progress,
        say=say,
        label=f"held-out eval, after RL (v{last})",
    )
    return before, after


def report_evaluation(
    run: DemoRun,
    result: dict[str, Any],
    training: Training,
    evaluation: tuple[EvalResult, EvalResult],
    say: Callable[[str], None],
) -> None:
    """The before → after table (printed, before_after.md), into ``result`` and summary.json, and TensorBoard."""
    before, after = evaluation
    table = report.before_after_table(before, after)
    per_family = families.family_tables([(before.to_json(), after.to_json())], before.config.modes)
    (run.run_dir / "before_after.md").write_text(f"Recipe: {recipe(run.cfg)}.\n\n{table}\n\n{per_family}\n")
    say(
        f"==> held-out mean reward per harness, before → after RL ({run.cfg.eval_tasks} tasks each; ± 1 s.e., "
        f"paired over the same tasks where both runs graded them; {recipe(run.cfg)}):\n{table}\n\n{per_family}"
    )
    result.update(before=before.to_json(), after=after.to_json(), before_after=report.before_after_rows(before, after))
    run.summary.update(after=result["after"], before_after=result["before_after"])
    last_step = max(m.step or 0 for m in training.trained)
    report.tensorboard_eval(run.run_dir / "tensorboard", before, after, last_step + 1)


def report_run(
    run: DemoRun,
    result: dict[str, Any],
    training: Training,
    evaluation: tuple[EvalResult, EvalResult] | None,
    say: Callable[[str], None],
) -> None:
    """The run's last lines: the plot (training reward, and the evaluation where there was one) and the total time
    (in ``result`` and summary.json)."""
    before, after = evaluation if evaluation is not None else (None, None)
    png = report.plot(
        run.run_dir / "learning.png", training.trained, before, after, evidence=run.summary.data.get("evidence")
    )
    say(f"==> plot: {png}\n    TensorBoard: tensorboard --logdir {run.run_dir / 'tensorboard'}")
    result["total_s"] = round(run.elapsed(), 1)
    run.summary.update(total_s=result["total_s"])
    say(
        f"==> done in {result['total_s'] / 60:.1f} min "
        f"(RL began at {training.rl_started:.0f} s, took {training.rl_seconds:.0f} s)"
    )


def _metric(m: Any) -> dict[str, Any]:
    return {"step": m.step, "policy_version": m.policy_version, "values": m.values}


def _say(message: str) -> None:
    print(message, flush=True)
