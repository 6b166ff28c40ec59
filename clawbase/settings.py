"""Shared settings: where Kafka is, how to authenticate, which topic prefix to use.

Every service reads :class:`KafkaSettings` from ``CLAWSTREAM_KAFKA_*`` environment variables (or keyword arguments);
its command line adds ``--bootstrap`` / ``--topic-prefix`` (:func:`add_kafka_arguments`, :func:`kafka_settings`),
which win over the environment. When no bootstrap address is configured, the address of the broker started by
``clawstream kafka up`` is used (``clawbase.kafka.clients.bootstrap_servers`` resolves it), so a laptop needs no
configuration at all. Validation errors are re-raised as :class:`ConfigError` naming the environment variable (or
flag) and the fix.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from clawbase.errors import ConfigError

S = TypeVar("S", bound=BaseSettings)


def clawstream_home() -> Path:
    """Local state directory (broker data, jar cache, weight store): ``$CLAWSTREAM_HOME`` or ``~/.cache/clawstream``."""
    return Path(os.environ.get("CLAWSTREAM_HOME") or Path.home() / ".cache" / "clawstream")


class KafkaSettings(BaseSettings):
    """Kafka client configuration shared by all services (env prefix ``CLAWSTREAM_KAFKA_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_KAFKA_", frozen=True, extra="forbid")

    bootstrap_servers: str | None = Field(
        default=None,
        description="Comma-separated host:port list. Unset: the broker started by `clawstream kafka up`.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="librdkafka security.protocol."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"] | None = Field(
        default=None, description="librdkafka sasl.mechanism; required with a SASL_* protocol."
    )
    sasl_username: str | None = Field(default=None, description="SASL user name (PLAIN / SCRAM).")
    sasl_password: str | None = Field(default=None, description="SASL password (PLAIN / SCRAM).")
    ssl_ca_location: str | None = Field(default=None, description="CA bundle path for SSL / SASL_SSL.")
    ssl_certificate_location: str | None = Field(default=None, description="Client certificate path (mutual TLS).")
    ssl_key_location: str | None = Field(default=None, description="Client private key path (mutual TLS).")
    topic_prefix: str = Field(
        default="",
        description="Prepended to every topic name (e.g. 'test-3f2a.') so runs can share a cluster in isolation.",
    )
    client_id: str = Field(default="clawstream", description="client.id reported to the broker.")
    replication_factor: int | None = Field(
        default=None,
        ge=1,
        description="Replicas of every topic clawstream creates (the catalog, the streams app's own topics). Unset: "
        "min(3, brokers in the cluster). min.insync.replicas follows: factor - 1 from 3 replicas on, else 1.",
    )
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="Any other librdkafka properties, passed through as-is (JSON object in the env variable).",
    )

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str | None) -> str | None:
        if value is None:
            return None
        for hostport in value.split(","):
            host, sep, port = hostport.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"'{hostport}' is not host:port; use e.g. 127.0.0.1:9092,broker2:9092")
        return value

    @field_validator("topic_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
        if not set(value) <= allowed:
            raise ValueError("topic names allow only letters, digits, '.', '_' and '-'; pick a prefix from those")
        return value

    @model_validator(mode="after")
    def _check_sasl(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError(
                "security_protocol is SASL_* but sasl_mechanism is unset; set CLAWSTREAM_KAFKA_SASL_MECHANISM"
            )
        return self

    def topic(self, name: str) -> str:
        """The full topic name for a catalog name (prefix applied)."""
        return f"{self.topic_prefix}{name}"


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build a settings object, turning pydantic's errors into one :class:`ConfigError` that names each field.

    The message gives the environment variable to set, what was wrong and, where the validator says it, the fix.
    """
    try:
        return cls(**overrides)
    except ValidationError as exc:
        prefix = str(cls.model_config.get("env_prefix", ""))
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "(settings)"
            env = f"{prefix}{field}".upper() if err["loc"] else prefix.rstrip("_")
            message = err["msg"].removeprefix("Value error, ")
            lines.append(f"{field} ({env}): {message}")
        raise ConfigError(f"invalid {cls.__name__}:\n  " + "\n  ".join(lines)) from exc


def add_kafka_arguments(parser: argparse.ArgumentParser) -> None:
    """``--bootstrap`` and ``--topic-prefix`` on a service's command line (they override ``CLAWSTREAM_KAFKA_*``)."""
    group = parser.add_argument_group("Kafka (flags override the CLAWSTREAM_KAFKA_* environment variables)")
    group.add_argument(
        "--bootstrap",
        metavar="HOST:PORT[,...]",
        default=None,
        help="broker address (env CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS; default: the broker of "
        "`clawstream kafka up`, found under $CLAWSTREAM_HOME/kafka)",
    )
    group.add_argument(
        "--topic-prefix",
        metavar="PREFIX",
        default=None,
        help="prepended to every topic name (env CLAWSTREAM_KAFKA_TOPIC_PREFIX; default: none)",
    )


def kafka_settings(args: argparse.Namespace | None = None, **overrides: Any) -> KafkaSettings:
    """:class:`KafkaSettings` from the environment, the flags of :func:`add_kafka_arguments` (when given) on top."""
    if args is not None and getattr(args, "bootstrap", None):
        overrides.setdefault("bootstrap_servers", args.bootstrap)
    if args is not None and getattr(args, "topic_prefix", None) is not None:
        overrides.setdefault("topic_prefix", args.topic_prefix)
    return load_settings(KafkaSettings, **overrides)
