"""``clawstream export TOPIC --format jsonl|parquet --out PATH``: a topic's records over an offset or time range, as
a file a researcher opens in pandas, DuckDB or jq.

Topics: any catalog topic under any prefix (like ``tail``); read-only, partitions assigned by hand, nothing
committed. Range: ``--from [P:]N`` / ``--to [P:]N`` offsets (``--to`` exclusive; ``--from P:N`` alone reads only
the partitions it names) or ``--since`` / ``--until`` times (``--until`` exclusive; ``offsets_for_times``);
default: everything the topic holds when the export starts. ``--rollout ID`` keeps one rollout's records.

Formats:

* ``jsonl`` — the lines of ``clawstream tail`` with token arrays as lists (``--tokens count`` for counts;
  ``--model DIR`` adds decoded text); an undecodable record is an error line with its bytes in base64 (``raw``).
* ``parquet`` — typed columns (``consumers/analytics/columns.py``): envelope, one column per value field, token
  arrays as list<int32>/list<float32>, nested records as structs (a trajectory's segments: list<struct>; a batch
  record's trajectory: struct), maps as map<string, T>; ``error`` + ``raw_value`` keep undecodable records.
  Written in row groups of ``--row-group`` records (zstd).

The file is written next to ``--out`` under a temporary name and renamed when complete: an interrupted or failed
export leaves nothing behind (and an existing file needs ``--force``). Progress goes to stderr.

Run: ``clawstream export TOPIC --out PATH [options]`` or ``python -m consumers.analytics export ...``; ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from clawbase.errors import ClawstreamError
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings
from consumers.analytics.reader import install_stop_signals, offsets_at, open_reader, read_range, watermarks
from consumers.analytics.records import (
    ALL_PARTITIONS,
    TOKEN_MODES,
    DecodeOptions,
    EventLogError,
    RolloutFilter,
    decode_message,
    is_error,
    json_line,
    load_tokenizer,
    message_timestamp,
    parse_offsets,
    parse_time_ms,
    start_offsets,
)

Format = Literal["jsonl", "parquet"]
FORMATS: tuple[str, ...] = ("jsonl", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
ROW_GROUP = 2000
_ROW_GROUP_BYTES = 64 * 1024 * 1024  # raw value bytes buffered before a row group is written, whatever the count


@dataclass(frozen=True)
class ExportRequest:
    topic: str
    out: Path
    format: Format
    from_offsets: dict[int, int] | None = None
    to_offsets: dict[int, int] | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    rollouts: frozenset[str] = frozenset()
    decode: DecodeOptions = field(default_factory=lambda: DecodeOptions(tokens="list"))
    schema: str | None = None  # parquet: the value schema (default: the catalog's for the topic)
    force: bool = False
    row_group: int = ROW_GROUP


@dataclass
class ExportSummary:
    topic: str = ""
    path: Path | None = None
    records: int = 0
    undecodable: int = 0
    offsets_total: int = 0
    offsets_done: int = 0
    bytes_read: int = 0
    seconds: float = 0.0


def format_for(out: Path, given: str | None) -> Format:
    """``--format``, else from the file name; a clear error when neither says."""
    fmt = given or _SUFFIXES.get(out.suffix.lower())
    if fmt not in FORMATS:
        raise EventLogError(f"--format jsonl|parquet is needed: {out.name} does not end in .jsonl or .parquet")
    return fmt  # type: ignore[return-value]


def plan_range(
    request: ExportRequest, marks: dict[int, tuple[int, int]], at_time: Callable[[int], dict[int, int]]
) -> tuple[dict[int, int], dict[int, int]]:
    """``(starts, ends)`` per partition from the request's offsets or times; ``at_time(ms)`` looks offsets up."""
    if request.from_offsets is not None:
        starts = start_offsets(request.from_offsets, marks, flag="--from")
    elif request.since_ms is not None:
        starts = at_time(request.since_ms)
    else:
        starts = {p: low for p, (low, _) in marks.items()}
    ends = {p: marks[p][1] for p in starts}
    if request.to_offsets is not None:
        spec = request.to_offsets
        bounded = start_offsets(spec, marks, flag="--to")
        ends.update({p: off for p, off in bounded.items() if p in ends and (p in spec or ALL_PARTITIONS in spec)})
    elif request.until_ms is not None:
        ends.update({p: off for p, off in at_time(request.until_ms).items() if p in ends})
    return starts, {p: max(ends[p], starts[p]) for p in starts}


