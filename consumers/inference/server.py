"""Inference worker: serves the policy over vLLM's OpenAI-compatible API and follows published weight versions.

Topics: ``clawstream.weights`` (``WeightVersion``) in → ``clawstream.metrics`` (``Metric`` "weights_applied" on
every switch, "inference_stats" every ``metrics_interval_s``) and ``clawstream.deadletter`` (rejected versions) out.

Two engines: ``cpu`` (default; a Hugging Face causal LM in this process behind the scheduler of
``consumers.inference.engine``; HTTP ``POST /v1/completions`` (``consumers.inference.protocol``), ``GET /v1/models``,
``GET /health``, ``GET /metrics``; new versions swapped in between decode steps by
``consumers.inference.weight_follower``) and ``vllm`` (no completions here: each version is applied to the vLLM
server at ``--engine-url`` by ``consumers.inference.vllm_adapter``; ``GET /health`` only). Every HTTP response
carries the ``X-Policy-Version`` header. The served model name is ``policy`` unless ``--served-model-name`` says
otherwise (the CPU engine also answers to its model directory's name). Following weights, the port opens once the
newest published version is applied (at most ``catch_up_timeout_s``): a restarted engine never answers with version 0
mid-run. Fault point ``engine.in_call``: a completion request read, not yet generated. Details:
docs/inference.md#the-inference-worker.

Run (the ``clawstream infer`` command calls :func:`main`)::

    HF_HUB_OFFLINE=1 python -m consumers.inference.server --model models/tiny --port 8100   # serves 'policy'
    python -m consumers.inference.server --model models/tiny --port 8100 --no-weights     # no Kafka at all
    python -m consumers.inference.server --engine vllm --engine-url http://gpu-host:8000  # vLLM serving 'policy'

Configuration: :class:`~consumers.inference.settings.InferenceWorkerSettings` (environment ``CLAWSTREAM_INFER_*``;
flags override), Kafka from ``CLAWSTREAM_KAFKA_*`` (``clawbase.settings.KafkaSettings``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from aiohttp import web

from clawbase.errors import ClawstreamError, ConfigError
from clawbase.faults import fault_point
from clawbase.kafka.clients import check_broker
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from consumers.inference.metrics import EngineMetrics, ServedCounters, stats_values
from consumers.inference.protocol import (
    ProtocolError,
    cached_prompt_tokens,
    completion_response,
    error_body,
    models_response,
    parse_completion_request,
)
from consumers.inference.settings import InferenceWorkerSettings
from consumers.inference.telemetry import engine_telemetry, gpu_readings, gpu_uuids, nvml_index
from policy import DEFAULT_MODEL_NAME

# Everything is loaded from local files; never let transformers try to reach the (unreachable) hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

log = logging.getLogger("consumers.inference.server")

POLICY_HEADER = "X-Policy-Version"


# ---- HTTP ------------------------------------------------------------------------------------------------------
class CompletionServer:
    """The aiohttp handlers of the CPU engine."""

    def __init__(self, settings: InferenceWorkerSettings, engine: Any, tokenizer: Any, max_model_len: int) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.name = settings.name()
        self.aliases = settings.aliases()
        self.created = int(time.time())
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self.served = ServedCounters()
        self.gpu_index = nvml_index(
            settings.device,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            gpu_uuids() if settings.device.startswith("cuda") else (),
        )
        self.metrics = EngineMetrics(engine, self.served, gpu_readings)

    def telemetry(self) -> dict[str, Any] | None:
        """The engine GPU's readings now (``engine_telemetry`` of a response); ``None`` on the CPU or without NVML."""
        return None if self.gpu_index is None else engine_telemetry(gpu_readings(), self.gpu_index)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    async def completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"invalid JSON body: {exc}") from exc
        parsed = parse_completion_request(
            body,
            served_model_name=self.name,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.max_model_len,
            encode=self._encode,
            max_logprobs=self.settings.max_logprobs,
            aliases=self.aliases,
        )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def deliver(outcome: Any) -> None:  # scheduler thread → event loop
            loop.call_soon_threadsafe(lambda: None if future.done() else future.set_result(outcome))

        # Fault point: the request is read and checked, nothing of it generated or answered. A hold here blocks the
        # event loop (no other request is answered either) until released: meant for a kill -9 of a busy engine.
        fault_point("engine.in_call")
        request_id = self.engine.submit(parsed.prompts, parsed.params, deliver)
        try:
            outcome = await future
        except asyncio.CancelledError:  # client went away (handler_cancellation): stop spending tokens on it
            self.engine.abort(request_id)
            log.info("client went away: aborted %s", request_id)
            raise
        if isinstance(outcome, BaseException):
            log.error("request %s failed: %s", request_id, outcome)
            body = error_body(f"generation failed: {outcome}", status=500, err_type="InternalServerError")
            return web.json_response(body, status=500)
        payload = completion_response(
            outcome, parsed, decode=self._decode, token_text=self.token_text, engine_telemetry=self.telemetry()
        )
        self.served.record(payload["usage"]["prompt_tokens"], cached_prompt_tokens(outcome))
        return web.json_response(payload, headers={POLICY_HEADER: str(outcome.policy_version)})

    async def models(self, request: web.Request) -> web.Response:
        root = str(self.settings.model) if self.settings.model else self.name
        return web.json_response(models_response(self.name, root, self.max_model_len, self.created, self.aliases))

    async def prometheus(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)  # vLLM answers 200 with an empty body


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ProtocolError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body(str(exc), status=500, err_type="InternalServerError"), status=500)


