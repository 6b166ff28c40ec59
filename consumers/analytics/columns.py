"""Avro value schema → typed Arrow columns, and a record → one row of them (what ``export --format parquet`` writes).

Columns, in order: the Kafka envelope ``topic`` (string), ``partition`` (int32), ``offset`` (int64), ``timestamp``
(timestamp[ms, UTC]), ``key`` (string); then one column per top-level field of the value schema, typed from the
``.avsc``; then ``error`` (string) and ``raw_value`` (binary), null except on a record that could not be decoded
(its value columns are null and ``raw_value`` holds its bytes, so nothing is lost).

Types: string → string, long → int64, int → int32, double → float64, float → float32, boolean → bool, enum →
string, ``["null", T]`` → nullable T, array → list, map → map<string, T>, nested record → struct. Packed token
arrays (``bytes`` holding little-endian int32 ids / float32 logprobs, ``records.PACKED_FIELDS``) → list<int32> /
list<float32>; ``BatchRecord.trajectory`` (a single-object-encoded Trajectory) → struct of the Trajectory's
columns; other ``bytes`` (a dead letter's original key and value) → binary, as received. So a trajectory's
``segments`` is list<struct<parent, tokens list<int32>, trainable, logprobs list<float32>, …>>.

Pure: pyarrow and the codec, no Kafka.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from clawbase.errors import CodecError, CorruptRecordError
from consumers.analytics.records import NESTED_RECORDS, PACKED_FIELDS, EventLogError, short_name
from schemas.codec import AvroCodec, default_codec

ENVELOPE: tuple[pa.Field, ...] = (
    pa.field("topic", pa.string(), nullable=False),
    pa.field("partition", pa.int32(), nullable=False),
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("timestamp", pa.timestamp("ms", tz="UTC")),
    pa.field("key", pa.string()),
)
TRAILER: tuple[pa.Field, ...] = (pa.field("error", pa.string()), pa.field("raw_value", pa.binary()))
_PRIMITIVES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "long": pa.int64(),
    "int": pa.int32(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "bytes": pa.binary(),
    "null": pa.null(),
}
_ARROW_OF_DTYPE: dict[str, pa.DataType] = {"int32": pa.int32(), "float32": pa.float32()}


class ArrowLayout:
    """The Arrow schema of one value schema's export, and the conversion of records into its rows."""

    def __init__(self, schema_name: str, codec: AvroCodec | None = None) -> None:
        self.codec = codec or default_codec()
        entry = self.codec.entry(schema_name)
        self.full_name = entry.name
        self.name = short_name(entry.name)
        self._named: dict[str, Any] = {}
        value_fields = self._struct(entry.parsed)
        clash = {f.name for f in value_fields} & {f.name for f in ENVELOPE + TRAILER}
        if clash:
            raise EventLogError(f"{self.name} has fields named like export's own columns: {', '.join(sorted(clash))}")
        self.schema = pa.schema([*ENVELOPE, *value_fields, *TRAILER])
        self._value_names = [f.name for f in value_fields]

    # ---- schema ----------------------------------------------------------------------------------------------------
    def _struct(self, record: dict[str, Any]) -> list[pa.Field]:
        self._named[record["name"]] = record
        return [pa.field(f["name"], self._type(f["type"], record["name"], f["name"])) for f in record["fields"]]

    def _type(self, avro: Any, owner: str, fname: str) -> pa.DataType:
        if isinstance(avro, list):
            branches = [b for b in avro if b != "null"]
            if len(branches) != 1:
                raise EventLogError(f"{owner}.{fname}: unions other than [null, T] have no Arrow column type here")
            return self._type(branches[0], owner, fname)
        if isinstance(avro, str) and avro in self._named:
            avro = self._named[avro]
        kind = avro["type"] if isinstance(avro, dict) else avro
        if kind == "bytes":
            dtype = PACKED_FIELDS.get(owner, {}).get(fname)
            if dtype is not None:
                return pa.list_(_ARROW_OF_DTYPE[np.dtype(dtype).name])
            nested = NESTED_RECORDS.get((owner, fname))
            if nested is not None:
                return pa.struct(self._struct(self.codec.entry(nested).parsed))
            return pa.binary()
        if kind in _PRIMITIVES:
            return _PRIMITIVES[kind]
        if kind == "enum":
            self._named[avro["name"]] = avro
            return pa.string()
        if kind == "record":
            return pa.struct(self._struct(avro))
        if kind == "array":
            return pa.list_(self._type(avro["items"], owner, fname))
        if kind == "map":
            return pa.map_(pa.string(), self._type(avro["values"], owner, fname))
        raise EventLogError(f"{owner}.{fname}: Avro type {kind!r} has no Arrow column type here")

    # ---- rows ------------------------------------------------------------------------------------------------------
    def row(
        self, topic: str, partition: int, offset: int, timestamp_ms: int | None, key: bytes | None, value: bytes | None
    ) -> dict[str, Any]:
        """One row; an undecodable value (or a record of another schema) gives ``error`` + ``raw_value``."""
        row: dict[str, Any] = {
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "timestamp": timestamp_ms,
            # Every clawstream key is a UTF-8 id; anything else is kept readable rather than dropped.
            "key": None if key is None else key.decode("utf-8", "backslashreplace"),
        }
        if value is None:
            return row
        try:
            row.update(self.value(value))
        except CodecError as exc:
            row.update(error=f"{type(exc).__name__}: {exc}", raw_value=value)
        return row

    def value(self, data: bytes, expected: str | None = None) -> dict[str, Any]:
        """The value columns of one record (raises :class:`CodecError` on bytes that are not a ``expected``)."""
        name, record = self.codec.decode(data, expected=expected or self.full_name)
        return self._record(record, self.codec.entry(name).parsed)

    def _record(self, record: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
        owner = schema["name"]
        return {f["name"]: self._convert(record.get(f["name"]), f["type"], owner, f["name"]) for f in schema["fields"]}

    def _convert(self, value: Any, avro: Any, owner: str, fname: str) -> Any:
        if value is None:
            return None
        if isinstance(avro, list):
            return self._convert(value, next(b for b in avro if b != "null"), owner, fname)
        if isinstance(avro, str) and avro in self._named:
            avro = self._named[avro]
        kind = avro["type"] if isinstance(avro, dict) else avro
        if kind == "bytes":
            dtype = PACKED_FIELDS.get(owner, {}).get(fname)
            if dtype is not None:
                if len(value) % dtype.itemsize:
                    raise CorruptRecordError(f"{owner}.{fname}: {len(value)} bytes is no whole number of {dtype.name}")
                return np.frombuffer(value, dtype=dtype)
            nested = NESTED_RECORDS.get((owner, fname))
            return self.value(value, expected=nested) if nested is not None else bytes(value)
        if kind == "record":
            return self._record(value, avro)
        if kind == "array":
            return [self._convert(item, avro["items"], owner, fname) for item in value]
        if kind == "map":
            return {k: self._convert(v, avro["values"], owner, fname) for k, v in value.items()}
        return value

    def table(self, rows: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(rows, schema=self.schema)
