"""Held-out before/after per task family (template): where a run's gain came from, with paired standard errors.

In: evaluation results as summary.json holds them (``{"per_task": {"harness/mode": {task_id: reward}}}``), one or
several runs. Out: a markdown table per decoding mode: per family the number of (run, harness, task) pairs, the mean
reward before and after, and the mean paired difference ± its s.e. (the pairs pooled over harnesses and runs; a
task's harnesses and seeds are not independent draws, so read the s.e. as a guide, not a test). No Kafka.

The family is the task id's template suffix: the built-in suite names tasks ``<split>-<NNN>-<template>``
(``heldout-017-replace``); any other id is its own suite's business and falls under ``other``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

_BUILTIN_ID = re.compile(r"^[a-z]+-\d+-(?P<family>[a-z_]+)$")


def family_of(task_id: str) -> str:
    match = _BUILTIN_ID.match(task_id)
    return match.group("family") if match else "other"


def pairs(before: Mapping[str, Any], after: Mapping[str, Any], mode: str) -> list[tuple[str, float, float]]:
    """(family, before reward, after reward) for every harness and task graded in both results (JSON dicts)."""
    out = []
    b_cells, a_cells = before.get("per_task") or {}, after.get("per_task") or {}
    for key in sorted(b_cells.keys() & a_cells.keys()):
        if key.rsplit("/", 1)[-1] != mode:
            continue
        b, a = b_cells[key], a_cells[key]
        out += [(family_of(t), b[t], a[t]) for t in sorted(b.keys() & a.keys())]
    return out


def family_rows(all_pairs: Iterable[tuple[str, float, float]]) -> list[dict[str, Any]]:
    """Per family (sorted), then ``all``: n, before, after, gain, gain_se (paired; None under two pairs)."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for family, b, a in all_pairs:
        groups.setdefault(family, []).append((b, a))
        groups.setdefault("all", []).append((b, a))
    rows = []
    for family in sorted(groups, key=lambda f: (f == "all", f)):
        values = groups[family]
        n = len(values)
        diffs = [a - b for b, a in values]
        gain = sum(diffs) / n
        se = math.sqrt(sum((d - gain) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else None
        rows.append(
            {
                "family": family,
                "n": n,
                "before": sum(b for b, _ in values) / n,
                "after": sum(a for _, a in values) / n,
                "gain": gain,
                "gain_se": se,
                "up": sum(d > 0 for d in diffs),
                "down": sum(d < 0 for d in diffs),
            }
        )
    return rows


def family_table(results: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]], mode: str) -> str:
    """Markdown per-family table of ``mode`` over (before, after) result dicts; "" where none has per-task rewards."""
    rows = family_rows(p for before, after in results for p in pairs(before, after, mode))
    if not rows:
        return ""
    lines = [
        f"{mode}, per task family (pairs pooled over harnesses and runs):",
        "| family | pairs | before | after | gain ± paired s.e. | tasks up / down |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        se = f" ± {r['gain_se']:.3f}" if r["gain_se"] is not None else ""
        name = f"**{r['family']}**" if r["family"] == "all" else r["family"]
        lines.append(
            f"| {name} | {r['n']} | {r['before']:.3f} | {r['after']:.3f} | {r['gain']:+.3f}{se} | "
            f"{r['up']} / {r['down']} |"
        )
    return "\n".join(lines)


def family_tables(results: list[tuple[Mapping[str, Any], Mapping[str, Any]]], modes: Iterable[str]) -> str:
    """One table per mode, blank-line separated (modes with no pairs left out)."""
    return "\n\n".join(t for t in (family_table(results, m) for m in modes) if t)
