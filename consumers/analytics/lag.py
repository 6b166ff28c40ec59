"""``clawstream lag``: consumer lag per group and partition of a run, read from the broker.

For every consumer group with a committed offset on the run's topics (or a member assigned one): committed offset
(``AdminClient.list_consumer_group_offsets``, ``require_stable``: offsets committed in a transaction count once the
transaction commits, as Faust's exactly-once commits do), end offset (``AdminClient.list_offsets``, latest with
``IsolationLevel.READ_COMMITTED``: the **last stable offset**, what the services' ``read_committed`` consumers can
reach, not the high watermark) and who owns the partition (``describe_consumer_groups``). A gap of at most
``COUNT_GAPS_UP_TO`` offsets is counted record by record with a ``read_committed`` reader (transaction markers and
aborted records take offsets but are never read: without the count a group that committed the offset after its last
record shows a lag of 1 for good). The maths and the table are pure (``consumers/analytics/lag_report.py``). The
dashboard exports the same as ``clawstream_consumer_lag``.

Topics in: none read (broker metadata only). Out: stdout.
Run: ``clawstream lag [--prefix P] [--group G] [--watch SECONDS] [--json]`` or ``python -m consumers.analytics.lag``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import Future
from typing import Any

from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import make_admin, make_consumer
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings
from consumers.analytics.lag_report import (
    GroupLag,
    TopicPartitionKey,
    format_table,
    gaps_to_count,
    group_lag,
    in_run,
    report_json,
)

COUNT_GAPS_UP_TO = 64  # offsets: a larger gap is reported in offsets (an upper bound on the records left)


class LagError(ClawstreamError):
    """The broker could not tell a group's lag (unknown group, broker unreachable, a request refused)."""


def _result(future: Future, what: str, timeout: float) -> Any:
    try:
        return future.result(timeout)
    except KafkaException as exc:
        raise LagError(f"{what}: {exc.args[0] if exc.args else exc}") from exc
    except TimeoutError as exc:
        raise LagError(
            f"{what}: no answer within {timeout:.0f}s (is the broker up? `clawstream kafka status`)"
        ) from exc


def read_lag(
    kafka: KafkaSettings, *, group: str | None = None, admin: AdminClient | None = None, timeout: float = 15.0
) -> list[GroupLag]:
    """Lag of every group on the run's topics (``kafka.topic_prefix``), or of ``group`` alone, sorted by group."""
    admin = admin or make_admin(kafka)
    listed = _result(admin.list_consumer_groups(request_timeout=timeout), "listing consumer groups", timeout)
    known = sorted(g.group_id for g in listed.valid)
    if group is not None and group not in known:
        raise LagError(f"no consumer group {group!r} on the cluster ({len(known)} groups; `clawstream lag` lists them)")
    ids = [group] if group is not None else known
    if not ids:
        return []
    described = admin.describe_consumer_groups(ids, request_timeout=timeout)
    offsets = {
        gid: admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(gid)], require_stable=True, request_timeout=timeout
        )[gid]
        for gid in ids
    }
    prefix = kafka.topic_prefix
    found: list[tuple[str, str, dict[TopicPartitionKey, int], dict[TopicPartitionKey, str]]] = []
    for gid in ids:
        desc = _result(described[gid], f"describing group {gid!r}", timeout)
        owners = {
            (tp.topic, tp.partition): m.client_id
            for m in desc.members
            for tp in (m.assignment.topic_partitions if m.assignment else [])
        }
        listing = _result(offsets[gid], f"reading the committed offsets of group {gid!r}", timeout)
        committed = {(tp.topic, tp.partition): tp.offset for tp in listing.topic_partitions or [] if tp.offset >= 0}
        if any(in_run(t, prefix) for t, _ in (*committed, *owners)) or gid == group:
            state = getattr(desc.state, "name", str(desc.state)).lower()
            found.append((gid, state, committed, owners))
    keys = {k for _, _, c, o in found for k in (*c, *o) if in_run(k[0], prefix)}
    ends = end_offsets(admin, keys, timeout)
    gaps = {g for _, _, c, _ in found for g in gaps_to_count(c, ends, COUNT_GAPS_UP_TO) if in_run(g[0], prefix)}
    counted = count_records(kafka, gaps, ends, timeout) if gaps else {}
    return [group_lag(gid, state, c, owners, ends, prefix, counted) for gid, state, c, owners in found]


def count_records(
    kafka: KafkaSettings, gaps: set[tuple[str, int, int]], ends: dict[TopicPartitionKey, int], timeout: float
) -> dict[tuple[str, int, int], int]:
    """Per (topic, partition, from offset): the records a ``read_committed`` reader gets from there to the end
    offset. Gaps not counted within ``timeout`` in all are left out (reported in offsets). Nothing is committed: an
    assigned reader joins no group."""
    reader = make_consumer(kafka, f"clawstream-lag-{time.monotonic_ns()}", **{"enable.auto.commit": False})
    out: dict[tuple[str, int, int], int] = {}
    deadline = time.monotonic() + timeout
    try:
        for topic, part, start in sorted(gaps):
            end = ends[(topic, part)]
            reader.assign([TopicPartition(topic, part, start)])
            seen = 0
            while time.monotonic() < deadline:
                msg = reader.poll(0.2)
                if msg is not None and not msg.error() and (msg.offset() or 0) < end:
                    seen += 1
                # The position moves past commit markers and aborted records without handing them out.
                if reader.position([TopicPartition(topic, part)])[0].offset >= end:
                    out[(topic, part, start)] = seen
                    break
    except KafkaException as exc:
        why = exc.args[0] if exc.args else exc
        raise LagError(f"counting the records left on {len(gaps)} partitions: {why}") from exc
    finally:
        reader.close()
    return out


def end_offsets(admin: AdminClient, keys: set[TopicPartitionKey], timeout: float) -> dict[TopicPartitionKey, int]:
    """The last stable offset of each partition (``read_committed``'s end: below an open transaction's first
    record; past the commit markers of finished ones)."""
    if not keys:
        return {}
    futures = admin.list_offsets(
        {TopicPartition(t, p): OffsetSpec.latest() for t, p in keys},
        isolation_level=IsolationLevel.READ_COMMITTED,
        request_timeout=timeout,
    )
    return {
        (tp.topic, tp.partition): _result(f, f"reading the end offset of {tp.topic}[{tp.partition}]", timeout).offset
        for tp, f in futures.items()
    }


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", dest="topic_prefix", metavar="PREFIX", default=None, help="same as --topic-prefix")
    parser.add_argument("--group", metavar="GROUP", help="only this consumer group (an unknown group is an error)")
    parser.add_argument("--watch", type=float, metavar="SECONDS", help="print again every SECONDS until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="one JSON document per report (groups, partitions)")
    add_kafka_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "clawstream lag") -> int:
    from clawbase.kafka.clients import check_broker

    args = build_parser(prog).parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        print("error: --watch takes a period in seconds above 0", file=sys.stderr)
        return 2
    try:
        kafka = kafka_settings(args)
        check_broker(kafka, timeout=10.0)
        admin = make_admin(kafka)
        while True:
            groups = read_lag(kafka, group=args.group, admin=admin)
            if args.json:
                print(json.dumps({"prefix": kafka.topic_prefix, **report_json(groups)}), flush=True)
            elif groups:
                print(format_table(groups), flush=True)
            else:
                print(f"no consumer group has committed offsets on topics of prefix {kafka.topic_prefix!r}", flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            if not args.json:
                print(flush=True)
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m consumers.analytics.lag"))
