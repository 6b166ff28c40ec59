"""The proxy's inference engine client: prompt token ids → ``POST {engine_url}/v1/completions`` → :class:`EngineReply`.

The engine speaks the vLLM subset (token-id prompt, logprobs, return_token_ids). Besides tokens, log-probs, finish
reason and policy version, the proxy takes the cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``:
our CPU engine always, vLLM when started with ``--enable-prompt-tokens-details``) and the GPU readings (top-level
``engine_telemetry``: our CPU engine on a GPU with NVML); missing or malformed extras are ``None``.

An engine that is away (connection refused or timed out, reset, disconnected mid-call, or answering 503 while it
loads) is asked again, the same payload (prompt, sampling settings, seed), after a backoff doubling from 0.2 s to
2 s, up to ``retries`` times and within ``timeout_s`` overall: an engine restarted mid-call (kill -9, OOM) costs the
harness a wait, not an error. A failure is an :class:`~producers.proxy.emit.ApiError`: 400 when the engine answered
4xx (never retried), else 502 (other 5xx, a malformed answer, the whole wait, or the engine still away at the bound:
:class:`EngineUnavailable`, which a pool fails over on; the message names the setting that ended it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

from producers.proxy.emit import ApiError

log = logging.getLogger("clawstream.proxy.engine")


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


# The engine is away, not wrong: nothing was answered (refused, connect timeout, reset, disconnected, cut body).
_AWAY_ERRORS = (
    aiohttp.ClientOSError,  # ClientConnectorError (refused, unreachable), connection reset
    aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError,  # sock_connect ran out (a host that does not answer)
    aiohttp.ClientPayloadError,  # the answer's body was cut off (the engine died while sending it)
)
LOG_EVERY = 10  # a retry is logged on the first and on every LOG_EVERY-th (not every 0.2 s)


class EngineAway(Exception):
    """One attempt found the engine away (:data:`_AWAY_ERRORS`, or 503 while it loads): worth asking again."""


class EngineUnavailable(ApiError):
    """A 502: the engine was still away when the retries or the time ran out (a pool moves the call elsewhere)."""


class EngineClient:
    """One HTTP session to the engine (opened on the app's startup, closed on its cleanup)."""

    def __init__(
        self,
        engine_url: str,
        model: str,
        timeout_s: float,
        stop_token_id: int,
        *,
        retries: int = 0,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.engine_url, self.model, self.timeout_s, self.stop_token_id = engine_url, model, timeout_s, stop_token_id
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
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
        rollout_id: str = "",
        retries: int | None = None,
    ) -> EngineReply:
        """Generate up to ``max_tokens`` after ``prompt``, sampled with the rollout's settings (top_k 0 = off); the
        same request again while the engine is away, up to ``retries`` times (default the client's; module
        docstring). ``rollout_id`` names the retries' logs."""
        retries = self.retries if retries is None else retries
        payload = self._payload(prompt, max_tokens, temperature, top_p, top_k, seed)
        url = self.engine_url.rstrip("/") + "/v1/completions"
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.timeout_s
        delay = self.backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._post(url, payload, deadline - loop.time())
            except EngineAway as exc:
                away = exc
            waited = loop.time() - started
            if attempt > retries or loop.time() + delay >= deadline:
                spent = attempt > retries
                bound = f"engine_retries={retries}" if spent else f"engine_timeout_s={self.timeout_s:g}"
                raise EngineUnavailable(
                    502,
                    f"inference engine unavailable at {self.engine_url}: still away after {attempt} attempt(s) over "
                    f"{waited:.1f}s ({bound} reached); last: {away}",
                ) from away
            if attempt == 1 or attempt % LOG_EVERY == 0:
                log.warning(
                    "rollout %s: inference engine at %s away (%s); retry %d of at most %d in %.1fs (%.1fs so far)",
                    rollout_id or "?",
                    self.engine_url,
                    away,
                    attempt,
                    retries,
                    delay,
                    waited,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)

    def _payload(
        self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None
    ) -> dict[str, Any]:
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
        return payload

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Does ``GET {engine_url}/health`` answer 200 now (the CPU engine's and vLLM's readiness route)?"""
        assert self.session is not None
        url = self.engine_url.rstrip("/") + "/health"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _post(self, url: str, payload: dict[str, Any], left_s: float) -> EngineReply:
        """One attempt within ``left_s`` seconds: the reply, :class:`EngineAway`, or :class:`ApiError`."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=left_s, sock_connect=min(10.0, left_s))
        try:
            async with self.session.post(url, json=payload, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status == 503:  # loading (or draining): it will answer once it can
                    raise EngineAway(f"answered 503: {text[:200]}")
                if resp.status >= 400:
                    status = 400 if 400 <= resp.status < 500 else 502
                    raise ApiError(status, f"inference engine answered {resp.status}: {text[:300]}")
                data = json.loads(text)
                header_version = resp.headers.get("X-Policy-Version")
        except _AWAY_ERRORS as exc:
            raise EngineAway(repr(exc)) from exc
        except TimeoutError as exc:
            raise ApiError(
                502, f"inference engine at {self.engine_url} did not answer within engine_timeout_s={self.timeout_s:g}"
            ) from exc
        except (aiohttp.ClientError, ValueError) as exc:
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
