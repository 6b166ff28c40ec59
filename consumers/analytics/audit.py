"""``clawstream audit``: read a run's topics back and prove nothing was lost, doubled or trained twice.

Reads every record of the request, lifecycle, reward, trajectory, batch, weight and dead-letter topics of a prefix,
and of each call which attempt it served and whether it was ``tampered`` (``read_committed``, partitions assigned by
hand, nothing committed), keeps the fields the guarantees are about,
and reconciles them with the pure rules of ``consumers.analytics.reconcile``. Prints a report (or ``--json``);
exits 0 when clean, 1 when any rule is broken or a record cannot be decoded, 2 on a usage or broker error. It is
the oracle of every fault test, and a user's integrity report for their own run.

Topics: ``clawstream.rollout.requests``, ``.rollout.events``, ``.calls``, ``.rewards``, ``.trajectories``,
``.batches``, ``.weights``, ``.deadletter`` (under ``--topic-prefix``) in; nothing out.
Run: ``clawstream audit --topic-prefix P [--json]`` or ``python -m consumers.analytics audit ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from clawbase.errors import ClawstreamError, CodecError
from clawbase.settings import KafkaSettings, load_settings
from consumers.analytics.reader import open_reader, read_range, watermarks
from consumers.analytics.reconcile import reconcile
from consumers.analytics.records import EventLogError
from consumers.analytics.run_log import (
    AuditReport,
    BatchEntry,
    Call,
    Letter,
    Lifecycle,
    Request,
    Reward,
    RunLog,
    Settled,
    Version,
    Where,
)
from schemas.codec import default_codec
from schemas.events import RolloutState
from schemas.topics import (
    BATCHES,
    CALLS,
    DEADLETTER,
    REWARDS,
    ROLLOUT_EVENTS,
    ROLLOUT_REQUESTS,
    TRAJECTORIES,
    WEIGHTS,
)


def _settled(rec: dict[str, Any], where: Where) -> Settled:
    evaluation = rec["step"] < 0 or (rec.get("metadata") or {}).get("eval", "").lower() == "true"
    trainable = rec["status"] in TRAINABLE and rec["reward"] is not None and bool(rec["segments"]) and not evaluation
    return Settled(
        rec["rollout_id"],
        rec["attempt_id"],
        rec["status"],
        rec["reward"],
        where,
        group_id=None if evaluation else rec["group_id"] or None,
        trainable=trainable,
        drop_reason=rec.get("drop_reason"),
        timestamp_ms=rec["timestamp_ms"],
    )


def _batch_entry(rec: dict[str, Any], where: Where) -> BatchEntry:
    inner = None
    if rec["trajectory"] is not None:
        _, traj = default_codec().decode(rec["trajectory"], expected="Trajectory")
        inner = _settled(traj, where)
    return BatchEntry(
        rec["batch_id"],
        rec["kind"],
        rec["index"],
        inner,
        where,
        group_id=rec.get("group_id"),
        step=rec["step"],
        harness=rec.get("harness") or "",
        timestamp_ms=rec["timestamp_ms"],
    )


def _scored_seal(rec: dict[str, Any], where: Where) -> BatchEntry | None:
    """A group's SEAL on the scored-groups topic: when the batcher got the group whole (its envelopes: not kept)."""
    return _batch_entry(rec, where) if rec["kind"] == "SEAL" else None


_DROPPED_GROUP = re.compile(r"^(?:stale )?group (.+?): ")


def _letter(rec: dict[str, Any], where: Where) -> Letter:
    """A dead letter; the group a batcher's drop names (its reason says, whatever record it was processing)."""
    key = rec.get("original_key")
    group = _DROPPED_GROUP.match(rec["reason"] or "") if rec["source"] == "streams.batcher" else None
    return Letter(
        rec["source"],
        rec["reason"] or "",
        where,
        error_type=rec.get("error_type") or "",
        rollout_id=rec.get("rollout_id"),
        key=key.decode("utf-8", "replace") if isinstance(key, bytes) else key,
        group_id=group.group(1) if group else None,
    )


