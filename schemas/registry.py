"""Confluent Schema Registry wire format: the deployment setting, a small REST client and the id ⇄ schema resolver.

Wire format (Confluent): byte ``00``, the 4-byte big-endian schema id, then the Avro binary body; the id is the
registry's for the writer schema, registered under the subject ``<topic>-value`` (TopicNameStrategy) with
compatibility BACKWARD. Chosen per deployment (``CLAWSTREAM_WIRE_FORMAT=single-object|registry``,
``CLAWSTREAM_SCHEMA_REGISTRY_URL``); readers decode both formats whatever the setting (``schemas.codec``).
Schemas are registered by ``clawstream topics create`` (:func:`register_catalog`): each topic's history in
``schemas/history`` first, oldest first, so old writers have ids, then the current ``.avsc``.
Uses only the Confluent REST subset every compatible registry serves (Confluent, Apicurio's ``/apis/ccompat/v7``,
Karapace): ``/subjects/{s}/versions``, ``/subjects/{s}`` (lookup), ``/schemas/ids/{id}``, ``/config/{s}``,
``/compatibility/subjects/{s}/versions/latest``. Pure: no Kafka import (HTTP with the standard library).
"""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from clawbase.errors import CodecError
from clawbase.kafka.topic_spec import TopicSpec
from schemas.registry_compat import IncompatibleSchemaError, backward_problems, history_of

SCHEMA_DIR = Path(__file__).resolve().parent  # the packaged .avsc files (as schemas.codec.SCHEMA_DIR)
MAGIC = b"\x00"
HEADER_LEN = 5
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
COMPATIBILITY = "BACKWARD"


class SchemaRegistryError(CodecError):
    """The schema registry could not be reached, refused a request, or knows no schema for an id or subject."""


class WireSettings(BaseSettings):
    """Which wire format this deployment's producers write (env prefix ``CLAWSTREAM_``); readers take both."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_", frozen=True, extra="ignore")

    wire_format: Literal["single-object", "registry"] = Field(
        default="single-object",
        description="single-object: Avro single-object encoding, decodable with the .avsc files alone; registry: "
        "Confluent's wire format (magic byte, schema id) for Connect, ksqlDB and the Confluent deserializers.",
    )
    schema_registry_url: str | None = Field(
        default=None,
        description="Base URL of a Confluent-compatible registry (e.g. http://127.0.0.1:8081/apis/ccompat/v7). "
        "Needed to write the registry format and to read records written in it.",
    )
    registry_timeout_s: float = Field(default=10.0, gt=0, description="Seconds per registry request.")

    @model_validator(mode="after")
    def _url_for_registry(self) -> WireSettings:
        if self.wire_format == "registry" and not self.schema_registry_url:
            raise ValueError(
                "CLAWSTREAM_WIRE_FORMAT=registry needs CLAWSTREAM_SCHEMA_REGISTRY_URL (start one with "
                "`clawstream registry up` and export the URL it prints)"
            )
        return self


def subject_for(topic: str) -> str:
    """TopicNameStrategy: the value subject of a (full, prefixed) topic name."""
    return f"{topic}-value"


class RegistryClient:
    """The Confluent REST subset clawstream uses, over ``urllib`` (JSON bodies, typed errors)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Accept", CONTENT_TYPE)
        if data is not None:
            req.add_header("Content-Type", CONTENT_TYPE)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")[:500]
            if exc.code == 404 and missing_ok:
                return None
            raise SchemaRegistryError(f"{method} {self.url}{path}: HTTP {exc.code} {text}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise SchemaRegistryError(
                f"cannot reach the schema registry at {self.url} ({exc}); start it (`clawstream registry up`) or "
                "fix CLAWSTREAM_SCHEMA_REGISTRY_URL"
            ) from exc

    @staticmethod
    def _q(subject: str) -> str:
        return urllib.parse.quote(subject, safe="")

    def subjects(self) -> list[str]:
        return list(self._call("GET", "/subjects"))

    def schema_by_id(self, schema_id: int) -> str:
        """The schema text the registry holds under ``schema_id``."""
        out = self._call("GET", f"/schemas/ids/{schema_id}", missing_ok=True)
        if out is None:
            raise SchemaRegistryError(f"the schema registry at {self.url} has no schema with id {schema_id}")
        return str(out["schema"])

    def lookup(self, subject: str, schema: str) -> int | None:
        """The id of ``schema`` under ``subject``, or None when it is not registered there."""
        out = self._call("POST", f"/subjects/{self._q(subject)}", {"schema": schema}, missing_ok=True)
        return None if out is None else int(out["id"])

    def register(self, subject: str, schema: str) -> int:
        """Register ``schema`` under ``subject`` (idempotent: an identical schema keeps its id)."""
        return int(self._call("POST", f"/subjects/{self._q(subject)}/versions", {"schema": schema})["id"])

    def set_compatibility(self, subject: str, level: str = COMPATIBILITY) -> None:
        self._call("PUT", f"/config/{self._q(subject)}", {"compatibility": level})

    def compatibility_problems(self, subject: str, schema: str) -> list[str]:
        """Why ``schema`` may not follow the latest version of ``subject`` (empty: compatible, or a new subject)."""
        path = f"/compatibility/subjects/{self._q(subject)}/versions/latest?verbose=true"
        out = self._call("POST", path, {"schema": schema}, missing_ok=True)
        if out is None or out.get("is_compatible", False):
            return []
        return [str(m) for m in out.get("messages") or ["incompatible (the registry gave no detail)"]]


