"""Inference: a CPU engine that speaks vLLM's completions protocol, and the worker that keeps an engine (ours or a
real vLLM server) on the newest weight version.

Modules: ``engine`` (continuous batching with a KV cache, weight swaps between decode steps), ``kv_batch``,
``sampling``, ``protocol`` (request validation, vLLM-shaped responses and errors), ``server`` (the HTTP worker),
``weight_follower`` (follow ``clawstream.weights``, verify, apply, report), ``vllm_adapter`` (apply versions to a
running vLLM server), ``vllm_server`` (install real vLLM on CPU in its own venv and start it; ``vllm_worker`` runs
inside that server), ``metrics`` (the engine's Prometheus ``/metrics`` and "inference_stats" values), ``telemetry``
(NVML readings).

Topics: ``clawstream.weights`` in → ``clawstream.metrics``, ``clawstream.deadletter`` out; HTTP
(``/v1/completions``) for the proxy.
Run: ``clawstream infer --model DIR --port N`` or ``python -m consumers.inference``.
"""
