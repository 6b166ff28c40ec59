"""``clawstream health``: capture health per harness and chat template over a range of the event log.

Reads the calls of a range of ``clawstream.calls`` (``--since/--until`` times, or ``--from/--to`` offsets; default:
everything), then, for the rollouts those calls belong to, their requests, lifecycle events, trajectories and rewards
(``clawstream.rollout.requests``, ``.rollout.events``, ``.trajectories``, ``.rewards``: from ``--lookback`` before
``--since`` up to their ends, so a rollout's labels and its trajectory are found even when they lie outside the
calls' range).
Prints one row per (harness, template) — definitions in ``consumers.analytics.health`` and docs/dashboard.md —
or JSON (``--json``), optionally with every rollout (``--per-rollout``).

Run: ``clawstream health [--topic-prefix P] [--since 2h] [--json]`` or
``python -m consumers.analytics.dashboard.health_report``. Read-only: nothing is committed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawbase.errors import ClawstreamError
from clawbase.settings import KafkaSettings
from consumers.analytics.dashboard.feed import read_events
from consumers.analytics.health_table import HealthAggregator, format_rows
from consumers.analytics.reader import offsets_at, open_reader, watermarks
from consumers.analytics.records import parse_offsets, parse_time_ms, start_offsets
from schemas.events import CallEvent
from schemas.topics import CALLS, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS, TRAJECTORIES

LABEL_TOPICS = (ROLLOUT_REQUESTS, ROLLOUT_EVENTS, TRAJECTORIES, REWARDS)


@dataclass
class HealthRange:
    """Which calls to measure: times (epoch ms, ``until`` exclusive) and/or offset maps of the calls topic."""

    since_ms: int | None = None
    until_ms: int | None = None
    from_offsets: dict[int, int] = field(default_factory=dict)  # records.parse_offsets output
    to_offsets: dict[int, int] = field(default_factory=dict)
    lookback_ms: int = 6 * 3600 * 1000


@dataclass
class HealthReport:
    aggregator: HealthAggregator
    calls_read: int = 0
    calls_in_range: int = 0
    label_records: int = 0
    errors: list[str] = field(default_factory=list)
    ranges: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)  # topic → p → [start, end)


def collect(kafka: KafkaSettings, scope: HealthRange, *, progress: Callable[[str], None] | None = None) -> HealthReport:
    """Read the range and the rollouts' labels into a :class:`HealthAggregator` (see the module docstring)."""
    say = progress or (lambda _line: None)
    report = HealthReport(HealthAggregator())
    consumer, ref = open_reader(kafka, CALLS)
    rollouts: set[str] = set()
    try:
        marks = watermarks(consumer, ref.name)
        starts = (
            start_offsets(scope.from_offsets, marks, flag="--from")
            if scope.from_offsets
            else {p: low for p, (low, _high) in marks.items()}
        )
        ends = {p: high for p, (_low, high) in marks.items()}
        if scope.to_offsets:
            ends = {p: min(ends[p], off) for p, off in start_offsets(scope.to_offsets, marks, flag="--to").items()}
            starts = {p: s for p, s in starts.items() if p in ends}
        if scope.since_ms is not None:
            at = offsets_at(consumer, ref.name, scope.since_ms, marks)
            starts = {p: max(s, at[p]) for p, s in starts.items()}
        if scope.until_ms is not None:
            at = offsets_at(consumer, ref.name, scope.until_ms, marks)
            ends = {p: min(e, at[p]) for p, e in ends.items()}
        report.ranges[ref.name] = {p: (starts[p], ends.get(p, starts[p])) for p in sorted(starts)}
        say(f"reading {ref.name}: " + ", ".join(f"[{p}] {s}-{e}" for p, (s, e) in report.ranges[ref.name].items()))
        for event in read_events(consumer, ref.name, starts, ends, on_error=report.errors.append, expected=CallEvent):
            report.calls_read += 1
            if not isinstance(event, CallEvent):
                report.errors.append(f"{ref.name}: a {type(event).__name__} record in the calls topic")
                continue
            # Record times and event times differ a little: the range is by record time, the filter by event time.
            if scope.since_ms is not None and event.timestamp_ms < scope.since_ms:
                continue
            if scope.until_ms is not None and event.timestamp_ms >= scope.until_ms:
                continue
            report.calls_in_range += 1
            rollouts.add(event.rollout_id)
            report.aggregator.add(event)
    finally:
        consumer.close()
    if not rollouts:
        return report
    for name in LABEL_TOPICS:
        consumer, ref = open_reader(kafka, name)
        try:
            marks = watermarks(consumer, ref.name)
            starts = {p: low for p, (low, _high) in marks.items()}
            if scope.since_ms is not None:
                starts = offsets_at(consumer, ref.name, scope.since_ms - scope.lookback_ms, marks)
            ends = {p: high for p, (_low, high) in marks.items()}
            report.ranges[ref.name] = {p: (starts[p], ends[p]) for p in sorted(starts)}
            say(f"reading {ref.name} for {len(rollouts)} rollout(s)")
            for event in read_events(consumer, ref.name, starts, ends, on_error=report.errors.append):
                if getattr(event, "rollout_id", None) in rollouts:
                    report.label_records += 1
                    report.aggregator.add(event)
        finally:
            consumer.close()
    return report


