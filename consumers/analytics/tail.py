"""``clawstream tail TOPIC``: the records of any topic as decoded JSON lines, for people and for ``jq``.

Topics: any catalog topic (``calls``, ``clawstream.trajectories``, …) under any prefix, or any topic holding the
project's Avro records; read-only. Partitions are assigned by hand: no consumer group, nothing committed.

Where it starts: the last N records (``-n``, default 10, by timestamp across partitions) like ``tail``;
``--from-beginning``; ``--offset N`` / ``--offset P:N`` (every partition / partition P; negative N counts back
from the end); ``--since TIME`` (epoch ms, ISO-8601 or ``15m``; ``offsets_for_times``). Without ``--follow`` it
stops at the end offsets read at start; with it, it keeps printing new records until Ctrl-C or SIGTERM (both end
cleanly). ``--rollout ID`` keeps one rollout's records (by key, or by the records' rollout ids on topics keyed by
something else, such as batches); with a start option ``-n`` is the most records to print.

Each line: ``{"topic", "partition", "offset", "timestamp", "time", "key", "schema", "value"}``; token arrays as
counts (``--tokens list`` for the ids), ``--model DIR`` adds the decoded text; an undecodable record is a line with
``"error"`` and ``"where": "topic[partition]@offset"`` (see ``consumers/analytics/records.py``).

Run: ``clawstream tail TOPIC [options]`` or ``python -m consumers.analytics tail TOPIC [options]``; ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from confluent_kafka import Consumer, Message

from clawbase.errors import ClawstreamError
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings
from consumers.analytics.reader import install_stop_signals, offsets_at, open_reader, read_range, watermarks
from consumers.analytics.records import (
    TOKEN_MODES,
    DecodeOptions,
    RolloutFilter,
    TopicRef,
    catalog_names,
    decode_message,
    is_error,
    json_line,
    load_tokenizer,
    parse_offsets,
    parse_time_ms,
    start_offsets,
)

DEFAULT_LAST = 10


@dataclass(frozen=True)
class TailRequest:
    """What to print. At most one of ``from_beginning``, ``offsets`` and ``since_ms``; none: the last ``count``."""

    topic: str
    from_beginning: bool = False
    offsets: dict[int, int] | None = None
    since_ms: int | None = None
    count: int | None = None  # the last N without a start option (default 10); else the most to print (default all)
    follow: bool = False
    rollouts: frozenset[str] = frozenset()
    decode: DecodeOptions = field(default_factory=DecodeOptions)

    @property
    def last_mode(self) -> bool:
        return not self.from_beginning and self.offsets is None and self.since_ms is None


@dataclass
class TailSummary:
    topic: str = ""
    printed: int = 0
    undecodable: int = 0
    seconds: float = 0.0


class _Printer:
    """Writes lines, counts them, and turns a closed pipe (``| head``) into a clean stop."""

    def __init__(self, out: TextIO, summary: TailSummary, limit: int | None, follow: bool) -> None:
        self.out, self.summary, self.limit, self.follow = out, summary, limit, follow
        self.closed = False

    @property
    def full(self) -> bool:
        return self.closed or (self.limit is not None and self.summary.printed >= self.limit)

    def write(self, record: dict[str, Any]) -> None:
        if self.full:
            return
        try:
            self.out.write(json_line(record) + "\n")
            if self.follow:
                self.out.flush()  # a person (or a pipe) is waiting for each new record
        except BrokenPipeError:
            self.closed = True
            return
        self.summary.printed += 1
        self.summary.undecodable += is_error(record)

    def flush(self) -> None:
        try:
            self.out.flush()
        except BrokenPipeError:
            self.closed = True


def _selected(msgs: Iterator[Message], filt: RolloutFilter, decode: DecodeOptions) -> Iterator[dict[str, Any]]:
    """Decoded records that pass the rollout filter (decided by key first, so skipped records are not decoded)."""
    for msg in msgs:
        if filt.by_key(msg.key()) is False:
            continue
        record = decode_message(msg, decode)
        if filt.matches(record):
            yield record


def _last_records(
    consumer: Consumer,
    ref: TopicRef,
    marks: dict[int, tuple[int, int]],
    n: int,
    filt: RolloutFilter,
    decode: DecodeOptions,
    stop: Callable[[], bool],
) -> list[dict[str, Any]]:
    """The last ``n`` matching records by (timestamp, partition, offset): each partition is read backwards in
    growing steps until it gave ``n`` matches or its beginning is reached (commit markers and filtered-out
    records take offsets too, so ``n`` offsets back is not always ``n`` records)."""
    found: dict[int, list[dict[str, Any]]] = {p: [] for p in marks}
    lower = {p: high for p, (_, high) in marks.items()}
    back = dict.fromkeys(marks, n)
    todo = {p for p, (low, high) in marks.items() if high > low and n > 0}
    while todo and not stop():
        starts = {p: max(marks[p][0], lower[p] - back[p]) for p in todo}
        fresh: dict[int, list[dict[str, Any]]] = {p: [] for p in todo}
        for record in _selected(read_range(consumer, ref.name, starts, dict(lower), stop=stop), filt, decode):
            fresh[record["partition"]].append(record)
        for p in todo:
            found[p] = (fresh[p] + found[p])[-n:]
            lower[p], back[p] = starts[p], back[p] * 4
        todo = {p for p in todo if len(found[p]) < n and lower[p] > marks[p][0]}
    merged = [r for records in found.values() for r in records]
    merged.sort(key=lambda r: (r["timestamp"] if r["timestamp"] is not None else -1, r["partition"], r["offset"]))
    return merged[-n:] if n > 0 else []


def tail(
    settings: KafkaSettings, request: TailRequest, out: TextIO, *, stop: Callable[[], bool] = lambda: False
) -> TailSummary:
    """Print ``request``'s records to ``out`` as JSON lines; return what was printed."""
    started = time.monotonic()
    consumer, ref = open_reader(settings, request.topic)
    summary = TailSummary(topic=ref.name)
    filt = RolloutFilter(request.rollouts, ref)
    try:
        marks = watermarks(consumer, ref.name)
        highs = {p: high for p, (_, high) in marks.items()}
        if request.last_mode:
            n = DEFAULT_LAST if request.count is None else request.count
            printer = _Printer(out, summary, None, request.follow)
            for record in _last_records(consumer, ref, marks, n, filt, request.decode, stop):
                printer.write(record)
            printer.flush()
            starts, ends = highs, None
        else:
            printer = _Printer(out, summary, request.count, request.follow)
            if request.from_beginning:
                starts = {p: low for p, (low, _) in marks.items()}
            elif request.offsets is not None:
                starts = start_offsets(request.offsets, marks)
            else:
                assert request.since_ms is not None
                starts = offsets_at(consumer, ref.name, request.since_ms, marks)
            ends = highs
        if request.follow:
            ends = None
        if (request.follow or not request.last_mode) and not printer.full:
            records = _selected(
                read_range(consumer, ref.name, starts, ends, stop=lambda: stop() or printer.full), filt, request.decode
            )
            for record in records:
                printer.write(record)
            printer.flush()
    finally:
        consumer.close()
    summary.seconds = time.monotonic() - started
    return summary


