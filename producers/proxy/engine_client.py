"""The proxy's inference engine client: prompt token ids → ``POST {engine_url}/v1/completions`` → :class:`EngineReply`.

The engine speaks the vLLM subset (token-id prompt, logprobs, return_token_ids). Besides tokens, log-probs, finish
reason and policy version, the proxy takes the cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``:
our CPU engine always, vLLM when started with ``--enable-prompt-tokens-details``) and the GPU readings (top-level
``engine_telemetry``: our CPU engine on a GPU with NVML); missing or malformed extras are ``None``. A failure is an
:class:`~producers.proxy.emit.ApiError`: 400 when the engine answered 4xx, else 502.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from producers.proxy.emit import ApiError


@dataclass(frozen=True)
class EngineReply:
    """What the proxy takes from the engine's ``/v1/completions`` answer (its first choice)."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str  # "stop" | "length"
    policy_version: int
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    gpu_utilization: float | None = None  # engine_telemetry.gpu_utilization (percent); None: not reported
    gpu_memory_used_bytes: int | None = None  # engine_telemetry.gpu_memory_used_bytes; None: not reported


class EngineClient:
    """One HTTP session to the engine (opened on the app's startup, closed on its cleanup)."""

    def __init__(self, engine_url: str, model: str, timeout_s: float, stop_token_id: int) -> None:
        self.engine_url, self.model, self.timeout_s, self.stop_token_id = engine_url, model, timeout_s, stop_token_id
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(
        self,
        prompt: list[int],
        max_tokens: int,
        *,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
    ) -> EngineReply:
        """Generate up to ``max_tokens`` after ``prompt``, sampled with the rollout's settings (top_k 0 = off)."""
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stop_token_ids": [self.stop_token_id],
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if top_k > 0:
            payload["top_k"] = top_k
        if seed is not None:
            payload["seed"] = seed
        assert self.session is not None
        url = self.engine_url.rstrip("/") + "/v1/completions"
        try:
            async with self.session.post(url, json=payload) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    status = 400 if 400 <= resp.status < 500 else 502
                    raise ApiError(status, f"inference engine answered {resp.status}: {text[:300]}")
                data = json.loads(text)
                header_version = resp.headers.get("X-Policy-Version")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise ApiError(502, f"inference engine unavailable at {self.engine_url}: {exc!r}") from exc
        return engine_reply(data, header_version)


def _optional(value: Any, kind: type[int] | type[float]) -> Any:
    """A reported number as ``kind``, or ``None`` when absent, null or not a number (extras never fail a call)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return None
    return kind(value)


def engine_reply(data: Any, header_version: str | None = None) -> EngineReply:
    """Read the engine's answer: tokens, log-probs, finish reason and version (missing → :class:`ApiError` 502),
    plus the optional cached prompt tokens and GPU readings (missing or malformed → ``None``)."""
    try:
        choice = data["choices"][0]
        gen = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        finish = str(choice.get("finish_reason") or "stop")
        version = int(data.get("policy_version", header_version or 0))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ApiError(502, f"inference engine sent an unexpected answer: {exc!r}") from exc
    if len(logprobs) != len(gen):
        raise ApiError(502, f"inference engine sent {len(logprobs)} logprobs for {len(gen)} tokens")
    usage = data.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    telemetry = data.get("engine_telemetry")
    telemetry = telemetry if isinstance(telemetry, dict) else {}
    return EngineReply(
        gen,
        logprobs,
        "length" if finish == "length" else "stop",
        version,
        cached_tokens=_optional(details.get("cached_tokens"), int) if isinstance(details, dict) else None,
        gpu_utilization=_optional(telemetry.get("gpu_utilization"), float),
        gpu_memory_used_bytes=_optional(telemetry.get("gpu_memory_used_bytes"), int),
    )
