"""Faust codec for clawstream events: Avro single-object encoding through ``schemas.codec``.

Writes the deployment's wire format (``CLAWSTREAM_WIRE_FORMAT``: single-object, or the Schema Registry format) and
reads both, so a topic may hold either during a migration.

Registered under the name ``clawstream-avro``; use it as ``app.topic(name, value_serializer="clawstream-avro")``.
Agents then receive typed events (``schemas.events``). Pure glue: no Kafka client here, Faust owns the I/O.
"""

from __future__ import annotations

from typing import Any

from faust.serializers import codecs

from schemas.codec import default_codec
from schemas.events import ALL_EVENTS, Event

CODEC_NAME = "clawstream-avro"
EVENT_TYPES: dict[str, type[Event]] = {f"io.clawstream.{cls.SCHEMA}": cls for cls in ALL_EVENTS}


class AvroEventCodec(codecs.Codec):
    """bytes ⇄ typed event. Decoding errors surface as ``clawbase.errors.CodecError`` subclasses."""

    def _dumps(self, obj: Any) -> bytes:
        if isinstance(obj, Event):
            return obj.to_bytes()
        raise TypeError(f"{CODEC_NAME} encodes clawstream events only, got {type(obj).__name__}")

    def _loads(self, s: bytes) -> Event:
        name, record = default_codec().decode(s)
        return EVENT_TYPES[name].from_record(record)


def register() -> None:
    """Register the codec with Faust (idempotent)."""
    codecs.register(CODEC_NAME, AvroEventCodec())


register()
