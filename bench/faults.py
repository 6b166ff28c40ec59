"""Fault matrix: run every fault test once and tabulate what each measured (bench/results/faults.md).

Each fault test kills, pauses, rebalances or cuts off a component while data flows, reads the topics back and
reports one row (``tests/support/fault_report.py``): inputs published, outputs received, lost, duplicated, the
longest stall after the fault and the time to recover. This runs them with ``CLAWSTREAM_FAULT_RESULTS`` set (one
real broker per pytest session, as in CI) and writes the table. A failing test is listed as failed, with its rows
(if it got as far as measuring) kept: the table never hides a fault that lost or doubled something.

Chaos rows (``--chaos``) come from ``clawstream chaos`` (clawstream/stack/chaos.py): the training stack on a 3-broker
cluster, the ``--kill`` services SIGKILLed and restarted at moments the run's state chooses, for ``--for`` or
``--kills``; the row counts attempts in, trajectories settled out, lost and duplicated by the audit, the longest
stall, the longest kill-to-progress recovery, kills per service and the audit's verdict.

Run: ``.venv/bin/python -m bench.faults [-k EXPR]`` (``make test-faults`` runs the same tests without the table);
``--from-rows FILE`` renders rows another run wrote (e.g. the CI run with ``CLAWSTREAM_FAULT_RESULTS=FILE``);
``--chaos --for 30m`` (or ``--chaos --kill proxy --kills 4``) runs a chaos row. With ``-k`` or ``--chaos`` the rows
measured replace the table's rows of the same fault (the others, and the notes below the table, are kept).
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

from clawstream.stack.chaos import DEFAULT_KILL

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "faults.md"
# The fault tests (also `make test-faults`): each ends by reading the topics back.
FAULT_TESTS = (
    "tests/integration/test_streams_rebalance.py",
    "tests/integration/test_streams.py::test_worker_killed_mid_stream_recovers_exactly_once",
    "tests/integration/test_learner.py::test_crash_between_save_and_commit_trains_the_batch_once",
    "tests/integration/test_learner.py::test_a_step_that_raises_is_rolled_back_and_dead_lettered",
    "tests/integration/test_learner.py::test_a_batch_killed_in_its_step_three_times_is_trained_once",
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
    parser.add_argument("--chaos", action="store_true", help="run `clawstream chaos` and add its row; no tests")
    parser.add_argument("--kill", default=",".join(DEFAULT_KILL), help="--chaos: the services killed")
    parser.add_argument("--for", dest="duration", default=None, help="--chaos: how long, e.g. 30m")
    parser.add_argument("--kills", type=int, default=None, help="--chaos: stop after this many kills")
    parser.add_argument("--seed", type=int, default=0, help="--chaos: the run's seed")
    parser.add_argument("--engine", default="cpu", choices=("cpu", "instant"), help="--chaos: the model engine")
    parser.add_argument("--note", default="", help="--chaos: added to the row's note (e.g. the machine's load)")
    args = parser.parse_args()
    if args.chaos:
        return chaos_row(args)
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
    if args.k:  # a subset: its rows replace theirs in the table, the rest is kept
        merge(rows)
        print(f"merged {len(rows)} rows into {RESULTS.relative_to(ROOT)}; failed tests: {', '.join(failed) or 'none'}")
        return code
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


def chaos_row(args: argparse.Namespace) -> int:
    """Run ``clawstream chaos`` with the arguments given, merge its row into the table; its exit status."""
    if args.duration is None and args.kills is None:
        raise SystemExit("--chaos needs --for DURATION or --kills N")
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "chaos.json"
        cmd = [sys.executable, "-m", "clawstream", "chaos", "--kill", args.kill, "--seed", str(args.seed)]
        cmd += ["--engine", args.engine, "--json", str(summary)]
        cmd += ["--for", args.duration] if args.duration else []
        cmd += ["--kills", str(args.kills)] if args.kills else []
        load = _load()  # the machine's load when the run starts (1, 5, 15 min)
        print("running:", " ".join(cmd[2:]), f"({time.strftime('%Y-%m-%d %H:%M')} UTC, load {load})", flush=True)
        code = subprocess.call(cmd, cwd=ROOT)
        if not summary.exists():
            print("clawstream chaos wrote no summary: no row")
            return code or 1
        result = json.loads(summary.read_text())
    merge([_chaos_fault_row(args, result, load)])
    print(f"merged the chaos row into {RESULTS.relative_to(ROOT)}")
    return code


def _chaos_fault_row(args: argparse.Namespace, r: dict, load: str) -> dict:
    kills = ", ".join(f"{name} {n}" for name, n in sorted(r["kills"].items()))
    what = f"for {args.duration}" if args.duration else f"{args.kills} kills"
    verdict = "audit CLEAN" if r["clean"] else f"audit NOT CLEAN{': ' + r['error'] if r['error'] else ''}"
    note = (
        f"{verdict}; kills: {kills}; {r['seconds'] / 60:.1f} min, seed {r['seed']}, engine {args.engine}; "
        f"batches sealed {r['batches_sealed']}, trained {r['batches_trained']}; {r['rollouts']} rollouts in "
        f"{r['in']} attempts; groups trained short {r['short_groups']}; longest stall {r['stall_after']}; "
        f"drained {'yes' if r['drained'] else 'NO'} in {r['drain_s']:.0f} s; restarted by the supervisor besides the "
        f"kills: {r['supervisor_restarts'] or 'none'}; load at the start {load}"
    )
    return {
        "fault": f"chaos: random SIGKILLs of {args.kill} ({what}), 3-broker cluster",
        "published": r["in"],
        "received": r["out"],
        "lost": r["lost"],
        "duplicated": r["duplicated"],
        "longest_stall_s": r["longest_stall_s"],
        "recover_s": r["longest_recover_s"],
        "note": note + (f"; {args.note}" if args.note else ""),
    }


def _load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _line(r: dict) -> str:
    return (
        f"| {r['fault']} | {r['published']} | {r['received']} | {r['lost']} | {r['duplicated']} | "
        f"{r['longest_stall_s']:.1f} | {r['recover_s']:.1f} | {r.get('note', '')} |"
    )


def merge(rows: list[dict]) -> None:
    """Put ``rows`` into the table of the results file: a row of the same fault is replaced, a new one appended
    after the table's last row; everything else in the file stays as it is."""
    lines = RESULTS.read_text().splitlines() if RESULTS.exists() else render([], [], 0.0, 0, "none").splitlines()
    table = [i for i, line in enumerate(lines) if line.startswith("| ")]
    last = table[-1] if table else len(lines) - 1
    for row in rows:
        name = f"| {row['fault']} |"
        at = next((i for i in table if lines[i].startswith(name)), None)
        if at is None:
            last += 1
            lines.insert(last, _line(row))
            table.append(last)
        else:
            lines[at] = _line(row)
    RESULTS.write_text("\n".join(lines) + "\n")


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
    body = [_line(r) for r in rows]
    tail = ["", "Failed tests: " + (", ".join(failed) if failed else "none"), ""] if not source else [""]
    return "\n".join(head + body + tail)


if __name__ == "__main__":
    raise SystemExit(main())
