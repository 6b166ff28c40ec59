"""Settings: env parsing and errors that name the field, the variable and the fix."""

from __future__ import annotations

import pytest

from clawstream.errors import ConfigError
from clawstream.kafka.clients import bootstrap_servers, client_config
from clawstream.settings import KafkaSettings, load_settings


def test_env_and_passthrough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", "k1:9092,k2:9093")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_SASL_USERNAME", "u")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_SASL_PASSWORD", "p")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "exp1.")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_EXTRA", '{"socket.keepalive.enable": "true"}')
    settings = load_settings(KafkaSettings)
    conf = client_config(settings)
    assert conf["bootstrap.servers"] == "k1:9092,k2:9093"
    assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["sasl.username"] == "u" and conf["socket.keepalive.enable"] == "true"
    assert "ssl.ca.location" not in conf
    assert settings.topic("clawstream.calls") == "exp1.clawstream.calls"


def test_frozen() -> None:
    settings = KafkaSettings(bootstrap_servers="a:1")
    with pytest.raises(Exception, match="frozen"):
        settings.topic_prefix = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"bootstrap_servers": "localhost"}, ["bootstrap_servers", "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", "host:port"]),
        ({"security_protocol": "TLS"}, ["security_protocol", "CLAWSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL"]),
        ({"topic_prefix": "a b"}, ["topic_prefix", "CLAWSTREAM_KAFKA_TOPIC_PREFIX", "letters, digits"]),
        ({"security_protocol": "SASL_PLAINTEXT"}, ["CLAWSTREAM_KAFKA_SASL_MECHANISM"]),
        ({"no_such_field": 1}, ["no_such_field"]),
    ],
)
def test_errors_name_field_and_fix(overrides: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(KafkaSettings, **overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_unset_bootstrap_without_local_broker_says_what_to_do(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CLAWSTREAM_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="clawstream kafka up"):
        bootstrap_servers(KafkaSettings())