def _request(rec: dict[str, Any], where: Where) -> Request:
    most = (rec.get("metadata") or {}).get("max_attempts", "")
    return Request(rec["rollout_id"], rec["attempt"], where, rec["group_id"], int(most) if most.isdigit() else None)


# topic → (schema, what to keep, the RunLog list it goes to).
KEEP: dict[str, tuple[str, Callable[[dict[str, Any], Where], Any] | None, str | None]] = {
    ROLLOUT_REQUESTS: ("RolloutRequest", _request, "requests"),
    CALLS: ("CallEvent", lambda r, w: Call(r["rollout_id"], r.get("attempt_id"), bool(r.get("tampered")), w), "calls"),
    ROLLOUT_EVENTS: (
        "RolloutEvent",
        lambda r, w: Lifecycle(r["rollout_id"], r["attempt_id"], RolloutState(r["state"]), w),
        "lifecycle",
    ),
    REWARDS: (
        "RewardEvent",
        lambda r, w: Reward(r["rollout_id"], r["attempt_id"], r["status"], r["reward"], w),
        "rewards",
    ),
    TRAJECTORIES: ("Trajectory", _settled, "trajectories"),
    BATCHES: ("BatchRecord", _batch_entry, "batches"),
    WEIGHTS: ("WeightVersion", lambda r, w: Version(r["policy_version"], r["batch_id"], w), "versions"),
    DEADLETTER: ("DeadLetter", _letter, "dead_letters"),
}
TRAINABLE = frozenset({"COMPLETE", "TIMED_OUT"})  # the statuses that carry tree segments (streams.state)
SCORED_GROUPS = "-scored-groups"  # the streams app's internal topic of scored groups: the batcher's input


def read_run(settings: KafkaSettings, *, progress: TextIO | None = None) -> RunLog:
    """Every record of the run's topics, reduced to what :func:`reconcile` checks."""
    log = RunLog()
    found = sum(_read_topic(settings, topic, *how, log, progress) for topic, how in KEEP.items())
    if not found:
        raise EventLogError(f"no topics of the run with prefix {settings.topic_prefix!r} on the broker")
    for topic in scored_topics(settings):
        _read_topic(settings, topic, "BatchRecord", _scored_seal, "scored", log, progress)
    return log


def scored_topics(settings: KafkaSettings) -> list[str]:
    """The streams app's scored-groups topic(s) of the run: ``{prefix}{app id}-scored-groups``, the app id from
    ``CLAWSTREAM_STREAMS_APP_ID`` when set, else any whose longest run prefix (one with a weights topic) is ours."""
    app_id = os.environ.get("CLAWSTREAM_STREAMS_APP_ID")
    if app_id:
        return [settings.topic_prefix + app_id + SCORED_GROUPS]
    consumer, _ = open_reader(settings, settings.topic(WEIGHTS))
    try:
        names = consumer.list_topics(timeout=15).topics
    finally:
        consumer.close()
    runs = {t[: -len(WEIGHTS)] for t in names if t.endswith(WEIGHTS)}

    def owner(topic: str) -> str:
        return max((p for p in runs if topic.startswith(p)), key=len, default="")

    return sorted(t for t in names if t.endswith(SCORED_GROUPS) and owner(t) == settings.topic_prefix)


def _read_topic(
    settings: KafkaSettings,
    topic: str,
    schema: str,
    keep: Callable[[dict[str, Any], Where], Any] | None,
    target: str | None,
    log: RunLog,
    progress: TextIO | None,
) -> int:
    """Read one topic into ``log`` (1), or nothing when the run never created it (0)."""
    try:
        consumer, ref = open_reader(settings, topic)
    except EventLogError:
        return 0  # a topic the run never created: nothing of it to reconcile
    try:
        marks = watermarks(consumer, ref.name)
        n = 0
        for msg in _records(consumer, ref.name, marks):
            n += 1
            where = Where(ref.name, msg.partition(), msg.offset())
            try:  # every record is decoded (calls and requests too): one that is not is listed
                if msg.value() is None:
                    raise CodecError(f"a tombstone (no value), not a {schema}")
                _, rec = default_codec().decode(msg.value(), expected=schema)
                kept = keep(rec, where) if keep is not None else None
                if kept is not None:
                    getattr(log, target).append(kept)  # type: ignore[arg-type]
            except (ClawstreamError, KeyError, ValueError, TypeError) as exc:
                log.undecodable.append((f"{type(exc).__name__}: {exc}", where))
        log.counts[ref.name] = n
        if progress is not None:
            print(f"read {n:>7} records of {ref.name}", file=progress, flush=True)
    finally:
        consumer.close()
    return 1


