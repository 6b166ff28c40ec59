"""Serving proxy: the model-serving boundary between real harnesses and the inference engine.

Purpose: speak Anthropic Messages, OpenAI Chat and OpenAI Responses to the harness (streaming and not), render
each request to prompt token ids token-in-token-out (``render``), call the engine with vLLM's completions
protocol, parse the finished turn (``tool_parse``) and answer in the caller's dialect (``emit``), and record every
call as a call event (``call_event``). Modules: ``app`` (the two aiohttp apps: model calls; admin API on its own
listener), ``settings``, ``admin`` (rollouts, admin API), ``quota`` (per-rollout quotas), ``engine_client``,
``engine_pool`` and ``router`` (several engines: cache-affine placement, failover),
``dialects`` (request side: ``PARSERS``), ``emit`` (response side: ``EMITTERS``), ``conversation``, ``render``,
``tool_parse``, ``call_event``, ``metrics``, ``registry`` (registrations on Kafka) and ``restore`` (rebuilding them
after a restart).

Topics: HTTP from harnesses in → ``clawstream.calls`` out; ``clawstream.proxy.registrations`` out, read back at
start.
Run: ``clawstream proxy --model DIR --engine-url URL [--engine-url URL ...] --port N [--engine-model NAME]`` or
``python -m producers.proxy`` (the engine model defaults to ``policy``, the name ``clawstream infer`` serves).
"""
