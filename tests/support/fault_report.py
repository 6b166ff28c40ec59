"""What a fault test measured, one row per fault: printed, and appended to ``$CLAWSTREAM_FAULT_RESULTS`` (JSON lines)
when set — ``bench/faults.py`` runs the fault tests with it and writes ``bench/results/faults.md``.

Counts are of the unit the fault test checks (trajectories for the stream processors, records for a broker kill,
rollouts for the sandbox worker). Longest stall: the largest gap between consecutive outputs after the fault; time
to recover: from the fault to the end of that gap.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass
class FaultRow:
    fault: str
    published: int  # inputs the test published (its unit)
    received: int  # outputs read back, duplicates included
    lost: int
    duplicated: int
    longest_stall_s: float
    recover_s: float
    note: str = ""


def stall_after(fault_at: float, arrivals: list[float]) -> tuple[float, float]:
    """(longest gap between consecutive outputs from ``fault_at`` on, time from ``fault_at`` to that gap's end)."""
    times = sorted([fault_at, *(t for t in arrivals if t >= fault_at)])
    if len(times) < 2:
        return 0.0, 0.0
    gap, end = max((b - a, b) for a, b in zip(times, times[1:], strict=False))
    return gap, end - fault_at


def record(row: FaultRow) -> None:
    print(
        f"\nfault {row.fault}: published {row.published}, received {row.received}, lost {row.lost}, "
        f"duplicated {row.duplicated}, longest stall {row.longest_stall_s:.1f} s, recovered in {row.recover_s:.1f} s"
    )
    path = os.environ.get("CLAWSTREAM_FAULT_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(asdict(row)) + "\n")