def _text(path: Path) -> str:
    return json.dumps(json.loads(path.read_text()), separators=(",", ":"))


def register_catalog(client: RegistryClient, catalog: list[tuple[str, TopicSpec]], schema_dir: Path) -> dict[str, int]:
    """Register each topic's value schema under ``<topic>-value`` (history first, oldest first, then the current
    one) with BACKWARD compatibility, asking the registry before each step. ``catalog``: (full topic, spec) pairs.
    Returns ``{subject: id of the current schema}``. Raises :class:`IncompatibleSchemaError` naming the schema."""
    by_name = {json.loads(Path(p).read_text())["name"]: (Path(p), olds) for p, olds in history_of(schema_dir).items()}
    ids: dict[str, int] = {}
    for topic, spec in catalog:
        current, olds = by_name[spec.value_schema]
        subject = subject_for(topic)
        client.set_compatibility(subject)
        previous: Path | None = None
        for path in [*olds, current]:
            text = _text(path)
            found = client.lookup(subject, text)
            if found is not None:
                ids[subject], previous = found, path
                continue
            problems = client.compatibility_problems(subject, text)
            if problems and previous is not None:  # the registry's verdict, with the field named by the local rules
                problems += backward_problems(json.loads(path.read_text()), json.loads(previous.read_text()))
            if problems:
                raise IncompatibleSchemaError(
                    f"the schema registry refuses {path.name} for {subject} (compatibility {COMPATIBILITY}):\n  "
                    + "\n  ".join(problems)
                    + "\nfix: make the change compatible (add fields with a default, only widen types)"
                )
            ids[subject] = client.register(subject, text)
            previous = path
    return ids


class RegistryResolver:
    """What the codec asks the registry: the id to write for a schema, the schema text for an id (both cached)."""

    def __init__(self, client: RegistryClient, topic_prefix: str | None = None) -> None:
        self.client = client
        self.topic_prefix = (
            os.environ.get("CLAWSTREAM_KAFKA_TOPIC_PREFIX", "") if topic_prefix is None else topic_prefix
        )
        self._ids: dict[str, int] = {}
        self._schemas: dict[int, str] = {}
        self._lock = threading.Lock()

    def id_for(self, name: str, schema_text: str) -> int:
        """The registry id of the current schema ``name`` (short name, e.g. "CallEvent") under its topic's subject
        (``CLAWSTREAM_KAFKA_TOPIC_PREFIX`` + topic + ``-value``). Normally ``topics create`` registered it; if not,
        it is registered here as ``topics create`` would (history first, BACKWARD checked), as Confluent's
        serializers auto-register."""
        with self._lock:
            if name in self._ids:
                return self._ids[name]
        from schemas.topics import CATALOG  # noqa: PLC0415 - the catalog imports nothing of this module

        spec = next(s for s in CATALOG if s.value_schema == name)
        subject = subject_for(self.topic_prefix + spec.name)
        schema_id = self.client.lookup(subject, schema_text)
        if schema_id is None:
            schema_id = register_catalog(self.client, [(self.topic_prefix + spec.name, spec)], SCHEMA_DIR)[subject]
        with self._lock:
            self._ids[name] = schema_id
        return schema_id

    def schema_for(self, schema_id: int) -> str:
        with self._lock:
            if schema_id in self._schemas:
                return self._schemas[schema_id]
        text = self.client.schema_by_id(schema_id)
        with self._lock:
            self._schemas[schema_id] = text
        return text
