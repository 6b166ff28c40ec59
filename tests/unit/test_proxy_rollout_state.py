"""One rollout's state in the proxy (``producers.proxy.rollout_state``): each thing that happens to it, through its
methods: quotas flag it once, calls are counted in flight until done, a seal waits for them, its record goes to the
registrations topic and comes back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from producers.proxy.quota import QUOTA_STATUS_NAME, Quotas
from producers.proxy.render import RolloutRenderer, TemplateRenderer
from producers.proxy.restore import Replayed
from producers.proxy.rollout_state import Rollout
from schemas.events import ProxyRegistration, now_ms
from tests.support import proxy_helpers as H


@pytest.fixture(scope="module")
def template() -> TemplateRenderer:
    return TemplateRenderer(H.tiny_tokenizer())


def _rollout(template: TemplateRenderer, **over: object) -> Rollout:
    fields: dict[str, object] = {
        "ttl_s": 60.0,
        "sampling": (0.5, 0.9, 20),
        "max_tokens": 64,
        "seed": 7,
        "attempt_id": "a-1",
        "attempt": 0,
        "lease_s": 30.0,
    }
    fields.update(over)
    return Rollout.register("r-1", RolloutRenderer(template), **fields)  # type: ignore[arg-type]


def test_a_registration_accepts_its_secret_only_and_is_live_while_leased(template: TemplateRenderer) -> None:
    r = _rollout(template)
    assert r.secret is not None and r.accepts(r.secret) and not r.accepts("") and not r.accepts(r.secret + "x")
    assert r.live(now_ms()) and not r.live(r.lease_expires_at_ms or 0)
    assert (r.temperature, r.top_p, r.top_k, r.attempt_id) == (0.5, 0.9, 20, "a-1")
    assert _rollout(template, attempt_id="").attempt_id is None  # an empty attempt id is none


def test_the_first_quota_refusal_is_kept_and_a_refused_call_counts_nothing(template: TemplateRenderer) -> None:
    r = _rollout(template)
    quotas = Quotas(max_calls=1, max_prompt_tokens=100)
    assert r.admit(quotas, 150) is not None and r.quota_exceeded is not None and "100" in r.quota_exceeded
    first = r.quota_exceeded
    assert r.calls_left(quotas) is None and r.admit(quotas, 10) is None  # admitted: counted
    assert r.calls_left(quotas) is not None and r.quota_exceeded == first
    assert r.status()["status"] == QUOTA_STATUS_NAME and r.status()["usage"] == {"calls": 1, "prompt_tokens": 10}


def test_the_engine_seed_and_seq_move_on_per_call_and_max_tokens_is_capped(template: TemplateRenderer) -> None:
    r = _rollout(template)
    assert (r.engine_seed(), r.take_seq(), r.engine_seed(), r.take_seq()) == (7, 0, 8, 1)
    assert _rollout(template, seed=None).engine_seed() is None
    assert (r.max_tokens_for(None), r.max_tokens_for(10), r.max_tokens_for(1000)) == (64, 10, 64)


def test_a_seal_waits_for_calls_in_flight_and_flags_one_still_running(template: TemplateRenderer) -> None:
    async def go() -> None:
        r = _rollout(template)
        done = r.track(asyncio.ensure_future(asyncio.sleep(0.05)))
        assert r.in_flight == 1
        await r.seal(2.0, template)
        assert done.done() and r.in_flight == 0 and r.sealed and r.infra_failure is None
        stuck = _rollout(template)
        never = stuck.track(asyncio.ensure_future(asyncio.sleep(60)))
        await stuck.seal(0.1, template)
        assert stuck.infra_failure == "1 call(s) still in flight at seal"
        stuck.fail("engine call: away")  # an infrastructure failure names the latest cause
        assert stuck.status()["status"] == "infra_failure" and stuck.infra_failure == "engine call: away"
        never.cancel()
        await asyncio.wait({never})
        await asyncio.sleep(0)  # done callbacks run on the loop's next turn
        assert stuck.in_flight == 0

    asyncio.run(go())


def test_its_record_comes_back_as_the_same_rollout_with_a_fresh_lease(template: TemplateRenderer) -> None:
    r = _rollout(template)
    r.starts_calls_at({"0": 12})
    r.count_error(502)
    reg = ProxyRegistration.from_bytes(r.to_record(proxy="http://p", replica="a", timestamp_ms=now_ms()).to_bytes())
    assert reg.secret_sha256 == r.secret_sha256 and reg.calls_offsets == {"0": 12} and reg.replica == "a"
    back = Rollout.from_record(reg, Replayed(RolloutRenderer(template), next_seq=3, calls_served=3, prompt_tokens=90))
    assert back.secret is None and r.secret is not None and back.accepts(r.secret) and back.restored
    assert (back.next_seq, back.calls_served, back.usage.calls, back.usage.prompt_tokens) == (3, 3, 3, 90)
    assert back.live(now_ms()) and back.refused is None and back.errors == {}
    sealed = Rollout.from_record(dataclasses.replace(reg, sealed=True), Replayed(RolloutRenderer(template)))
    assert sealed.sealed and sealed.seal_report()["sealed"] and "messages" not in sealed.seal_report()
