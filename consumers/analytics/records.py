"""Any record of the event log as a JSON-ready dict: the decoding shared by tail, export, dashboards and replay.

What it does, for a record of any catalog topic (and any topic holding the project's Avro records):

* :func:`resolve_topic` turns what a person types (``calls``, ``clawstream.calls``, ``t-1a2b.clawstream.calls``)
  into the full topic name on the broker and its catalog entry (``schemas/topics.py``), with or without a prefix.
* :func:`decode_parts` / :func:`decode_message` decode one record into ``{"topic", "partition", "offset",
  "timestamp", "time", "key", "schema", "value"}``. Packed token ids (``int32``) and logprobs (``float32``) become
  their counts (``tokens="count"``, the default) or lists (``tokens="list"``); with a tokenizer
  (:func:`load_tokenizer` over a model directory, ``--model``) every token-id field ``F`` gets a sibling ``F_text``
  with the decoded text. A nested single-object-encoded record (``BatchRecord.trajectory``) is decoded in place;
  other bytes become ``{"base64", "bytes"}``. A record that cannot be decoded becomes an *error record*
  (``"error"`` and ``"where": "topic[partition]@offset"`` instead of ``"schema"``/``"value"``); decoding never
  raises on bad bytes.
* :class:`RolloutFilter` selects the records of some rollouts: by key on rollout-keyed topics (no decoding needed),
  by the record's rollout ids elsewhere (``batches``: the record's and its trajectory's ``rollout_id``).
* :func:`parse_time_ms`, :func:`parse_offsets` and :func:`start_offsets` read the ``--since``/``--offset`` style
  arguments of the tools; :func:`json_line` writes one jq-friendly line.

Topics: any (read-only). Pure: no Kafka client import; :func:`decode_message` takes any object shaped like
confluent-kafka's ``Message``. Run through ``clawstream tail`` / ``clawstream export`` (docs/event_log.md).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from clawbase.errors import ClawstreamError, CodecError
from schemas.codec import MARKER, AvroCodec, default_codec
from schemas.events import ALL_EVENTS, TreeSegment
from schemas.topics import BY_NAME, TopicSpec

TokenMode = Literal["count", "list"]
TOKEN_MODES: tuple[str, ...] = ("count", "list")
CATALOG_PREFIX = "clawstream."
# Kafka's own rule for topic names (kafka.common.internals.Topic): legal characters and length.
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

# Packed little-endian arrays inside ``bytes`` fields, by Avro record full name → field → dtype. Taken from the
# typed events, so a new packed field there is shown here without a second list to keep in step.
PACKED_FIELDS: dict[str, dict[str, np.dtype]] = {
    **{f"io.clawstream.{cls.SCHEMA}": dict(cls.PACKED) for cls in ALL_EVENTS if cls.PACKED},
    "io.clawstream.Segment": dict(TreeSegment.PACKED),
}
# ``bytes`` fields that hold a whole single-object-encoded record of a known schema (schemas/*.avsc docs say so).
NESTED_RECORDS: dict[tuple[str, str], str] = {("io.clawstream.BatchRecord", "trajectory"): "io.clawstream.Trajectory"}
# ``bytes`` fields holding a Kafka key: shown as text like the record's own key.
KEY_FIELDS: frozenset[tuple[str, str]] = frozenset({("io.clawstream.DeadLetter", "original_key")})


class EventLogError(ClawstreamError):
    """An argument of the event-log tools is invalid (topic name, time, offsets, model directory)."""


# ---- topics --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TopicRef:
    """A topic as found on the broker: full ``name``, its catalog ``spec`` (None outside the catalog), ``prefix``."""

    name: str
    spec: TopicSpec | None
    prefix: str = ""

    @property
    def keyed_by_rollout(self) -> bool:
        """Whether the Kafka key is the rollout id (so a rollout filter needs no decoding)."""
        return self.spec is not None and self.spec.key == "rollout_id"


def resolve_topic(name: str, prefix: str = "") -> TopicRef:
    """The topic a person means by ``name``.

    ``calls`` and ``clawstream.calls`` are catalog names: ``prefix`` (``--topic-prefix``) goes in front. A name that
    ends in a catalog name after something else (``t-1a2b.clawstream.calls``) is already a full name: used as is,
    whatever ``prefix`` says. Anything else is a topic outside the catalog (a Faust internal topic, say), read as is.
    """
    name = name.strip()
    for candidate in (name, CATALOG_PREFIX + name):
        spec = BY_NAME.get(candidate)
        if spec is not None:
            return TopicRef(_checked(prefix + candidate), spec, prefix)
    for spec in BY_NAME.values():
        if name.endswith(spec.name) and len(name) > len(spec.name):
            return TopicRef(_checked(name), spec, name[: -len(spec.name)])
    return TopicRef(_checked(name), None, "")


def _checked(topic: str) -> str:
    if not _TOPIC_RE.match(topic) or topic in (".", ".."):
        raise EventLogError(
            f"{topic!r} is not a Kafka topic name (letters, digits, '.', '_', '-'; at most 249): give a catalog name "
            "such as calls or clawstream.trajectories (`clawstream topics list`), or a full topic name"
        )
    return topic


def catalog_names() -> list[str]:
    """The catalog's topic names, for help texts."""
    return sorted(BY_NAME)