def build_parser(prog: str = "clawstream tail") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print a topic's records as decoded JSON lines (one object per line; jq-friendly).",
        epilog="TOPIC: a catalog name with or without 'clawstream.' ("
        + ", ".join(n.removeprefix("clawstream.") for n in catalog_names())
        + "), under --topic-prefix; or a full topic "
        "name (t-1a2b.clawstream.calls).\nexamples:\n"
        "  clawstream tail trajectories -n 3\n"
        "  clawstream tail calls --rollout r-42 --from-beginning --model ~/.cache/clawstream/models/tiny\n"
        "  clawstream tail metrics --since 15m --follow | jq .value.values\n"
        "details: docs/event_log.md",
    )
    parser.add_argument("topic", metavar="TOPIC", help="the topic to read")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the oldest record of each partition")
    start.add_argument(
        "--offset",
        action="append",
        metavar="[P:]N",
        help="start at offset N of every partition, or of partition P only (repeat for several); "
        "a negative N counts back from the end",
    )
    start.add_argument(
        "--since",
        metavar="TIME",
        help="start at the first record at or after TIME: epoch ms, ISO-8601 (no offset = UTC), or a "
        "duration before now (15m, 2h ago)",
    )
    parser.add_argument(
        "-n",
        "--max",
        type=int,
        default=None,
        metavar="N",
        help=f"without a start option: print the last N records (default {DEFAULT_LAST}); with one: "
        "stop after N records (default: all)",
    )
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing new records until Ctrl-C / SIGTERM (else stop at the end offsets read at start)",
    )
    parser.add_argument(
        "--rollout",
        action="append",
        default=[],
        metavar="ID",
        help="only records of this rollout (repeat for several): by key on rollout-keyed topics, by "
        "the records' rollout ids on the others (batches, weights, metrics, dead letters)",
    )
    parser.add_argument(
        "--tokens",
        choices=TOKEN_MODES,
        default="count",
        help="token ids and logprobs as their counts or as lists (default: count)",
    )
    parser.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="model directory whose tokenizer decodes token ids: adds F_text beside each field F",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr at the end")
    add_kafka_arguments(parser)
    return parser


def request_from_args(args: argparse.Namespace) -> TailRequest:
    if args.max is not None and args.max < 0:
        raise ClawstreamError("-n/--max must be >= 0")
    text = load_tokenizer(args.model) if args.model else None
    return TailRequest(
        topic=args.topic,
        from_beginning=args.from_beginning,
        offsets=parse_offsets(args.offset) if args.offset else None,
        since_ms=parse_time_ms(args.since) if args.since is not None else None,
        count=args.max,
        follow=args.follow,
        rollouts=frozenset(args.rollout),
        decode=DecodeOptions(tokens=args.tokens, text=text),
    )


def main(argv: list[str] | None = None, prog: str = "clawstream tail") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        request = request_from_args(args)
        settings = kafka_settings(args)
        stopping, restore = install_stop_signals()
        try:
            summary = tail(settings, request, sys.stdout, stop=stopping.is_set)
        finally:
            restore()
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): point stdout at /dev/null so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if not args.quiet:
        bad = f", {summary.undecodable} undecodable" if summary.undecodable else ""
        print(f"tail: {summary.printed} records{bad} from {summary.topic} in {summary.seconds:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m consumers.analytics.tail"))
