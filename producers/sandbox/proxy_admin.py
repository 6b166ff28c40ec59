"""Client of the serving proxy's admin API (``producers.proxy.admin``): register, renew, seal and forget a rollout
attempt's registration, which is the attempt's claim on its rollout id (``producers.sandbox.rollout``)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from clawbase.errors import ClawstreamError

log = logging.getLogger("clawstream.rollout")


class ProxyError(ClawstreamError):
    """The serving proxy's admin API failed (registration or seal)."""


class RolloutHeld(ClawstreamError):
    """Another attempt holds the rollout id at the proxy and is live, or this request attempt already finished."""

    def __init__(self, rollout_id: str, attempt_id: str | None, *, finished: bool) -> None:
        self.rollout_id, self.attempt_id, self.finished = rollout_id, attempt_id, finished
        what = "already finished" if finished else "is running (its lease is live)"
        super().__init__(f"rollout {rollout_id}: attempt {attempt_id} {what}")


class _BalancerError(Exception):
    """A 502/503/504 without the proxy's JSON body: the balancer in front of proxy replicas found none up."""


class ProxyAdmin:
    """Client of the proxy's admin API (``producers.proxy.admin``)."""

    def __init__(self, url: str, token: str, timeout_s: float = 90.0, connect_retries: int = 60) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s
        self.connect_retries = connect_retries

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
    ) -> tuple[int, dict]:
        """One admin call. Refused at connect (the proxy is restarting; nothing was sent), or answered 502/503/504 by
        a load balancer in front of proxy replicas (not the proxy's JSON: its replica was down), it is tried again,
        with capped backoff, ``connect_retries`` times: a proxy restart must not burn a request's attempts in
        seconds. Every admin call is safe to repeat (a repeated registration finds its own attempt: 409, handled)."""
        headers = {"Authorization": f"Bearer {self.token}"}
        pause = 0.2
        for retry in range(self.connect_retries + 1):
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as http:
                    async with http.request(method, self.url + path, json=body, params=query, headers=headers) as r:
                        raw = await r.read()
                        try:
                            data = json.loads(raw) if raw else {}
                        except ValueError:
                            if r.status not in (502, 503, 504):
                                raise
                            raise _BalancerError(f"{r.status} {raw[:200]!r}") from None
                        return r.status, data or {}
            except (aiohttp.ClientConnectorError, _BalancerError) as exc:
                if retry == self.connect_retries:
                    raise ProxyError(f"proxy admin {method} {path} at {self.url}: {exc!r}") from exc
                if retry % 10 == 0:
                    log.warning("proxy admin %s %s at %s unreachable (%s): retrying", method, path, self.url, exc)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise ProxyError(f"proxy admin {method} {path} at {self.url}: {exc!r}") from exc
            await asyncio.sleep(pause)
            pause = min(2.0, pause * 2)
        raise AssertionError("unreachable")  # the loop returns or raises

    @staticmethod
    def _scope(attempt_id: str | None, **flags: str) -> dict[str, str]:
        return {**({"attempt_id": attempt_id} if attempt_id else {}), **flags}

    async def register(self, rollout_id: str, **params: Any) -> dict[str, Any]:
        """Register ``rollout_id`` for ``params["attempt_id"]``. Raises :class:`RolloutHeld` when another attempt
        holds it and is live, or its request attempt already finished. A holder that stopped renewing its lease (its
        worker died), or holds it without one, is revoked — sealed and forgotten under *its* attempt id only."""
        body = {"rollout_id": rollout_id, **params}
        own = params.get("attempt_id")
        for _ in range(4):  # a revoked holder may be replaced by another newcomer meanwhile: ask again
            # the id in the query too: a balancer in front of proxy replicas routes by it (compose/haproxy.cfg)
            status, data = await self._call("POST", "/admin/rollouts", body, {"rollout_id": rollout_id})
            if status != 409:
                break
            holder = data.get("attempt_id")
            if data.get("finished"):
                raise RolloutHeld(rollout_id, holder, finished=True)
            if data.get("live") and (holder is None or holder != own):
                raise RolloutHeld(rollout_id, holder, finished=False)
            log.warning("rollout %s: revoking attempt %s, its lease not renewed (its worker died)", rollout_id, holder)
            await self._revoke(rollout_id, holder)
        if status != 201:
            raise ProxyError(f"proxy refused to register {rollout_id}: {status} {data}")
        return data

    async def _revoke(self, rollout_id: str, attempt_id: str | None) -> None:
        path = f"/admin/rollouts/{rollout_id}"
        for method, url in (("POST", f"{path}/seal"), ("DELETE", path)):
            status, data = await self._call(method, url, query=self._scope(attempt_id))
            if status in (404, 409):  # gone, or another attempt holds it now: registering again tells
                return
            if status != 200:
                raise ProxyError(f"proxy could not revoke attempt {attempt_id} of {rollout_id}: {status} {data}")

    async def seal(self, rollout_id: str, attempt_id: str | None = None) -> dict[str, Any]:
        """Seal the registration (only if ``attempt_id`` holds it, when given); ProxyError otherwise."""
        status, data = await self._call("POST", f"/admin/rollouts/{rollout_id}/seal", query=self._scope(attempt_id))
        if status != 200:
            raise ProxyError(f"proxy could not seal {rollout_id} (attempt {attempt_id}): {status} {data}")
        return data

    async def renew(self, rollout_id: str, attempt_id: str, lease_s: float) -> bool:
        """Extend ``attempt_id``'s lease; False when it no longer holds the registration (revoked or forgotten)."""
        status, data = await self._call(
            "POST", f"/admin/rollouts/{rollout_id}/renew", {"lease_s": lease_s}, self._scope(attempt_id)
        )
        if status in (404, 409):
            return False
        if status != 200:
            raise ProxyError(f"proxy could not renew {rollout_id} (attempt {attempt_id}): {status} {data}")
        return True

    async def forget(self, rollout_id: str, attempt_id: str | None = None, *, finished: bool = False) -> None:
        """Forget the registration (only if ``attempt_id`` holds it, when given); ``finished``: the attempt's
        terminal events are acknowledged, so the proxy refuses to register this request attempt again."""
        query = self._scope(attempt_id, **({"finished": "1"} if finished else {}))
        status, data = await self._call("DELETE", f"/admin/rollouts/{rollout_id}", query=query)
        if status not in (200, 404):
            log.warning("rollout %s: forgetting attempt %s: %s %s", rollout_id, attempt_id, status, data)
