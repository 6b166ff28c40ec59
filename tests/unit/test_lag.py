"""Consumer lag maths and its table (consumers/analytics/lag_report.py): pure, no broker."""

from __future__ import annotations

from consumers.analytics.lag_report import format_table, group_lag, in_run, report_json

P = "run1."


def test_lag_is_end_minus_committed_per_partition_of_the_run() -> None:
    g = group_lag(
        "run1.streams",
        "stable",
        committed={(P + "calls", 0): 10, (P + "calls", 1): 4, ("other.calls", 0): 1, (P + "rewards", 0): 9},
        owners={(P + "calls", 0): "worker-a", (P + "calls", 2): "worker-b"},
        ends={
            (P + "calls", 0): 15,
            (P + "calls", 1): 4,
            (P + "calls", 2): 7,
            (P + "rewards", 0): 8,
            ("other.calls", 0): 5,
        },
        prefix=P,
    )
    rows = {(p.topic, p.partition): p for p in g.partitions}
    assert set(rows) == {(P + "calls", 0), (P + "calls", 1), (P + "calls", 2), (P + "rewards", 0)}  # other run's out
    assert rows[(P + "calls", 0)].lag == 5 and rows[(P + "calls", 0)].owner == "worker-a"
    assert rows[(P + "calls", 1)].lag == 0
    assert rows[(P + "calls", 2)].committed is None and rows[(P + "calls", 2)].lag is None  # owned, nothing committed
    assert rows[(P + "rewards", 0)].lag == 0  # a committed offset past the last stable offset: no negative lag
    assert g.total == 5


def test_in_run_skips_kafka_internal_topics_with_an_empty_prefix() -> None:
    assert in_run("calls", "") and not in_run("__consumer_offsets", "") and not in_run("x.calls", "y.")


def test_json_and_table_show_every_partition_and_the_total() -> None:
    g = group_lag("g", "empty", {("t", 0): 3}, {}, {("t", 0): 5, ("t", 1): 2}, "")
    doc = report_json([g])
    assert doc == {
        "groups": [
            {
                "group": "g",
                "state": "empty",
                "total": 2,
                "partitions": [{"topic": "t", "partition": 0, "committed": 3, "end": 5, "lag": 2, "owner": None}],
            }
        ]
    }
    lines = format_table([g]).splitlines()
    assert lines[0].split() == ["GROUP", "TOPIC", "PART", "COMMITTED", "END", "LAG", "OWNER"]
    assert lines[1].split() == ["g", "t", "0", "3", "5", "2", "-"]
    assert lines[2].split() == ["g", "total", "(empty)", "2"]
