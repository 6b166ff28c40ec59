"""Avro single-object encoding of clawstream events, with writer schemas resolved by fingerprint.

Wire format (Avro spec, "Single-object encoding"): ``C3 01`` marker, the 8-byte little-endian CRC-64-AVRO
fingerprint of the writer schema's parsing canonical form, then the Avro binary body. Any Avro implementation
can decode a record with the ``.avsc`` files alone; no registry server is involved. A deployment may instead write
Confluent's registry format (``00``, 4-byte big-endian schema id, body; ``schemas.registry``, set by
``CLAWSTREAM_WIRE_FORMAT=registry``); every reader accepts both (the first byte tells them apart).

The current schemas are ``schemas/*.avsc``; older versions in ``schemas/history/`` are known as writer schemas
only, so a record written with an old version is read with the new one (defaults fill added fields).
Pure: no Kafka import.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastavro import parse_schema, schemaless_reader, schemaless_writer
from fastavro.read import SchemaResolutionError
from fastavro.schema import fingerprint as avro_fingerprint
from fastavro.schema import to_parsing_canonical_form
from fastavro.validation import validate

from clawbase.errors import CodecError, CorruptRecordError, UnknownSchemaError
from schemas import registry as wire

SCHEMA_DIR = Path(__file__).resolve().parent
MARKER = b"\xc3\x01"
HEADER_LEN = len(MARKER) + 8


@dataclass(frozen=True)
class SchemaEntry:
    """One parsed schema: its full name, fingerprint and fastavro form."""

    name: str  # full name, e.g. "io.clawstream.CallEvent"
    fingerprint: bytes  # 8 bytes, little-endian CRC-64-AVRO, as written after the marker
    parsed: Any
    path: Path


def schema_fingerprint(schema: dict[str, Any]) -> bytes:
    """CRC-64-AVRO fingerprint of a schema's parsing canonical form, as the 8 bytes single-object encoding writes."""
    canonical = to_parsing_canonical_form(parse_schema(schema, _write_hint=False))
    # fastavro returns the digest bytes in hex, already in little-endian (wire) order.
    return bytes.fromhex(avro_fingerprint(canonical, "CRC-64-AVRO"))


def _load(path: Path) -> SchemaEntry:
    try:
        raw = json.loads(path.read_text())
        parsed = parse_schema(raw, _write_hint=False)
    except (OSError, ValueError, Exception) as exc:  # fastavro raises SchemaParseException and friends
        raise CodecError(f"cannot load Avro schema {path}: {exc}") from exc
    name = f"{raw['namespace']}.{raw['name']}" if "namespace" in raw and "." not in raw["name"] else raw["name"]
    return SchemaEntry(name=name, fingerprint=schema_fingerprint(raw), parsed=parsed, path=path)


