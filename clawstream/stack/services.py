"""How each clawstream service is started as a child process, and the Kafka set-up of a run (broker, topic prefix).

Every service is the ``python -m …`` entry point an operator would run by hand, configured through its flags and
``CLAWSTREAM_*`` environment; the stack's environment carries the broker address and the run's topic prefix, so
runs sharing one broker never see each other's records. Used by the quickstart (``clawstream.demo``) and by
``clawstream eval`` (``clawstream.stack.evaluate``).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import bootstrap_servers, create_topics
from clawbase.settings import KafkaSettings, load_settings
from clawstream.local_kafka import LocalKafka
from clawstream.stack.process import Service, Stack
from learner.attempts import DEATHS
from schemas.topics import CATALOG


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_kafka(prefix: str, say: Callable[[str], None] = print) -> KafkaSettings:
    """Kafka settings of a run under ``prefix`` (its topics created): ``CLAWSTREAM_KAFKA_*`` when a bootstrap is set
    there, else the local broker of ``clawstream kafka up``, started if it is not running."""
    settings = KafkaSettings()
    if not settings.bootstrap_servers:
        state = LocalKafka().up()
        say(f"==> Apache Kafka on {state.bootstrap} (stop it later with `clawstream kafka down`)")
        settings = load_settings(KafkaSettings, bootstrap_servers=state.bootstrap, topic_prefix=prefix)
    else:
        settings = load_settings(KafkaSettings, bootstrap_servers=settings.bootstrap_servers, topic_prefix=prefix)
    create_topics(settings, CATALOG)
    return settings


def stack_for(kafka: KafkaSettings, log_dir: Path) -> Stack:
    """A stack whose services talk to ``kafka``'s broker under its topic prefix."""
    return Stack(
        log_dir,
        env={
            "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(kafka),
            "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
        },
    )


def start_engine(
    stack: Stack, engine: str, model: Path, *, max_batch_size: int = 16, torch_threads: int | None = None
) -> str:
    """Start the inference engine; returns the URL the proxy calls.

    ``cpu``: the project's CPU engine, which also follows weight versions (``torch_threads``: its intra-op threads,
    default all cores). ``vllm``: a real vLLM server
    (``clawstream vllm serve``; needs ``clawstream vllm install``) plus the inference worker in vLLM mode, which
    applies each weight version to it (``consumers/inference/vllm_adapter.py``).
    """
    if engine == "cpu":
        threads = {"CLAWSTREAM_INFER_TORCH_THREADS": str(torch_threads)} if torch_threads else {}
        found = stack.start(
            Service(
                "engine",
                [
                    "consumers.inference.server",
                    "--model",
                    str(model),
                    "--port",
                    str(free_port()),  # fixed: a restarted engine answers where the proxy calls it
                    "--max-batch-size",
                    str(max_batch_size),
                ],
                env=threads,
                ready_line=r"on (http://\S+:\d+)",
                restart=True,
            )
        )
        return str(found.found)
    if engine != "vllm":
        raise ClawstreamError(f"unknown engine {engine!r}: cpu or vllm")
    from consumers.inference.vllm_server import is_installed

    if not is_installed():
        raise ClawstreamError("--engine vllm needs vLLM installed once: `clawstream vllm install` (or `make vllm`)")
    vllm = stack.start(
        Service(
            "vllm",
            ["clawstream", "vllm", "serve", "--model", str(model), "--port", str(free_port())]
            + ["--max-model-len", "16384"],
            ready_line=r"vLLM ready at (http://\S+:\d+)/v1",
            restart=True,
        ),
        timeout=900,
    )
    stack.start(
        Service(
            "engine",
            ["consumers.inference.server", "--engine", "vllm", "--engine-url", str(vllm.found), "--port", "0"],
            ready_line=r"on (http://\S+:\d+)",
            restart=True,
        )
    )
    return str(vllm.found)