def _records(consumer: Any, topic: str, marks: dict[int, tuple[int, int]]) -> Iterator[Any]:
    return read_range(
        consumer, topic, {p: low for p, (low, _) in marks.items()}, {p: high for p, (_, high) in marks.items()}
    )


def format_report(report: AuditReport, prefix: str) -> str:
    tally = report.tally()
    lines = [
        f"audit of topic prefix {prefix!r}: {'CLEAN' if report.clean else 'VIOLATIONS'}",
        "",
        *(f"  {topic:48} {n:>8} records" for topic, n in sorted(report.counts.items())),
        "",
        f"  attempts {report.attempts}, settled into trajectories {report.settled}, trajectories in batches "
        f"{report.batched}, batches sealed {report.batches_sealed}, trained {report.batches_trained}, "
        f"weight versions {report.versions}",
        f"  lost {tally['lost']}, duplicated {tally['duplicated']}, trained twice {tally['trained twice']}, "
        f"inconsistent {tally['inconsistent']}, undecodable {len(report.undecodable)}",
    ]
    if report.reruns_set_aside:
        lines.append(
            f"  {report.reruns_set_aside} second run(s) of a request whose first run was trained, set aside (a worker "
            "died between a reward and releasing its rollout; docs/faults.md)"
        )
    if report.violations:
        lines += ["", "violations:"] + [f"  [{v.kind}] {v.rule}: {v.detail}" for v in report.violations[:50]]
        if len(report.violations) > 50:
            lines.append(f"  … and {len(report.violations) - 50} more (--json lists all)")
    if report.undecodable:
        lines += ["", "undecodable records:"] + [f"  {u}" for u in report.undecodable[:50]]
        if len(report.undecodable) > 50:
            lines.append(f"  … and {len(report.undecodable) - 50} more (--json lists all)")
    if report.in_flight:
        lines += ["", "in flight when the run stopped (not lost):"]
        lines += [f"  {n:>6} {what}" for what, n in report.in_flight.items()]
    for title, items in (
        ("groups trained short, with the reason (not violations)", report.short_groups),
        ("groups and batches set aside for a cause (not violations)", report.set_aside),
    ):
        if items:
            lines += ["", f"{title}:"] + [f"  {s}" for s in items[:50]]
            if len(items) > 50:
                lines.append(f"  … and {len(items) - 50} more (--json lists all)")
    if report.dead_letters:
        lines += ["", "dead letters (a loss where a rule above says so):"]
        lines += [f"  {n:>6} × {reason}" for reason, n in report.dead_letters.items()]
    return "\n".join(lines)


def build_parser(prog: str = "clawstream audit") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Read a run's topics back and reconcile them: every attempt settled once, every trajectory in at "
        "most one batch, every batch trained at most once, versions contiguous. Exit 0 clean, 1 violations, 2 error.",
    )
    parser.add_argument("--topic-prefix", "--prefix", dest="prefix", default=None, help="the run's topic prefix")
    parser.add_argument(
        "--bootstrap", default=None, help="host:port (else CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS, else local)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return parser


def main(argv: list[str] | None = None, prog: str = "clawstream audit", out: TextIO = sys.stdout) -> int:
    args = build_parser(prog).parse_args(argv)
    overrides = {k: v for k, v in {"topic_prefix": args.prefix, "bootstrap_servers": args.bootstrap}.items() if v}
    try:
        settings = load_settings(KafkaSettings, **overrides)
        report = reconcile(read_run(settings, progress=None if args.json else sys.stderr))
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"topic_prefix": settings.topic_prefix, **report.to_json()}, indent=1), file=out)
    else:
        print(format_report(report, settings.topic_prefix), file=out)
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())
