"""Settings: env parsing, the services' --bootstrap / --topic-prefix flags, and errors that name the field, the
variable, the broker address tried and the fix."""

from __future__ import annotations

import argparse

import pytest

from clawbase.errors import ConfigError
from clawbase.kafka.clients import bootstrap_servers, check_broker, client_config
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings


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
    with pytest.raises(ConfigError, match="clawstream kafka up") as info:
        bootstrap_servers(KafkaSettings())
    assert f"under {tmp_path / 'kafka'}" in str(info.value) and "--bootstrap" in str(info.value)


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS", "env:1")
    monkeypatch.setenv("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "env.")
    parser = argparse.ArgumentParser()
    add_kafka_arguments(parser)
    assert kafka_settings(parser.parse_args([])).bootstrap_servers == "env:1"  # no flags: the environment
    got = kafka_settings(parser.parse_args(["--bootstrap", "flag:2", "--topic-prefix", "run7."]))
    assert got.bootstrap_servers == "flag:2" and got.topic_prefix == "run7."
    assert kafka_settings(parser.parse_args(["--topic-prefix", ""])).topic_prefix == ""
    with pytest.raises(ConfigError, match="CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS"):
        kafka_settings(parser.parse_args(["--bootstrap", "nohostport"]))


def test_unreachable_broker_names_the_address() -> None:
    with pytest.raises(ConfigError, match=r"no Kafka broker answered at 127\.0\.0\.1:9 \(from --bootstrap"):
        check_broker(KafkaSettings(bootstrap_servers="127.0.0.1:9"), timeout=2)


def test_streams_leaf_cap_can_be_turned_off_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from streams.settings import StreamsSettings

    for text in ("none", "None", "null"):
        monkeypatch.setenv("CLAWSTREAM_STREAMS_MAX_LEAVES", text)
        assert load_settings(StreamsSettings).max_leaves is None
    monkeypatch.setenv("CLAWSTREAM_STREAMS_MAX_LEAVES", "12")
    assert load_settings(StreamsSettings).max_leaves == 12
    monkeypatch.setenv("CLAWSTREAM_STREAMS_MAX_LEAVES", "many")
    with pytest.raises(ConfigError, match="CLAWSTREAM_STREAMS_MAX_LEAVES"):
        load_settings(StreamsSettings)
