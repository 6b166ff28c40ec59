"""The proxy's engine-pool settings: ``engine_url`` as one URL, a comma-separated list, a list (the CLI's repeated
``--engine-url``) or the environment; errors name the field and the fix."""

from __future__ import annotations

import pytest

from clawbase.errors import ConfigError
from clawbase.settings import load_settings
from producers.proxy.settings import ProxySettings


def test_one_engine_is_the_default_and_a_list_or_csv_is_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ProxySettings(model="m").engine_urls == ["http://127.0.0.1:8000"]
    pool = ["http://a:8000", "http://b:8000"]
    assert ProxySettings(model="m", engine_url=pool).engine_urls == pool
    assert ProxySettings(model="m", engine_url="http://a:8000, http://b:8000").engine_urls == pool
    monkeypatch.setenv("CLAWSTREAM_PROXY_ENGINE_URL", "http://a:8000,http://b:8000")
    assert ProxySettings(model="m").engine_urls == pool


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        ({"engine_url": "http://a:1,"}, "empty URL"),
        ({"engine_url": "a:1"}, "not an http(s):// URL"),
        ({"engine_url": ["http://a:1", "http://a:1"]}, "given twice"),
        ({"engine_routing": "hash"}, "use one of affinity, round_robin, least_loaded"),
    ],
)
def test_a_bad_pool_names_the_field_and_the_fix(overrides: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(ProxySettings, model="m", **overrides)
    field = next(iter(overrides))
    assert f"{field} (CLAWSTREAM_PROXY_{field.upper()})" in str(info.value) and says in str(info.value)