class _Jsonl:
    def __init__(self, path: Path, decode: DecodeOptions) -> None:
        self.handle: TextIO = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.decode = decode

    def add(self, msg: Any) -> str | None:
        """Write one record; its error when it did not decode."""
        record = decode_message(msg, self.decode, keep_raw=True)
        self.handle.write(json_line(record) + "\n")
        return record["error"] if is_error(record) else None

    def close(self) -> None:
        self.handle.close()


class _Parquet:
    def __init__(self, path: Path, schema_name: str, row_group: int) -> None:
        import pyarrow.parquet as pq

        from consumers.analytics.columns import ArrowLayout

        self.layout = ArrowLayout(schema_name)
        self.writer = pq.ParquetWriter(str(path), self.layout.schema, compression="zstd")
        self.rows: list[dict[str, Any]] = []
        self.row_group, self.buffered = row_group, 0

    def add(self, msg: Any) -> str | None:
        value = msg.value()
        row = self.layout.row(msg.topic(), msg.partition(), msg.offset(), message_timestamp(msg), msg.key(), value)
        self.rows.append(row)
        self.buffered += len(value or b"")
        if len(self.rows) >= self.row_group or self.buffered >= _ROW_GROUP_BYTES:
            self.flush()
        return row.get("error")

    def flush(self) -> None:
        if self.rows:
            self.writer.write_table(self.layout.table(self.rows))
            self.rows, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        self.writer.close()


def _parquet_schema(request: ExportRequest, spec_schema: str | None) -> str:
    name = request.schema or spec_schema
    if name is None:
        from schemas.codec import default_codec

        raise EventLogError(
            f"{request.topic} is not a catalog topic: give its value schema with --schema NAME "
            f"({', '.join(n.rpartition('.')[2] for n in default_codec().names)})"
        )
    return name


