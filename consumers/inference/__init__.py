"""Inference: a CPU engine that speaks vLLM's completions protocol, and the worker that keeps an engine (ours or a
real vLLM server) on the newest weight version.

Modules: ``engine`` (the continuous-batching scheduler: admission, chunked prefill, decode, weight swaps between
steps), ``sequences`` (the engine's per-sequence state; sampling, stop checks and caching per row), ``kv_batch`` (the
left-padded decode batch and its growing KV cache), ``prefix_cache`` (automatic prefix caching in KV blocks),
``generation`` (sampling params, results, weight swaps: the engine's inputs and outputs), ``protocol`` (request
validation, vLLM-shaped responses and errors), ``server`` (the HTTP worker), ``weight_follower`` (follow
``clawstream.weights``, verify, apply, report), ``vllm_adapter`` (apply versions to a running vLLM server),
``vllm_server`` (install real vLLM on CPU in its own venv and start it; ``vllm_worker/`` runs inside that server),
``metrics`` (the engine's Prometheus ``/metrics`` and "inference_stats" values), ``telemetry`` (NVML readings).
The sampling maths is ``policy.sampling``.

Topics: ``clawstream.weights`` in → ``clawstream.metrics``, ``clawstream.deadletter`` out; HTTP
(``/v1/completions``) for the proxy.
Run: ``clawstream infer --model DIR --port N`` or ``python -m consumers.inference``.
"""