# ---- times and offsets ---------------------------------------------------------------------------------------------
_DURATION_RE = re.compile(r"^-?\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)(?:\s+ago)?$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_time_ms(text: str, *, now_ms: int | None = None) -> int:
    """A point in time as epoch milliseconds (UTC), from what a person types.

    Accepted: epoch milliseconds (``1790000000000``); ISO-8601 (``2026-09-21``, ``2026-09-21T10:00:00Z``,
    ``…+02:00``; without an offset it is UTC, as every timestamp in the log); a duration before now (``15m``,
    ``2h ago``, ``-1d``; units ms, s, m, h, d).
    """
    raw = text.strip()
    if re.fullmatch(r"\d+", raw):
        value = int(raw)
        if 10**9 <= value < 10**11:  # 2001-5138 read as seconds, 1970-1973 as ms: almost surely seconds
            raise EventLogError(f"--since/--until {raw} looks like epoch seconds; give milliseconds ({value * 1000})")
        return value
    match = _DURATION_RE.match(raw)
    if match:
        now = now_ms if now_ms is not None else int(datetime.now(UTC).timestamp() * 1000)
        return now - int(float(match.group(1)) * _UNIT_MS[match.group(2)])
    try:
        parsed = datetime.fromisoformat(raw)
    except ValueError:
        raise EventLogError(
            f"cannot read {text!r} as a time: give epoch milliseconds (1790000000000), ISO-8601 "
            "(2026-09-21T10:00:00Z; no offset means UTC) or a duration before now (15m, 2h ago)"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def iso_ms(timestamp_ms: int | None) -> str | None:
    """UTC ISO-8601 with milliseconds (``2026-09-21T10:00:00.123Z``), None for a missing timestamp."""
    if timestamp_ms is None or timestamp_ms < 0:
        return None
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=timestamp_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


ALL_PARTITIONS = -1  # key of an offset given for every partition


def parse_offsets(values: Iterable[str], *, flag: str = "--offset") -> dict[int, int]:
    """``N`` (every partition) or ``P:N`` (partition P) values → ``{partition or ALL_PARTITIONS: offset}``.

    A negative N counts back from the end of the partition (``-10``: the last ten offsets).
    """
    out: dict[int, int] = {}
    for value in values:
        part, sep, offset = value.strip().rpartition(":")
        try:
            partition = int(part) if sep else ALL_PARTITIONS
            number = int(offset)
        except ValueError:
            raise EventLogError(
                f"{flag} {value!r}: give OFFSET (every partition) or PARTITION:OFFSET, e.g. {flag} 3:17; a negative "
                "OFFSET counts back from the end"
            ) from None
        if sep and partition < 0:
            raise EventLogError(f"{flag} {value!r}: partition numbers start at 0")
        out[partition] = number
    return out


def start_offsets(spec: dict[int, int], marks: dict[int, tuple[int, int]], *, flag: str = "--offset") -> dict[int, int]:
    """Where to start in each partition, given ``parse_offsets`` output and ``{partition: (low, high)}`` watermarks.

    With an every-partition value every partition is read (a per-partition value wins for its partition); without
    one, only the partitions named. Offsets are clamped into ``[low, high]``: below ``low`` the records are gone
    (retention), at ``high`` there is nothing yet.
    """
    unknown = sorted(p for p in spec if p != ALL_PARTITIONS and p not in marks)
    if unknown:
        raise EventLogError(f"{flag}: no partition {unknown[0]}; the topic has partitions 0-{max(marks, default=0)}")
    chosen = marks if ALL_PARTITIONS in spec else {p: marks[p] for p in spec}
    out: dict[int, int] = {}
    for partition, (low, high) in chosen.items():
        offset = spec.get(partition, spec.get(ALL_PARTITIONS, 0))
        out[partition] = min(max(high + offset if offset < 0 else offset, low), high)
    return out


# ---- tokens --------------------------------------------------------------------------------------------------------
class TokenDecoder(Protocol):
    def __call__(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class TokenText:
    """Token ids → text with a model directory's tokenizer (special tokens kept: they show the chat structure)."""

    model_dir: Path
    _decode: Callable[[list[int]], str] = field(repr=False, compare=False)

    def __call__(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids])


def load_tokenizer(model_dir: str | Path) -> TokenText:
    """The tokenizer of a Hugging Face model directory (``tokenizer.json``; the project's models have one)."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise EventLogError(
            f"--model {model_dir}: no tokenizer.json there (a Hugging Face model directory, e.g. "
            "from `clawstream model init --out DIR`)"
        )
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise EventLogError("--model needs the `tokenizers` package: pip install 'clawstream[ml]'") from exc
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise EventLogError(f"--model {model_dir}: cannot load {path.name}: {exc}") from exc
    size = tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(ids: list[int]) -> str:
        # Ids outside the vocabulary (a different model's records) are shown, not dropped silently.
        if any(i < 0 or i >= size for i in ids):
            return "".join(
                tokenizer.decode([i], skip_special_tokens=False) if 0 <= i < size else f"<?{i}>" for i in ids
            )
        return tokenizer.decode(ids, skip_special_tokens=False)

    return TokenText(model_dir, decode)


# ---- decoding ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeOptions:
    """How token arrays are shown: ``tokens`` "count" (lengths) or "list"; ``text`` adds ``F_text`` for token ids."""

    tokens: TokenMode = "count"
    text: TokenDecoder | None = None

    def __post_init__(self) -> None:
        if self.tokens not in TOKEN_MODES:
            raise EventLogError(f"tokens must be one of {', '.join(TOKEN_MODES)}, not {self.tokens!r}")


def short_name(full: str) -> str:
    """``io.clawstream.CallEvent`` → ``CallEvent``."""
    return full.rpartition(".")[2]


def decode_value(
    data: bytes, options: DecodeOptions = DecodeOptions(), codec: AvroCodec | None = None
) -> tuple[str, dict[str, Any]]:
    """``(schema short name, JSON-ready value)``; raises :class:`CodecError` on bytes that are no known record."""
    codec = codec or default_codec()
    name, record = codec.decode(data)
    return short_name(name), _Converter(codec, options).record(record, codec.entry(name).parsed)


def key_text(key: bytes | None) -> str | dict[str, Any] | None:
    """A Kafka key as text (every clawstream key is a UTF-8 id), else ``{"base64", "bytes"}``."""
    if key is None:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return _opaque(key)


def where(topic: str, partition: int, offset: int) -> str:
    """``topic[partition]@offset``, as the services log positions."""
    return f"{topic}[{partition}]@{offset}"


def decode_parts(
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int | None,
    key: bytes | None,
    value: bytes | None,
    options: DecodeOptions = DecodeOptions(),
    codec: AvroCodec | None = None,
    *,
    keep_raw: bool = False,
) -> dict[str, Any]:
    """One record as ``{"topic", "partition", "offset", "timestamp", "time", "key", "schema", "value"}``.

    A tombstone (no value) has ``"value": null`` and ``"schema": null``. Bytes that do not decode give an error
    record: ``"error"`` (what went wrong) and ``"where"`` instead of ``"schema"``/``"value"``, plus ``"bytes"`` and,
    with ``keep_raw``, ``"raw"`` (the value in base64, so an export loses nothing).
    """
    out: dict[str, Any] = {
        "topic": topic,
        "partition": partition,
        "offset": offset,
        "timestamp": timestamp_ms if timestamp_ms is not None and timestamp_ms >= 0 else None,
        "time": iso_ms(timestamp_ms),
        "key": key_text(key),
    }
    if value is None:
        return {**out, "schema": None, "value": None}
    try:
        schema, decoded = decode_value(value, options, codec)
    except CodecError as exc:
        bad = {
            **out,
            "error": f"{type(exc).__name__}: {exc}",
            "where": where(topic, partition, offset),
            "bytes": len(value),
        }
        return {**bad, "raw": base64.b64encode(value).decode("ascii")} if keep_raw else bad
    return {**out, "schema": schema, "value": decoded}


def message_timestamp(msg: Any) -> int | None:
    """A consumed message's timestamp in ms, None when the broker has none (confluent-kafka gives type 0)."""
    kind, ts = msg.timestamp()
    return ts if kind != 0 and ts >= 0 else None


def decode_message(
    msg: Any, options: DecodeOptions = DecodeOptions(), codec: AvroCodec | None = None, *, keep_raw: bool = False
) -> dict[str, Any]:
    """:func:`decode_parts` of a confluent-kafka ``Message`` (duck-typed: no Kafka import here)."""
    return decode_parts(
        msg.topic(),
        msg.partition(),
        msg.offset(),
        message_timestamp(msg),
        msg.key(),
        msg.value(),
        options,
        codec,
        keep_raw=keep_raw,
    )


def is_error(record: dict[str, Any]) -> bool:
    return "error" in record


def json_line(record: dict[str, Any]) -> str:
    """One line of JSON (no NaN/Infinity literals: :func:`decode_parts` already wrote those as strings)."""
    return json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _opaque(data: bytes) -> dict[str, Any]:
    return {"base64": base64.b64encode(data).decode("ascii"), "bytes": len(data)}


def _float(value: float) -> float | str:
    # jq and most JSON readers refuse NaN/Infinity literals; the string keeps what was there.
    return value if math.isfinite(value) else str(value).replace("inf", "Infinity").replace("nan", "NaN")


class _Converter:
    """Walks a decoded record alongside its (fastavro-parsed) schema, turning it JSON-ready."""

    def __init__(self, codec: AvroCodec, options: DecodeOptions) -> None:
        self.codec = codec
        self.options = options
        self.named: dict[str, Any] = {}

    def record(self, value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
        name = schema["name"]
        self.named.setdefault(name, schema)
        packed = PACKED_FIELDS.get(name, {})
        out: dict[str, Any] = {}
        for fld in schema["fields"]:
            fname = fld["name"]
            item = value.get(fname)
            if fname in packed and isinstance(item, bytes | bytearray | memoryview):
                self._packed(out, fname, bytes(item), packed[fname])
            elif (name, fname) in NESTED_RECORDS and isinstance(item, bytes | bytearray):
                out[fname] = self._nested(bytes(item))
            elif (name, fname) in KEY_FIELDS and isinstance(item, bytes | bytearray):
                out[fname] = key_text(bytes(item))
            else:
                out[fname] = self.any(item, fld["type"])
        return out

    def _packed(self, out: dict[str, Any], fname: str, data: bytes, dtype: np.dtype) -> None:
        if len(data) % dtype.itemsize:
            out[fname] = {**_opaque(data), "error": f"{len(data)} bytes is no whole number of {dtype.name}"}
            return
        array = np.frombuffer(data, dtype=dtype)
        if self.options.tokens == "count":
            out[fname] = int(array.size)
        elif array.dtype.kind == "f":
            out[fname] = [_float(float(x)) for x in array.tolist()]
        else:
            out[fname] = array.tolist()
        if self.options.text is not None and array.dtype.kind == "i":
            out[f"{fname}_text"] = self.options.text(array.tolist())

    def _nested(self, data: bytes) -> Any:
        try:
            return decode_value(data, self.options, self.codec)[1]
        except CodecError as exc:
            return {**_opaque(data), "error": f"{type(exc).__name__}: {exc}"}

    def any(self, value: Any, schema: Any) -> Any:
        if value is None:
            return None
        if isinstance(schema, list):  # a union: the branch that fits (ours are all ["null", T])
            branches = [s for s in schema if s != "null"]
            return self.any(value, branches[0]) if len(branches) == 1 else self.generic(value)
        if isinstance(schema, str):
            schema = self.named.get(schema, schema)
        kind = schema.get("type") if isinstance(schema, dict) else schema
        if kind == "record" and isinstance(value, dict):
            return self.record(value, schema)
        if kind == "array" and isinstance(value, list):
            return [self.any(item, schema["items"]) for item in value]
        if kind == "map" and isinstance(value, dict):
            return {k: self.any(v, schema["values"]) for k, v in value.items()}
        if kind == "enum":
            self.named.setdefault(schema["name"], schema)
        return self.generic(value)

    def generic(self, value: Any) -> Any:
        if isinstance(value, float):
            return _float(value)
        if isinstance(value, bytes | bytearray):
            data = bytes(value)
            # maybe a record of ours (a dead letter's original value), in either wire format
            if data[:2] == MARKER or (data[:1] == b"\x00" and len(data) > 5):
                try:
                    return decode_value(data, self.options, self.codec)[1]
                except CodecError:
                    pass
            return _opaque(data)
        if isinstance(value, dict):
            return {k: self.generic(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.generic(v) for v in value]
        return value


# ---- filters -------------------------------------------------------------------------------------------------------
def rollout_ids(record: dict[str, Any], ref: TopicRef | None = None) -> set[str]:
    """The rollout ids a decoded record is about: its key on rollout-keyed topics, the value's ``rollout_id``, and
    its nested trajectory's (``batches``)."""
    ids: set[str] = set()
    if (ref is None or ref.keyed_by_rollout) and isinstance(record.get("key"), str):
        ids.add(record["key"])
    value = record.get("value")
    if isinstance(value, dict):
        for holder in (value, value.get("trajectory")):
            if isinstance(holder, dict) and isinstance(holder.get("rollout_id"), str):
                ids.add(holder["rollout_id"])
    return ids


@dataclass(frozen=True)
class RolloutFilter:
    """Records about any of ``ids`` (``--rollout``); an empty filter lets everything through."""

    ids: frozenset[str]
    ref: TopicRef

    def __bool__(self) -> bool:
        return bool(self.ids)

    def by_key(self, key: bytes | None) -> bool | None:
        """Decided from the key alone (True/False) on rollout-keyed topics, else None (decode and call ``matches``)."""
        if not self.ids:
            return True
        if not self.ref.keyed_by_rollout:
            return None
        return key is not None and key.decode("utf-8", "replace") in self.ids

    def matches(self, record: dict[str, Any]) -> bool:
        if not self.ids:
            return True
        if self.ref.keyed_by_rollout:
            return record.get("key") in self.ids
        return not self.ids.isdisjoint(rollout_ids(record, self.ref))