def export(
    settings: KafkaSettings,
    request: ExportRequest,
    *,
    progress: Callable[[ExportSummary], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    on_undecodable: Callable[[str], None] | None = None,
) -> ExportSummary:
    """Write the request's records to ``request.out`` atomically; return what was written. Each record that does
    not decode goes to ``on_undecodable`` as ``topic[partition]@offset: reason`` (and into the file)."""
    started = time.monotonic()
    out = request.out
    if out.exists() and not request.force:
        raise EventLogError(f"{out} exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise EventLogError(f"{out.parent} is not a directory")
    consumer, ref = open_reader(settings, request.topic)
    summary = ExportSummary(topic=ref.name, path=out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        marks = watermarks(consumer, ref.name)
        starts, ends = plan_range(request, marks, lambda ms: offsets_at(consumer, ref.name, ms, marks))
        summary.offsets_total = sum(ends[p] - starts[p] for p in starts)
        if request.format == "parquet":  # a schema problem shows before any record is read
            writer: _Jsonl | _Parquet = _Parquet(
                tmp, _parquet_schema(request, ref.spec and ref.spec.value_schema), request.row_group
            )
        else:
            writer = _Jsonl(tmp, request.decode)
        done = dict(starts)
        filt = RolloutFilter(request.rollouts, ref)
        last_report = time.monotonic()
        try:
            for msg in read_range(consumer, ref.name, starts, ends, stop=stop):
                done[msg.partition()] = msg.offset() + 1
                summary.bytes_read += len(msg.value() or b"")
                if filt.by_key(msg.key()) is False:
                    continue
                if filt and filt.by_key(msg.key()) is None and not filt.matches(decode_message(msg)):
                    continue
                error = writer.add(msg)
                summary.records += 1
                if error is not None:  # kept in the file with its bytes, and reported
                    summary.undecodable += 1
                    if on_undecodable is not None:
                        on_undecodable(f"{ref.name}[{msg.partition()}]@{msg.offset()}: {error}")
                if progress is not None and time.monotonic() - last_report >= 1.0:
                    summary.offsets_done = sum(done[p] - starts[p] for p in starts)
                    progress(summary)
                    last_report = time.monotonic()
        finally:
            writer.close()
        if stop():
            raise EventLogError(f"export interrupted after {summary.records} records; {out} not written")
        summary.offsets_done = summary.offsets_total
        os.replace(tmp, out)
    finally:
        consumer.close()
        tmp.unlink(missing_ok=True)
    summary.seconds = time.monotonic() - started
    return summary


def build_parser(prog: str = "clawstream export") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a topic's records over an offset or time range to JSON lines or Parquet (atomically).",
        epilog="TOPIC as for `clawstream tail` (catalog name, with or without 'clawstream.', or a full name).\n"
        "examples:\n"
        "  clawstream export trajectories --out run.parquet\n"
        "  clawstream export calls --since 2026-09-21T10:00Z --until 1h --out calls.jsonl\n"
        "  clawstream export calls --from 3:100 --to 3:200 --format jsonl --out p3.jsonl\n"
        "  duckdb -c \"select harness, avg(reward) from 'run.parquet' group by 1\"\n"
        "columns and types: docs/event_log.md",
    )
    parser.add_argument("topic", metavar="TOPIC", help="the topic to export")
    parser.add_argument("--out", "-o", type=Path, required=True, metavar="PATH", help="the file to write")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="jsonl or parquet (default: from the --out suffix: .jsonl / .parquet)",
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--from",
        dest="from_offsets",
        action="append",
        metavar="[P:]N",
        help="start at offset N of every partition, or of partition P (then only the partitions "
        "named are read); a negative N counts back from the end",
    )
    start.add_argument(
        "--since",
        metavar="TIME",
        help="start at the first record at or after TIME (epoch ms, ISO-8601, or 15m / 2h ago)",
    )
    end = parser.add_mutually_exclusive_group()
    end.add_argument(
        "--to",
        dest="to_offsets",
        action="append",
        metavar="[P:]N",
        help="stop before offset N of every partition, or of partition P (exclusive)",
    )
    end.add_argument("--until", metavar="TIME", help="stop before the first record at or after TIME (exclusive)")
    parser.add_argument(
        "--rollout", action="append", default=[], metavar="ID", help="only records of this rollout (repeat for several)"
    )
    parser.add_argument(
        "--tokens",
        choices=TOKEN_MODES,
        default="list",
        help="jsonl: token ids and logprobs as lists or as counts (default: list)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="jsonl: model directory whose tokenizer adds F_text beside each token-id field F",
    )
    parser.add_argument(
        "--schema",
        default=None,
        metavar="NAME",
        help="parquet: value schema of a topic outside the catalog (e.g. Trajectory)",
    )
    parser.add_argument(
        "--row-group",
        type=int,
        default=ROW_GROUP,
        metavar="N",
        help=f"parquet: records per row group (default {ROW_GROUP}; fewer when records are large)",
    )
    parser.add_argument("--force", action="store_true", help="replace PATH if it exists")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    add_kafka_arguments(parser)
    return parser


def request_from_args(args: argparse.Namespace) -> ExportRequest:
    if args.row_group < 1:
        raise EventLogError("--row-group must be >= 1")
    fmt = format_for(args.out, args.format)
    if fmt == "parquet" and args.model:
        raise EventLogError("--model adds decoded text to jsonl exports; Parquet keeps the token ids")
    return ExportRequest(
        topic=args.topic,
        out=args.out,
        format=fmt,
        from_offsets=parse_offsets(args.from_offsets, flag="--from") if args.from_offsets else None,
        to_offsets=parse_offsets(args.to_offsets, flag="--to") if args.to_offsets else None,
        since_ms=parse_time_ms(args.since) if args.since is not None else None,
        until_ms=parse_time_ms(args.until) if args.until is not None else None,
        rollouts=frozenset(args.rollout),
        decode=DecodeOptions(tokens=args.tokens, text=load_tokenizer(args.model) if args.model else None),
        schema=args.schema,
        force=args.force,
        row_group=args.row_group,
    )


def _progress_printer(stream: TextIO) -> Callable[[ExportSummary], None]:
    def report(s: ExportSummary) -> None:
        pct = 100.0 * s.offsets_done / s.offsets_total if s.offsets_total else 100.0
        stream.write(
            f"export: {pct:5.1f}% of {s.offsets_total} offsets, {s.records} records, {s.bytes_read / 1e6:.1f} MB read\n"
        )
        stream.flush()

    return report


def main(argv: list[str] | None = None, prog: str = "clawstream export") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        request = request_from_args(args)
        settings = kafka_settings(args)
        stopping, restore = install_stop_signals()
        try:
            summary = export(
                settings,
                request,
                stop=stopping.is_set,
                progress=None if args.quiet else _progress_printer(sys.stderr),
                on_undecodable=lambda line: print(f"export: undecodable {line}", file=sys.stderr, flush=True),
            )
        finally:
            restore()
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        bad = f" ({summary.undecodable} undecodable, kept with their bytes)" if summary.undecodable else ""
        size = summary.path.stat().st_size if summary.path else 0
        print(
            f"export: wrote {summary.records} records{bad} of {summary.topic} to {summary.path} "
            f"({size / 1e6:.2f} MB, {request.format}) in {summary.seconds:.1f}s",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m consumers.analytics.export"))