class AvroCodec:
    """Encode and decode events by schema name ("CallEvent" or "io.clawstream.CallEvent")."""

    def __init__(
        self,
        schema_dir: Path = SCHEMA_DIR,
        *,
        registry: wire.RegistryResolver | None = None,
        write_registry: bool = False,
    ) -> None:
        if write_registry and registry is None:
            raise CodecError("the registry wire format needs a registry (CLAWSTREAM_SCHEMA_REGISTRY_URL)")
        self.registry = registry
        self.write_registry = write_registry  # producers write the registry format; readers take both anyway
        self._by_id: dict[int, SchemaEntry] = {}  # registry id → writer schema (read side)
        self._write_ids: dict[str, int] = {}  # full name → registry id of its current schema (write side)
        self._current: dict[str, SchemaEntry] = {}
        self._writers: dict[bytes, SchemaEntry] = {}
        for path in sorted(schema_dir.glob("*.avsc")):
            entry = _load(path)
            self._current[entry.name] = entry
            self._writers[entry.fingerprint] = entry
        for path in sorted((schema_dir / "history").glob("*.avsc")):
            entry = _load(path)
            self._writers.setdefault(entry.fingerprint, entry)
        if not self._current:
            raise CodecError(f"no .avsc files found in {schema_dir}")

    @property
    def names(self) -> list[str]:
        return sorted(self._current)

    def entry(self, name: str) -> SchemaEntry:
        full = name if "." in name else f"io.clawstream.{name}"
        try:
            return self._current[full]
        except KeyError:
            raise UnknownSchemaError(f"no schema named {name!r}; known: {', '.join(self.names)}") from None

    def encode(self, name: str, record: dict[str, Any]) -> bytes:
        """Encode ``record`` with the current schema ``name``: single-object, or the registry format when chosen."""
        entry = self.entry(name)
        buf = io.BytesIO()
        if self.write_registry:
            assert self.registry is not None
            schema_id = self._write_ids.get(entry.name)
            if schema_id is None:
                schema_text = json.dumps(json.loads(entry.path.read_text()), separators=(",", ":"))
                schema_id = self._write_ids[entry.name] = self.registry.id_for(
                    entry.name.rpartition(".")[2], schema_text
                )
            buf.write(wire.MAGIC + schema_id.to_bytes(4, "big"))
        else:
            buf.write(MARKER)
            buf.write(entry.fingerprint)
        try:
            schemaless_writer(buf, entry.parsed, record)
        except Exception as exc:  # fastavro raises ValueError/TypeError/KeyError/AttributeError on bad records
            # Validation pinpoints the field; only run it on the error path, it is slow on big token arrays.
            try:
                validate(record, entry.parsed, raise_errors=True)
            except Exception as detail:  # noqa: BLE001 - fastavro.ValidationError carries the field path
                raise CodecError(f"record does not match {entry.name}: {detail}") from exc
            raise CodecError(f"record does not match {entry.name}: {exc!r}") from exc
        return buf.getvalue()

    def _registry_writer(self, data: bytes) -> SchemaEntry:
        """The writer schema of a registry-format record: its id's schema, fetched once and matched by fingerprint."""
        if len(data) < wire.HEADER_LEN:
            raise CorruptRecordError(f"registry-format record shorter than its 5-byte header: {data[:10].hex()}")
        schema_id = int.from_bytes(data[1:5], "big")
        entry = self._by_id.get(schema_id)
        if entry is not None:
            return entry
        if self.registry is None:  # a single-object deployment: garbage or a registry record, told apart by no one
            raise CorruptRecordError(
                f"not Avro single-object encoding (C3 01): starts {data[:10].hex()}; if it is the schema registry "
                f"format (00, schema id {schema_id}), set CLAWSTREAM_SCHEMA_REGISTRY_URL"
            )
        text = self.registry.schema_for(schema_id)
        try:
            raw = json.loads(text)
            fingerprint = schema_fingerprint(raw)
        except Exception as exc:  # noqa: BLE001 - fastavro's parse errors have no common base
            raise UnknownSchemaError(
                f"registry schema id {schema_id} is not an Avro schema clawstream reads: {exc}"
            ) from exc
        entry = self._writers.get(fingerprint)
        if entry is None:  # a writer newer than this checkout's schemas/: read it through resolution all the same
            entry = SchemaEntry(
                name=f"{raw.get('namespace')}.{raw['name']}" if "." not in raw["name"] else raw["name"],
                fingerprint=fingerprint,
                parsed=parse_schema(raw, _write_hint=False),
                path=Path(f"registry-id-{schema_id}"),
            )
        self._by_id[schema_id] = entry
        return entry

    def header_len(self, data: bytes) -> int:
        return wire.HEADER_LEN if data[:1] == wire.MAGIC else HEADER_LEN

    def writer_of(self, data: bytes) -> SchemaEntry:
        """The writer schema named by a record's header; typed errors for garbage or unknown fingerprints."""
        if data[:1] == wire.MAGIC:
            return self._registry_writer(data)
        if len(data) < HEADER_LEN or data[:2] != MARKER:
            raise CorruptRecordError(
                "neither Avro single-object encoding (C3 01, 8-byte fingerprint) nor the registry format (00, 4-byte "
                f"schema id): got {data[:10].hex()}"
            )
        fp = bytes(data[2:HEADER_LEN])
        entry = self._writers.get(fp)
        if entry is None:
            raise UnknownSchemaError(f"unknown writer schema fingerprint {fp.hex()} (a newer producer? stale schemas/)")
        return entry

    def decode(self, data: bytes, expected: str | None = None) -> tuple[str, dict[str, Any]]:
        """Decode to ``(schema full name, record)``, read with the *current* schema of the writer's name."""
        writer = self.writer_of(data)
        reader = self._current.get(writer.name)
        if reader is None:
            raise UnknownSchemaError(f"writer schema {writer.name} has no current version in schemas/")
        if expected is not None and self.entry(expected).name != writer.name:
            raise CorruptRecordError(f"expected a {self.entry(expected).name} record, got {writer.name}")
        header = self.header_len(data)
        body = io.BytesIO(memoryview(data)[header:])
        try:
            if writer is reader:
                record = schemaless_reader(body, writer.parsed, None)
            else:
                record = schemaless_reader(body, writer.parsed, reader.parsed)
        except SchemaResolutionError as exc:
            raise CodecError(
                f"cannot read {writer.name} written with {writer.path.name} using the current schema: {exc}"
            ) from exc
        except Exception as exc:  # EOFError, UnicodeDecodeError, IndexError, ...
            raise CorruptRecordError(f"corrupt {writer.name} body: {exc!r}") from exc
        if body.tell() != len(data) - header:
            raise CorruptRecordError(
                f"corrupt {writer.name} body: {len(data) - header - body.tell()} trailing bytes after the record"
            )
        if not isinstance(record, dict):  # every clawstream schema is a record
            raise CorruptRecordError(f"{writer.name} body decoded to {type(record).__name__}, not a record")
        return writer.name, record


@lru_cache(maxsize=1)
def default_codec() -> AvroCodec:
    """The process-wide codec over the packaged schemas (parsing them once), writing this deployment's wire format
    (``CLAWSTREAM_WIRE_FORMAT``; with ``CLAWSTREAM_SCHEMA_REGISTRY_URL`` set it also reads registry-format records)."""
    from clawbase.settings import load_settings  # noqa: PLC0415 - settings only when the codec is first built

    settings = load_settings(wire.WireSettings)
    url = settings.schema_registry_url
    resolver = wire.RegistryResolver(wire.RegistryClient(url, settings.registry_timeout_s)) if url else None
    return AvroCodec(registry=resolver, write_registry=settings.wire_format == "registry")
