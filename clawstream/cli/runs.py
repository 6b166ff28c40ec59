"""Whole runs over every service: ``clawstream demo`` (the CPU quickstart), ``clawstream eval``,
``clawstream demo-seeds`` (several demo runs side by side) and ``clawstream chaos`` (random kills, then the audit).

The demo and the evaluation are imported inside the commands, so ``clawstream --help`` stays fast; their defaults
are written in the help texts (tests/unit/test_demo_cli.py keeps them equal to DemoConfig / EvalConfig).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from clawbase.signals import sigterm_interrupts


# ---- demo --------------------------------------------------------------------------------------------------------
@click.command("demo")
@click.option("--steps", type=int, default=None, help="RL training steps.  [default: 20]")
@click.option(
    "--tasks-per-step", type=int, default=None, help="Task x harness instances (GRPO groups) per step.  [default: 4]"
)
@click.option("--group-size", type=int, default=None, help="Rollouts per instance (GRPO group).  [default: 8]")
@click.option(
    "--harnesses",
    default=None,
    metavar="H1,H2,...",
    help="Harnesses mixed in equal shares in every batch (GRPO groups per task x harness) and evaluated each, as "
    "`clawstream harness list` names them, e.g. opencode,agentloop; a real harness must be installed first "
    "(`clawstream harness install NAME`).  [default: agentloop,agentloop-anthropic]",
)
@click.option(
    "--resume",
    "resume",
    default=None,
    metavar="RUN",
    help="Continue run RUN ($CLAWSTREAM_HOME/demo/RUN) from its recorded state: its config, topics, weight store and "
    "cached evaluations; only --steps and --timeout may change.",
)
@click.option(
    "--curriculum",
    default=None,
    metavar="FAMILY=WEIGHT,...",
    help="Draw training tasks by family with these weights (builtin:cpu: its templates; *=W for the rest), e.g. "
    "the measured recipe in docs/method.md#curriculum; `clawstream model curriculum --model DIR` measures one. "
    "Default: uniform.",
)
@click.option(
    "--train-grader",
    type=click.Choice(["partial"]),
    default=None,
    help="Grade the training tasks' replace per line (builtin:cpu?train_grader=partial, docs/task_suites.md); "
    "evaluations keep the exact graders. Default: the exact graders.",
)
@click.option("--lr", type=float, default=None, help="Learner learning rate.  [default: 2e-05]")
@click.option("--seed", type=int, default=None, help="Seed of the task sampling and the learner.  [default: 0]")
@click.option(
    "--hp",
    multiple=True,
    metavar="NAME=VALUE",
    help="Another learner hyperparameter (repeat; `clawstream learner --help` lists them), e.g. "
    "--hp mini_batches=2 --hp kl_coef=0.01.",
)
@click.option(
    "--logit-scale",
    type=click.Choice(["on", "off"]),
    default=None,
    help="The learned logit scale (learner/logit_scale.py): on = logit_scale_lr 0.1 (it sharpens sampling, cannot "
    "change a greedy answer), off = 0 as the paper: the skill recipe; --hp logit_scale_lr=X sets another lr.  "
    "[default: off]",
)
@click.option(
    "--zero-variance",
    type=click.Choice(["drop", "keep"]),
    default=None,
    help="Groups whose rewards are all equal: drop them (the scheduler issues a refill group for each, so batches "
    "still fill with informative groups) or keep them at advantage 0.  [default: drop]",
)
@click.option(
    "--train-temperature", type=float, default=None, help="Sampling temperature of the RL rollouts.  [default: 1.0]"
)
@click.option(
    "--eval-temperature",
    type=float,
    default=None,
    help="Temperature of the sampled held-out evaluation (greedy is 0).  [default: 1.0]",
)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="Sets both --train-temperature and --eval-temperature (each, given too, wins).",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    default=None,
    help="Start RL from this model directory (e.g. `clawstream model sft` output) instead of the built-in warm start.",
)
@click.option(
    "--sft-steps",
    type=int,
    default=None,
    help="Warm start: an N-step single-stage SFT recipe (once per recipe; cached) instead of the shipped "
    "checkpoint; 0: RL from the random model.  [default: the shipped warm start, models/warmstart/]",
)
@click.option("--sft-seed", type=int, default=None, help="Warm start recipe: seed.  [default: 0]")
@click.option(
    "--eval-tasks",
    type=int,
    default=None,
    help="Held-out tasks per harness and mode, before and after RL (0: no evaluation).  [default: 256]",
)
@click.option(
    "--eval-mode",
    "eval_modes",
    multiple=True,
    type=click.Choice(["greedy", "sampled"]),
    help="Evaluation decoding (repeat).  [default: greedy, sampled]",
)
@click.option(
    "--evidence",
    type=click.Choice(["on", "off"]),
    default=None,
    help="Measure each published version in a background process: held-out correct-episode log-likelihood and a "
    "small greedy slice, printed per version, evidence.jsonl + evidence.png (clawstream/demo/evidence.py).  "
    "[default: on]",
)
@click.option("--concurrency", type=int, default=None, help="Rollouts at once.  [default: 8]")
@click.option(
    "--rollout-timeout",
    type=float,
    default=None,
    help="Seconds every rollout may take, training and evaluation, instead of the task's own (60 s on builtin:cpu); "
    "a real harness on 2 busy cores needs several minutes.  [default: the task's own]",
)
@click.option(
    "--timeout", type=float, default=None, help="Give up on the RL part after this many seconds.  [default: 3600]"
)
@click.option(
    "--engine",
    type=click.Choice(["cpu", "vllm"]),
    default="cpu",
    show_default=True,
    help="Inference engine: the project's CPU engine, or real vLLM (`clawstream vllm install` first).",
)
@click.option("--no-progress", is_flag=True, help="Log lines only, no progress bars.")
@click.option(
    "--track",
    metavar="URI",
    envvar="CLAWSTREAM_TRACK_URI",
    default=None,
    help="MLflow tracking server (http://HOST:PORT): the run, its metrics, versions, trajectories and before/after "
    "table go there (consumers/tracker; the 'track' extra).  [env CLAWSTREAM_TRACK_URI]",
)
def demo(
    steps: int | None,
    tasks_per_step: int | None,
    group_size: int | None,
    harnesses: str | None,
    resume: str | None,
    lr: float | None,
    seed: int | None,
    curriculum: str | None,
    train_grader: str | None,
    hp: tuple[str, ...],
    logit_scale: str | None,
    zero_variance: str | None,
    train_temperature: float | None,
    eval_temperature: float | None,
    temperature: float | None,
    model_dir: Path | None,
    sft_steps: int | None,
    sft_seed: int | None,
    eval_tasks: int | None,
    eval_modes: tuple[str, ...],
    evidence: str | None,
    concurrency: int | None,
    rollout_timeout: float | None,
    timeout: float | None,
    engine: str,
    no_progress: bool,
    track: str | None,
) -> None:
    """CPU quickstart: warm start, then RL through every service (engine, proxy, sandbox worker, streams, learner,
    scheduler) on a local broker, then held-out reward per harness before and after, a plot and TensorBoard scalars
    in $CLAWSTREAM_HOME/demo/<run>/ (docs/quickstart.md)."""
    from clawstream.demo import run_demo
    from clawstream.demo.config import LOGIT_SCALE_ON_LR
    from clawstream.demo.state import parse_harnesses

    sigterm_interrupts()  # `kill` stops the demo's services too (its finally), as Ctrl-C does
    given: dict[str, Any] = {
        "steps": steps,
        "tasks_per_step": tasks_per_step,
        "group_size": group_size,
        "harnesses": parse_harnesses(harnesses) if harnesses is not None else None,
        "lr": lr,
        "seed": seed,
        "curriculum": curriculum,
        "train_grader": train_grader,
        "hp": tuple(hp) or None,
        "logit_scale_lr": None if logit_scale is None else (LOGIT_SCALE_ON_LR if logit_scale == "on" else 0.0),
        "zero_variance": zero_variance,
        "train_temperature": train_temperature if train_temperature is not None else temperature,
        "eval_temperature": eval_temperature if eval_temperature is not None else temperature,
        "model": model_dir,
        "sft_steps": sft_steps,
        "sft_seed": sft_seed,
        "eval_tasks": eval_tasks,
        "eval_modes": tuple(eval_modes) or None,
        "evidence": None if evidence is None else evidence == "on",
        "concurrency": concurrency,
        "rollout_timeout_s": rollout_timeout,
        "timeout_s": timeout,
        "track": track,
    }
    if resume is None:
        given["engine"], given["progress"] = engine, not no_progress
    else:  # a resumed run keeps its recorded engine; a flag given here that differs is refused by name
        given["progress"] = not no_progress
    run_demo(resume=resume, **{k: v for k, v in given.items() if v is not None})


# ---- eval --------------------------------------------------------------------------------------------------------
@click.command("eval")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="Model directory (HF format: `clawstream model init`/`model sft`, or a demo run's exported final model).",
)
@click.option(
    "--harness",
    "harnesses",
    multiple=True,
    default=("agentloop", "agentloop-anthropic"),
    show_default=True,
    help="Harness to evaluate (repeat for several; `clawstream harness list`).",
)
@click.option(
    "--suite",
    default="builtin:cpu",
    show_default=True,
    help="Suite spec: builtin:cpu | native:DIR | clawgym:DIR | pinchbench:DIR.",
)
@click.option("--split", default="heldout", show_default=True, help="Split of the suite to run.")
@click.option(
    "--tasks",
    type=int,
    default=256,
    show_default=True,
    help="Tasks (prompts) per harness and mode; 0 = the whole split. builtin:cpu beyond its 48 held-out "
    "tasks uses the warm start's extended held-out split (never in the SFT data up to 256).",
)
@click.option(
    "--mode",
    "modes",
    multiple=True,
    type=click.Choice(["greedy", "sampled"]),
    default=("greedy", "sampled"),
    show_default=True,
    help="Decoding: greedy (temperature 0), sampled.",
)
@click.option("--temperature", type=float, default=1.0, show_default=True, help="Sampled mode's temperature.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="Generation cap per model call.")
@click.option(
    "--sampling-seed",
    type=int,
    default=0,
    show_default=True,
    help="Base of the per-rollout sampling seeds (one per task × harness × mode × sample): two evaluations with one "
    "base draw the same noise, so the paired difference of two models is theirs.",
)
@click.option("--unseeded", is_flag=True, help="Sample without seeds (every evaluation draws afresh).")
@click.option(
    "--rollout-timeout",
    type=float,
    default=None,
    help="Seconds per rollout instead of each task's own (a real harness on few cores: e.g. 300).",
)
@click.option("--concurrency", type=int, default=12, show_default=True, help="Rollouts at once.")
@click.option(
    "--engine",
    type=click.Choice(["cpu", "vllm"]),
    default="cpu",
    show_default=True,
    help="Inference engine serving the model.",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Also write the result (rows, config, seconds) as JSON here.",
)
def eval_command(
    model_dir: Path,
    harnesses: tuple[str, ...],
    suite: str,
    split: str,
    tasks: int,
    modes: tuple[str, ...],
    temperature: float,
    max_tokens: int,
    sampling_seed: int,
    unseeded: bool,
    rollout_timeout: float | None,
    concurrency: int,
    engine: str,
    json_out: Path | None,
) -> None:
    """Held-out score of a model per harness, greedy and sampled: mean reward ± standard error, solved fraction, n.

    Starts the inference engine, serving proxy and sandbox worker for the model (on the broker the demo uses:
    CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS, else the local one, started if needed), runs every task through each harness,
    grades it with the task's grader and prints one table per mode. `clawstream schedule --eval` does the same
    against services already running.
    """
    from clawstream.stack.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(
        harnesses=tuple(harnesses),
        suite=suite,
        split=split,
        tasks=tasks,
        modes=tuple(modes),
        temperature=temperature,
        max_tokens=max_tokens,
        concurrency=concurrency,
        engine=engine,
        sampling_seed=None if unseeded else sampling_seed,
        rollout_timeout_s=rollout_timeout,
    )
    sigterm_interrupts()  # `kill` stops the evaluation's services too, as Ctrl-C does
    result = run_eval(model_dir, cfg)
    click.echo(result.table)
    click.echo(f"({result.seconds:.0f} s)")
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_json(), indent=2) + "\n")


# ---- demo-seeds --------------------------------------------------------------------------------------------------
@click.command("demo-seeds")
@click.argument("runs", nargs=-1, required=True)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    default=Path("."),
    show_default=True,
    help="Directory for seeds.md and seeds.png.",
)
def demo_seeds(runs: tuple[str, ...], out: Path) -> None:
    """Finished demo runs side by side (e.g. three seeds): per harness and mode each run's held-out before -> after,
    gain +/- paired s.e. and the mean gain over the runs; each run's command; a plot (OUT/seeds.md, OUT/seeds.png).

    RUNS are run names under $CLAWSTREAM_HOME/demo/ or run directories.
    """
    from clawbase.settings import clawstream_home
    from clawstream.demo import seeds

    loaded = []
    for name in runs:
        path = Path(name) if Path(name).is_dir() else clawstream_home() / "demo" / name
        loaded.append(seeds.load_run(path))
    out.mkdir(parents=True, exist_ok=True)
    text = seeds.report(loaded)
    (out / "seeds.md").write_text(text + "\n")
    seeds.plot(out / "seeds.png", loaded)
    click.echo(text)
    click.echo(f"(written: {out / 'seeds.md'}, {out / 'seeds.png'})")


# ---- chaos -------------------------------------------------------------------------------------------------------
@click.command("chaos")
@click.option(
    "--kill",
    "kill",
    default="learner,proxy,streams,sandbox,scheduler,broker",
    show_default=True,
    metavar="S1,S2,...",
    help="Services to SIGKILL at random: learner, proxy, streams, sandbox, scheduler, broker, engine.",
)
@click.option("--for", "duration", default=None, metavar="DURATION", help="Run this long, e.g. 30m, 90s, 1h.")
@click.option("--kills", type=click.IntRange(min=1), default=None, help="Stop after this many kills.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the victims, their moments, the run.")
@click.option(
    "--engine",
    type=click.Choice(["cpu", "instant"]),
    default="cpu",
    show_default=True,
    help="cpu: the CPU engine on the shipped warm start; instant: the soak's instant engine (bench.soak_engine).",
)
@click.option("--work", type=click.Path(path_type=Path, file_okay=False), default=None, help="Logs, cluster, run.")
@click.option("--json", "json_out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Summary.")
def chaos(
    kill: str, duration: str | None, kills: int | None, seed: int, engine: str, work: Path | None, json_out: Path | None
) -> None:
    """The CPU training stack on a 3-broker cluster, its services SIGKILLed at random while data flows, each kill
    placed by the run's state and followed by a restart; then the audit. Exits 1 unless the audit is CLEAN."""
    from clawstream.stack.chaos import ChaosConfig, parse_duration, run_chaos

    names = tuple(name.strip() for name in kill.split(",") if name.strip())
    seconds = parse_duration(duration) if duration else None
    cfg = ChaosConfig(kill=names, seconds=seconds, kills=kills, seed=seed, engine=engine, work=work)
    sigterm_interrupts()  # `kill` stops the run's services and cluster too, as Ctrl-C does
    result = run_chaos(cfg, say=lambda line: print(line, flush=True), json_out=json_out)
    raise SystemExit(0 if result.clean else 1)
