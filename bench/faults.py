"""Fault matrix: run every fault test once and tabulate what each measured (bench/results/faults.md).

Each fault test kills, pauses, rebalances or cuts off a component while data flows, reads the topics back and
reports one row (``tests/support/fault_report.py``): inputs published, outputs received, lost, duplicated, the
longest stall after the fault and the time to recover. This runs them with ``CLAWSTREAM_FAULT_RESULTS`` set (one
real broker per pytest session, as in CI) and writes the table. A failing test is listed as failed, with its rows
(if it got as far as measuring) kept: the table never hides a fault that lost or doubled something.

Run: ``.venv/bin/python -m bench.faults [-k EXPR]`` (``make test-faults`` runs the same tests without the table);
``--from-rows FILE`` renders rows another run wrote (e.g. the CI run with ``CLAWSTREAM_FAULT_RESULTS=FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "faults.md"
# The fault tests (also `make test-faults`): each ends by reading the topics back.
FAULT_TESTS = (
    "tests/integration/test_streams_rebalance.py",
    "tests/integration/test_streams.py::test_worker_killed_mid_stream_recovers_exactly_once",
    "tests/integration/test_learner.py::test_crash_between_save_and_commit_trains_the_batch_once",
    "tests/integration/test_learner.py::test_a_step_that_raises_is_rolled_back_and_dead_lettered",
    "tests/integration/test_learner.py::test_a_batch_killed_in_its_step_twice_is_dead_lettered_untrained",
    "tests/integration/test_sandbox_worker_kill.py",
    "tests/integration/test_sandbox_rebalance.py",
    "tests/integration/test_kafka_cluster.py",
    "tests/integration/test_proxy_engine_restart.py",
    "tests/integration/test_proxy_restart.py",
    "tests/integration/test_scheduler_restart.py",
    "tests/e2e/test_stack_kills.py",
)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    parser.add_argument("-k", default=None, help="pytest -k expression to run a subset")
    parser.add_argument("--from-rows", type=Path, default=None, help="render these JSON-lines rows; run nothing")
    args = parser.parse_args()
    if args.from_rows is not None:
        rows = [json.loads(line) for line in args.from_rows.read_text().splitlines() if line.strip()]
        RESULTS.write_text(render(rows, [], 0.0, 0, source=f"rows of {args.from_rows.name}"))
        print(f"wrote {RESULTS.relative_to(ROOT)} ({len(rows)} faults)")
        return 0
    tests = [t for t in FAULT_TESTS if (ROOT / t.split("::")[0]).exists()]
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
        if args.k:
            cmd += ["-k", args.k]
        print("running:", " ".join(cmd[3:]), flush=True)
        t0 = time.monotonic()
        env = {**os.environ, "CLAWSTREAM_FAULT_RESULTS": str(rows_path), "CLAWSTREAM_FAULT_MATRIX": "1"}
        code = subprocess.call(cmd, cwd=ROOT, env=env)
        took = time.monotonic() - t0
        rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
        failed = _failed(junit)
    RESULTS.write_text(render(rows, failed, took, code))
    print(f"wrote {RESULTS.relative_to(ROOT)} ({len(rows)} faults measured, {len(failed)} failed tests)")
    return code


def _failed(junit: Path) -> list[str]:
    if not junit.exists():
        return ["(pytest wrote no report)"]
    import xml.etree.ElementTree as ET

    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname')}::{case.get('name')}")
    return out


def render(rows: list[dict], failed: list[str], took: float, code: int, source: str = "") -> str:
    run = source or f"pytest exit {code}, {took / 60:.1f} min"
    head = [
        "# Fault matrix",
        "",
        f"`python -m bench.faults` on {platform.node()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}; "
        f"{run}. What each column means: docs/faults.md#the-fault-tests.",
        "",
        "| fault | published | received | lost | duplicated | longest stall (s) | time to recover (s) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    body = [
        f"| {r['fault']} | {r['published']} | {r['received']} | {r['lost']} | {r['duplicated']} | "
        f"{r['longest_stall_s']:.1f} | {r['recover_s']:.1f} | {r.get('note', '')} |"
        for r in rows
    ]
    tail = ["", "Failed tests: " + (", ".join(failed) if failed else "none"), ""] if not source else [""]
    return "\n".join(head + body + tail)


if __name__ == "__main__":
    raise SystemExit(main())