def build_app(current_version: Any, server: CompletionServer | None = None) -> web.Application:
    """The worker's aiohttp app; ``current_version()`` fills ``X-Policy-Version`` where no result set it."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)

    async def stamp(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.setdefault(POLICY_HEADER, str(current_version()))

    app.on_response_prepare.append(stamp)
    app.router.add_get("/health", _health)
    if server is not None:
        app.router.add_post("/v1/completions", server.completions)
        app.router.add_get("/v1/models", server.models)
        app.router.add_get("/metrics", server.prometheus)
    return app


# ---- wiring ------------------------------------------------------------------------------------------------------
def load_policy(settings: InferenceWorkerSettings) -> tuple[Any, Any, list[int]]:
    """Model (eval, on ``settings.device``), tokenizer and eos token ids from the local model directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=getattr(torch, settings.dtype))
    model.to(settings.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    eos = model.generation_config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return model, tokenizer, eos_ids


async def _report_stats(reporter: Any, engine: Any, interval: float) -> None:
    last_stats, last_t = engine.stats(), time.monotonic()
    while True:
        await asyncio.sleep(interval)
        now, stats = time.monotonic(), engine.stats()
        values = {**stats_values(stats, last_stats, now - last_t), **gpu_readings()}
        last_stats, last_t = stats, now
        await asyncio.to_thread(reporter.metric, "inference_stats", engine.policy_version, values)


async def _caught_up(follower: Any, timeout_s: float, stop: asyncio.Event) -> bool:
    """Wait until ``follower`` applied the newest version published before it started (or found none), at most
    ``timeout_s``; returns whether it did. Ends early when ``stop`` is set."""
    deadline = time.monotonic() + timeout_s
    while not follower.caught_up.is_set():
        if stop.is_set() or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def serve(
    settings: InferenceWorkerSettings, kafka: KafkaSettings | None, stop: asyncio.Event | None = None
) -> None:
    """Run the worker until ``stop`` is set (or SIGINT/SIGTERM)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    engine = None
    if settings.engine == "cpu":
        from consumers.inference.engine import Engine
        from consumers.inference.weight_follower import EngineWeightsTarget

        model, tokenizer, eos_ids = await asyncio.to_thread(load_policy, settings)
        max_model_len = settings.max_model_len or int(getattr(model.config, "max_position_embeddings", 32768))
        engine = Engine(
            model,
            eos_token_ids=eos_ids,
            policy_version=settings.policy_version,
            max_batch_size=settings.max_batch_size,
            max_prefill_tokens=settings.max_prefill_tokens,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            prefix_cache_bytes=int(settings.prefix_cache_gib * (1 << 30)),
            prefix_block_size=settings.prefix_block_size,
            logprobs_mode=settings.logprobs_mode,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
        engine.start()
        target: Any = EngineWeightsTarget(engine)
        app = build_app(lambda: engine.policy_version, CompletionServer(settings, engine, tokenizer, max_model_len))
    else:
        from consumers.inference.vllm_adapter import VllmWeightsTarget

        target = VllmWeightsTarget(
            settings.engine_url or "",
            policy_version=settings.policy_version,
            timeout_s=settings.vllm_timeout_s,
            pause=settings.vllm_pause,
        )
        app = build_app(lambda: target.policy_version)

    follower = stats_task = None
    if kafka is not None:
        from consumers.inference.weight_follower import Reporter, WeightsFollower

        reporter = Reporter(kafka, f"inference-worker/{settings.worker_id}")
        follower = WeightsFollower(kafka, target, model_name=settings.name(), reporter=reporter)
        follower.start()
        if engine is not None and settings.metrics_interval_s > 0:
            stats_task = asyncio.create_task(_report_stats(reporter, engine, settings.metrics_interval_s))

    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    try:
        caught = follower is None or await _caught_up(follower, settings.catch_up_timeout_s, stop)
        if not caught and not stop.is_set():
            log.warning(
                "weights not caught up within catch_up_timeout_s=%g: serving version %d, still following",
                settings.catch_up_timeout_s,
                target.policy_version,
            )
        if stop.is_set():
            return
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        address = runner.addresses[0] if runner.addresses else (settings.host, settings.port)
        print(
            f"[infer] {settings.engine} engine serving '{settings.name()}' (policy version {target.policy_version}) "
            f"on http://{address[0]}:{address[1]}",
            flush=True,
        )
        await stop.wait()
    finally:
        if stats_task is not None:
            stats_task.cancel()
        await runner.cleanup()
        if follower is not None:
            await asyncio.to_thread(follower.stop)
        if engine is not None:
            await asyncio.to_thread(engine.stop)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m consumers.inference.server", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="local Hugging Face model directory (engine cpu)")
    p.add_argument(
        "--served-model-name",
        help=f"model name served and followed on clawstream.weights (default {DEFAULT_MODEL_NAME!r})",
    )
    p.add_argument("--engine", choices=["cpu", "vllm"])
    p.add_argument("--engine-url", help="vLLM server base URL (engine vllm)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--device", help="torch device (cpu, cuda, ...)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-model-len", type=int, help="longest prompt + completion (default: the model's positions)")
    p.add_argument("--max-prefill-tokens", type=int, help="token budget of one scheduler step (default 2048)")
    p.add_argument("--prefill-chunk-tokens", type=int, help="most tokens of one prompt per step (default 256)")
    p.add_argument("--prefix-cache-gib", type=float, help="memory for cached prompt KV blocks; 0: off (default 2)")
    p.add_argument("--policy-version", type=int, help="version of the weights in --model")
    p.add_argument("--logprobs-mode", choices=["processed_logprobs", "raw_logprobs"])
    p.add_argument("--worker-id")
    p.add_argument("--metrics-interval-s", type=float)
    p.add_argument("--no-weights", action="store_true", help="do not follow clawstream.weights (no Kafka needed)")
    add_kafka_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    namespace = _parser().parse_args(argv)
    args = {k: v for k, v in vars(namespace).items() if k not in ("bootstrap", "topic_prefix")}
    no_weights = args.pop("no_weights")
    overrides = {k: v for k, v in args.items() if v is not None}
    if no_weights:
        overrides["follow_weights"] = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(InferenceWorkerSettings, **overrides)
        kafka = None
        if settings.follow_weights:
            kafka = kafka_settings(namespace)
            check_broker(kafka)  # fail now (naming the address tried), not in the follower thread
    except ConfigError as exc:
        hint = " (or pass --no-weights to serve without following weight versions)" if "bootstrap" in str(exc) else ""
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(settings, kafka))
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