@dataclass(frozen=True)
class RolloutSide:
    """Where the rollout side of a running stack answers: the engine, and the proxy harnesses talk to."""

    engine_url: str
    proxy_url: str  # the harness-facing listener
    admin_token: str
    admin_url: str = ""  # the proxy's admin listener (admin API, /metrics)


def start_rollout_side(
    stack: Stack,
    model: Path,
    *,
    engine: str = "cpu",
    concurrency: int = 4,
    suites: dict[str, str] | None = None,
    max_batch_size: int = 16,
    torch_threads: int | None = None,
    engine_url: str | None = None,
    task_timeout_s: float | None = None,
) -> RolloutSide:
    """Engine, serving proxy and sandbox worker: everything a rollout request needs to become a reward.

    ``suites`` (name → spec) is what the sandbox worker resolves tasks in (default: its own, ``builtin:cpu``).
    ``engine_url``: an engine already answering there (``bench.soak``'s instant engine): none is started.
    ``task_timeout_s``: every task's rollout timeout instead of its own (the sandbox worker's ``task_timeout_s``)."""
    if engine_url is None:
        engine_url = start_engine(stack, engine, model, max_batch_size=max_batch_size, torch_threads=torch_threads)
    token, port, admin_port = secrets.token_hex(16), free_port(), free_port()  # hex: never read as a flag
    proxy_url, admin_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    stack.start(
        Service(
            "proxy",
            [
                "producers.proxy.app",
                "--model",
                str(model),
                "--engine-url",
                engine_url,
                "--port",
                str(port),
                "--admin-port",  # the admin API on its own listener, which rollouts are not given
                str(admin_port),
            ],
            env={"CLAWSTREAM_PROXY_ADMIN_TOKEN": token},  # never on a command line: /proc/*/cmdline is world-readable
            ready_url=f"{admin_url}/metrics",  # the admin listener opens after the harness-facing one
            restart=True,
        )
    )
    env = {"CLAWSTREAM_SANDBOX_PROXY_ADMIN_TOKEN": token}
    if suites:
        env["CLAWSTREAM_SANDBOX_SUITES"] = json.dumps(suites)
    if task_timeout_s is not None:
        env["CLAWSTREAM_SANDBOX_TASK_TIMEOUT_S"] = str(task_timeout_s)
    prefix = stack.env.get("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "")
    stack.start(
        Service(
            "sandbox-worker",
            [
                "producers.sandbox.worker",
                "--concurrency",
                str(concurrency),
                "--proxy-url",
                admin_url,
                "--group-id",
                f"{prefix}sandbox-workers",
            ],
            env=env,
            restart=True,
        )
    )
    return RolloutSide(engine_url, proxy_url, token, admin_url)


def start_streams(
    stack: Stack,
    run_dir: Path,
    *,
    group_size: int,
    batch_groups: int,
    settle_interval_s: float,
    harness_mix: dict[str, float] | None = None,
    group_timeout_s: float = 300.0,
    zero_variance: str = "drop",
    loglevel: str = "warn",
) -> Service:
    """The Faust stream processors (assembler → grouper → batcher), RocksDB state under ``run_dir``.

    ``zero_variance``: ``"drop"`` (the streams' own default) trains no group whose rewards are all equal; give the
    scheduler the same value (its ``zero_variance`` setting), so that it issues refills for them and batches still
    fill. ``"keep"`` trains them at advantage 0.

    ``harness_mix``: the batcher fills each batch toward these shares (it waits for a missing harness's group unless
    a backlog builds up); without it a batch takes whichever groups closed first."""
    prefix = stack.env.get("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "")
    (run_dir / "streams").mkdir(parents=True, exist_ok=True)  # Faust creates its data dir, not the parents
    mix = {"CLAWSTREAM_STREAMS_HARNESS_MIX": json.dumps(harness_mix)} if harness_mix else {}
    return stack.start(
        Service(
            "streams",
            ["streams.app", "--datadir", str(run_dir / "faust"), "worker", "--loglevel", loglevel],
            env={
                **mix,
                "CLAWSTREAM_STREAMS_APP_ID": f"{prefix}streams",
                "CLAWSTREAM_STREAMS_DATA_DIR": str(run_dir / "streams"),
                "CLAWSTREAM_STREAMS_GROUP_SIZE": str(group_size),
                "CLAWSTREAM_STREAMS_BATCH_GROUPS": str(batch_groups),
                "CLAWSTREAM_STREAMS_ZERO_VARIANCE": zero_variance,
                "CLAWSTREAM_STREAMS_GROUP_TIMEOUT_S": str(group_timeout_s),
                "CLAWSTREAM_STREAMS_SETTLE_INTERVAL_S": str(settle_interval_s),
            },
            restart=True,
        )
    )


def start_learner(
    stack: Stack, model: Path, run_dir: Path, hparams: dict[str, object], torch_threads: int | None = None
) -> Service:
    """The learner: weights under ``run_dir/weights``, TensorBoard scalars under ``run_dir/tensorboard``."""
    hp = [arg for name, value in hparams.items() for arg in ("--hp", f"{name}={value}")]
    threads = {"CLAWSTREAM_LEARNER_TORCH_THREADS": str(torch_threads)} if torch_threads else {}
    return stack.start(
        Service(
            "learner",
            [
                "learner.train",
                "--model-dir",
                str(model),
                "--weight-store",
                str(run_dir / "weights"),
                "--model-name",
                "policy",
                "--tensorboard-dir",
                str(run_dir / "tensorboard"),
                *hp,
            ],
            env=threads,
            restart=True,
            deaths=run_dir / "weights" / "policy" / "trainer-state" / DEATHS,  # out-of-memory verdicts (process.py)
        )
    )


def start_scheduler(stack: Stack, steps: int, settings: dict[str, object]) -> Service:
    """The scheduler in train mode for ``steps`` steps; ``settings`` are ``SchedulerSettings`` fields."""
    env = {f"CLAWSTREAM_SCHEDULER_{k.upper()}": v if isinstance(v, str) else json.dumps(v) for k, v in settings.items()}
    return stack.start(
        Service(
            "scheduler",
            ["producers.scheduler.service", "--steps", str(steps)],
            env=env,
            may_finish=True,
            restart=True,  # train mode resumes from the log (nothing issued twice)
        )
    )


def start_dashboard(stack: Stack, port: int = 0) -> str:
    """The live dashboard over the run's topics (``clawstream dashboard``); returns its URL."""
    found = stack.start(
        Service(
            "dashboard",
            ["consumers.analytics.dashboard", "--port", str(port)],
            ready_line=r"dashboard on (http://\S+/)",
        )
    ).found
    if found is None:
        raise ClawstreamError("the dashboard started but never said where it listens")
    return found


def tracker_args(mlflow_uri: str, run_dir: Path, model: Path) -> list[str]:
    """``python -m consumers.tracker`` for a demo run: its config as params, its tokenizer for the trajectories."""
    return ["consumers.tracker", "--mlflow", mlflow_uri, "--run-dir", str(run_dir), "--model", str(model)]


def start_tracker(stack: Stack, mlflow_uri: str, run_dir: Path, model: Path) -> Service:
    """The MLflow tracker beside the run (``clawstream track``); restarted when it dies, it logs nothing twice."""
    return stack.start(
        Service("tracker", tracker_args(mlflow_uri, run_dir, model), ready_line=r"into MLflow run (\w+)", restart=True)
    )


def track_to_end(stack: Stack, mlflow_uri: str, run_dir: Path, model: Path, timeout: float = 600.0) -> int:
    """After the run: the tracker reads the topics to their end, logs the report files of ``run_dir`` (the
    before/after table, the plot) and ends the MLflow run; its exit status."""
    env = {**os.environ, **stack.env}
    log = run_dir / "logs" / "tracker-final.log"
    with log.open("ab") as out:
        cmd = [sys.executable, "-m", *tracker_args(mlflow_uri, run_dir, model), "--once"]
        try:
            return subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:  # killed by run(): the live tracker's writes stay; nothing is logged twice
            return -1
