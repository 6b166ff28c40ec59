"""The proxy's per-rollout quotas (``producers.proxy.quota``, pure): what is admitted, what is refused and why."""

from __future__ import annotations

import pytest

from producers.proxy.quota import Quotas, Usage
from producers.proxy.settings import ProxySettings


def test_calls_are_counted_until_the_call_quota_refuses_one() -> None:
    quotas, usage = Quotas(max_calls=2, max_prompt_tokens=0), Usage()
    assert usage.admit(quotas, 10) is None and usage.admit(quotas, 10) is None
    assert usage.calls_left(quotas) == usage.admit(quotas, 10)
    assert "max_calls_per_rollout 2" in (usage.admit(quotas, 10) or "")
    assert (usage.calls, usage.prompt_tokens) == (2, 20)  # a refused call counts nothing


def test_prompt_tokens_are_summed_over_calls_and_the_call_that_would_pass_is_refused() -> None:
    quotas, usage = Quotas(max_calls=0, max_prompt_tokens=100), Usage()
    assert usage.admit(quotas, 60) is None
    refused = usage.admit(quotas, 41)
    assert refused is not None and "max_prompt_tokens_per_rollout 100" in refused and "41" in refused
    assert usage.admit(quotas, 40) is None and (usage.calls, usage.prompt_tokens) == (2, 100)  # up to the limit


def test_zero_is_unlimited_and_negative_is_refused() -> None:
    usage = Usage()
    for _ in range(1000):
        assert usage.admit(Quotas(0, 0), 10**6) is None
    with pytest.raises(ValueError):
        Quotas(max_calls=-1)


def test_the_defaults_fit_a_real_harness_and_the_admin_listener_is_its_own() -> None:
    s = ProxySettings(model="m")
    assert s.max_calls_per_rollout >= 256 and s.max_prompt_tokens_per_rollout >= 256 * 40_000 // 2
    assert (s.admin_host, s.admin_port) == ("127.0.0.1", 8101) and s.admin_port != s.port
    with pytest.raises(ValueError, match="admin API needs its own"):
        ProxySettings(model="m", port=9000, admin_port=9000)