def report_json(report: HealthReport, *, per_rollout: bool = False) -> dict[str, Any]:
    out = {
        "rows": [row.to_dict() for row in report.aggregator.rows()],
        "calls_read": report.calls_read,
        "calls_in_range": report.calls_in_range,
        "rollouts": len(report.aggregator),
        "errors": report.errors,
        "ranges": {t: {str(p): list(r) for p, r in rs.items()} for t, rs in report.ranges.items()},
    }
    if per_rollout:
        out["per_rollout"] = [dataclasses.asdict(r) for r in report.aggregator.rollouts()]
    return out


def main(argv: list[str] | None = None) -> int:
    from clawbase.kafka.clients import check_broker
    from clawbase.settings import add_kafka_arguments, kafka_settings

    parser = argparse.ArgumentParser(
        prog="clawstream health",
        description=__doc__.split("\n\n")[0],
        epilog="Columns: share of follow-up calls that extend their tree parent exactly, full re-renders and forks\n"
        "per rollout (answer forks: the answer came back as other token ids), masked share of generated tokens,\n"
        "retry orphans, calls of superseded attempts, engine prefix-cache hit rate, rollouts (calls) that sent an\n"
        "assistant turn the proxy never generated (tampered: never trained), rollouts graded 0 because the grader\n"
        "failed on what they left in the workspace (grader error). Definitions: docs/dashboard.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--since",
        metavar="TIME",
        help="calls at/after TIME: epoch ms, ISO 8601 (UTC unless a zone "
        "is given) or an age such as 2h, 30m, 7d (default: the beginning)",
    )
    parser.add_argument("--until", metavar="TIME", help="calls before TIME (default: the end as of the start)")
    parser.add_argument(
        "--from",
        dest="from_offsets",
        action="append",
        default=[],
        metavar="[P:]OFFSET",
        help="first offset of the calls topic to read (every partition, or partition P)",
    )
    parser.add_argument(
        "--to",
        dest="to_offsets",
        action="append",
        default=[],
        metavar="[P:]OFFSET",
        help="read the calls topic up to this offset (exclusive)",
    )
    parser.add_argument(
        "--lookback",
        default="6h",
        metavar="AGE",
        help="read requests/events/trajectories from this long before --since (default 6h)",
    )
    parser.add_argument("--per-rollout", action="store_true", help="also list every rollout's counts")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--prefix", dest="topic_prefix", metavar="PREFIX", default=None, help="same as --topic-prefix")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        kafka = kafka_settings(args)
        now = int(time.time() * 1000)
        lookback = now - parse_time_ms(args.lookback, now_ms=now)
        scope = HealthRange(
            since_ms=parse_time_ms(args.since) if args.since else None,
            until_ms=parse_time_ms(args.until) if args.until else None,
            from_offsets=parse_offsets(args.from_offsets, flag="--from"),
            to_offsets=parse_offsets(args.to_offsets, flag="--to"),
            lookback_ms=max(0, lookback),
        )
        check_broker(kafka)
        progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
        report = collect(kafka, scope, progress=progress)
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report_json(report, per_rollout=args.per_rollout)))
        return 0
    _print_errors(report.errors)
    if not report.aggregator.rollouts():
        print(f"no calls in the range ({report.calls_read} read)")
        return 0
    print(format_rows(report.aggregator.rows()))
    if args.per_rollout:
        print()
        for r in report.aggregator.rollouts():
            print(
                f"{r.rollout_id}  {r.harness}/{r.template}  main {r.main_calls}  extends {r.extends}/{r.follow_ups}"
                f"  re-renders {r.full_renders}  forks {r.forks} (answer {r.answer_forks})  orphans "
                f"{r.retry_orphans}  masked {r.masked_tokens if r.masked_tokens is not None else '-'}"
                f"/{r.generated_tokens}  stale {r.stale_attempt_calls}  unresolved {r.unresolved_calls}"
                f"  tampered {r.tampered_calls}  grader error {int(r.grader_error_by_rollout)}"
            )
    print(
        f"{report.calls_in_range} call(s) of {len(report.aggregator)} rollout(s), {report.label_records} label "
        f"record(s), in {time.monotonic() - started:.1f}s"
        + (f"; {len(report.errors)} undecodable record(s), skipped" if report.errors else ""),
        file=sys.stderr,
    )
    return 0


def _print_errors(errors: list[str], most: int = 50) -> None:
    """Each undecodable record (``topic[partition]@offset: reason``) on stderr, up to ``most`` of them."""
    for error in errors[:most]:
        print(f"health: undecodable {error}", file=sys.stderr)
    if len(errors) > most:
        print(f"health: … and {len(errors) - most} more (--json lists all)", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
