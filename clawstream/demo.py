"""The CPU quickstart (``make demo`` / ``clawstream demo``): the whole training loop on one laptop-class machine.

1. start (or reuse) the local Apache Kafka broker and create the topic catalog under a fresh per-run prefix;
2. build the tiny Qwen3-architecture policy (once; cached) and, when available, its SFT warm start (once; cached);
3. start the services as separate processes, exactly as an operator would: inference engine (vLLM protocol),
   serving proxy, Faust stream processors, sandbox worker, learner;
4. run the scheduler for ``--steps`` training steps mixing two heterogeneous built-in harnesses (``agentloop`` over
   OpenAI Chat and ``agentloop-anthropic`` over Anthropic Messages) on the built-in CPU task suite;
5. follow ``clawstream.metrics`` and print, per step, the reward per harness, the loss and the new weight version
   that the engine then serves; finally stop everything. Logs: ``$CLAWSTREAM_HOME/demo/<run>/logs``.
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from pathlib import Path

from clawstream.errors import ClawstreamError
from clawstream.kafka.clients import bootstrap_servers, create_topics, make_consumer
from clawstream.kafka.local import LocalKafka
from clawstream.settings import KafkaSettings, clawstream_home, load_settings
from clawstream.stack import Service, Stack
from schemas.events import Metric
from schemas.topics import METRICS

HARNESS_MIX = {"agentloop": 1.0, "agentloop-anthropic": 1.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _say(message: str) -> None:
    print(message, flush=True)


def prepare_model(models: Path, *, sft_minutes: float) -> Path:
    """The tiny base model, warm-started by SFT when ``learner.warmstart.sft`` is available (both cached under
    ``models``)."""
    import shutil

    from policy.tiny_model import init_tiny_model, is_current

    base, warm = models / "tiny-qwen3", models / "tiny-qwen3-sft"
    if not is_current(base):  # missing, or built by an older builder (e.g. fewer positions): rebuild both
        shutil.rmtree(warm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        _say(f"==> building the tiny Qwen3-architecture model into {base}")
        init_tiny_model(base, seed=0, progress=lambda _msg: None)
    if sft_minutes <= 0:
        return base
    try:
        from learner.warmstart import sft
    except ImportError:
        _say("    (no SFT warm start in this build: RL starts from the random model, rewards stay near 0)")
        return base
    if not (warm / "config.json").exists():
        _say(f"==> SFT warm start on synthetic agent demonstrations ({sft_minutes:g} min, once) → {warm}")
        sft.main(["--model-dir", str(base), "--out", str(warm), "--minutes", str(sft_minutes)])
    return warm


def _start_engine(stack: Stack, engine: str, model: Path) -> str:
    """Start the inference engine; returns the URL the proxy calls.

    ``cpu``: the project's CPU engine, which also follows weight versions. ``vllm``: a real vLLM server
    (``clawstream vllm serve``; needs ``clawstream vllm install``) plus the inference worker in vLLM mode, which
    applies each weight version to it (``consumers/inference/vllm_adapter.py``).
    """
    if engine == "cpu":
        found = stack.start(Service("engine", ["consumers.inference.server", "--model", str(model), "--port", "0",
                                               "--max-batch-size", "16"],
                                    ready_line=r"on (http://\S+:\d+)"))  # fmt: skip
        return str(found.found)
    from consumers.inference.vllm_server import is_installed

    if not is_installed():
        raise ClawstreamError("--engine vllm needs vLLM installed once: `clawstream vllm install` (or `make vllm`)")
    vllm = stack.start(Service("vllm", ["clawstream", "vllm", "serve", "--model", str(model), "--port", "0",
                                        "--max-model-len", "16384"],
                               ready_line=r"vLLM ready at (http://\S+:\d+)/v1"), timeout=900)  # fmt: skip
    stack.start(Service("engine", ["consumers.inference.server", "--engine", "vllm", "--engine-url", str(vllm.found),
                                   "--port", "0"], ready_line=r"on (http://\S+:\d+)"))  # fmt: skip
    return str(vllm.found)


def run_demo(*, steps: int = 3, tasks_per_step: int = 4, group_size: int = 4, sft_minutes: float = 8.0,
             timeout_s: float = 1800.0, engine: str = "cpu") -> dict[str, object]:  # fmt: skip
    """Run the loop; returns what happened (topic prefix, per-step metrics, versions the engine applied)."""
    home = clawstream_home()
    run = time.strftime("%Y%m%d-%H%M%S")
    prefix = f"demo-{run}."
    settings = KafkaSettings()
    if not settings.bootstrap_servers:
        state = LocalKafka().up()
        settings = load_settings(KafkaSettings, bootstrap_servers=state.bootstrap, topic_prefix=prefix)
        _say(f"==> Apache Kafka on {state.bootstrap} (stop it later with `clawstream kafka down`)")
    else:
        settings = load_settings(KafkaSettings, bootstrap_servers=settings.bootstrap_servers, topic_prefix=prefix)
    create_topics(settings)
    _say(f"==> topics created under prefix '{prefix}'")
    model = prepare_model(home / "models", sft_minutes=sft_minutes)

    run_dir = home / "demo" / run
    token = secrets.token_urlsafe(16)
    proxy_port = _free_port()
    stack = Stack(run_dir / "logs", env={"CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(settings),
                                         "CLAWSTREAM_KAFKA_TOPIC_PREFIX": prefix})  # fmt: skip
    try:
        _say(f"==> starting services (logs in {run_dir / 'logs'})")
        engine_url = _start_engine(stack, engine, model)
        stack.start(Service("proxy", ["producers.proxy.app", "--model", str(model), "--engine-url", engine_url,
                                      "--port", str(proxy_port), "--admin-token", token],
                            ready_url=f"http://127.0.0.1:{proxy_port}/metrics"))  # fmt: skip
        stack.start(Service("streams", ["streams.app", "--datadir", str(run_dir / "faust"), "worker", "--loglevel",
                                        "warn"],
                            env={"CLAWSTREAM_STREAMS_APP_ID": f"{prefix}streams",
                                 "CLAWSTREAM_STREAMS_DATA_DIR": str(run_dir / "streams"),
                                 "CLAWSTREAM_STREAMS_GROUP_SIZE": str(group_size),
                                 "CLAWSTREAM_STREAMS_BATCH_GROUPS": str(tasks_per_step),
                                 "CLAWSTREAM_STREAMS_ZERO_VARIANCE": "keep",
                                 "CLAWSTREAM_STREAMS_GROUP_TIMEOUT_S": "300",
                                 "CLAWSTREAM_STREAMS_SETTLE_INTERVAL_S": "1"}))  # fmt: skip
        stack.start(Service("sandbox-worker", ["producers.sandbox.worker", "--concurrency", "4", "--proxy-url",
                                               f"http://127.0.0.1:{proxy_port}", "--proxy-admin-token", token,
                                               "--group-id", f"{prefix}sandbox-workers"]))  # fmt: skip
        stack.start(Service("learner", ["learner.train", "--model-dir", str(model), "--weight-store",
                                        str(run_dir / "weights"), "--model-name", "policy", "--hp", "lr=2e-5",
                                        "--tensorboard-dir", str(run_dir / "tensorboard")]))  # fmt: skip
        stack.start(Service("scheduler", ["producers.scheduler.service", "--steps", str(steps)],
                            env={"CLAWSTREAM_SCHEDULER_TASKS_PER_STEP": str(tasks_per_step),
                                 "CLAWSTREAM_SCHEDULER_GROUP_SIZE": str(group_size),
                                 "CLAWSTREAM_SCHEDULER_HARNESS_MIX": json.dumps(HARNESS_MIX),
                                 "CLAWSTREAM_SCHEDULER_MAX_TOKENS": "256",
                                 "CLAWSTREAM_SCHEDULER_MAX_POLICY_LAG": "1",
                                 "CLAWSTREAM_SCHEDULER_DRAIN_TIMEOUT_S": "120"},
                            may_finish=True))  # fmt: skip
        _say(f"==> training {steps} steps: {tasks_per_step} tasks x {group_size} rollouts, harnesses "
             f"{' + '.join(HARNESS_MIX)}")  # fmt: skip
        trained, applied = _follow(settings, stack, steps, timeout_s)
    finally:
        _say("==> stopping services")
        stack.stop()
    return {"prefix": prefix, "run_dir": str(run_dir), "trained": trained, "applied": applied}


def _follow(settings: KafkaSettings, stack: Stack, steps: int, timeout_s: float) -> tuple[list[Metric], list[int]]:
    consumer = make_consumer(settings, f"{settings.topic_prefix}demo-follow")
    consumer.subscribe([settings.topic(METRICS)])
    deadline = time.monotonic() + timeout_s
    trained: list[Metric] = []
    applied: list[int] = []
    started = time.monotonic()
    try:
        while len(trained) < steps or len(applied) < steps:
            if time.monotonic() > deadline:
                raise ClawstreamError(f"the demo did not finish {steps} steps within {timeout_s:.0f}s; see the logs")
            stack.check()
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            metric = Metric.from_bytes(msg.value())
            elapsed = time.monotonic() - started
            if metric.name == "train_step":
                trained.append(metric)
                rewards = "  ".join(f"{k.removeprefix('reward/')}={v:.2f}" for k, v in sorted(metric.values.items())
                                    if k.startswith("reward/") and k != "reward/mean")  # fmt: skip
                _say(f"[{elapsed:6.0f}s] step {metric.step}: reward {rewards}  loss {metric.values.get('loss', 0):.4f}"
                     f"  tokens {metric.values.get('tokens', 0):.0f}  → weights v{metric.policy_version}")  # fmt: skip
            elif metric.name == "weights_applied":
                applied.append(metric.policy_version)
                _say(f"[{elapsed:6.0f}s] engine now serves v{metric.policy_version} "
                     f"(swap {metric.values.get('swap_latency_s', 0) * 1000:.0f} ms)")  # fmt: skip
    finally:
        consumer.close()
    return trained, applied
