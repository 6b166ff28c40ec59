"""A demo run's recorded state: which harnesses it mixes (checked before anything starts), its config (so
``clawstream demo --resume RUN`` continues it in a later session) and ``summary.json``, rewritten as results arrive.

Nothing here reads Kafka: a resumed run's progress is in its event log (the scheduler, streams, learner and engine
each resume from the run's topics and weight store on their own); this module only finds the run again.
Files under ``$CLAWSTREAM_HOME/demo/<run>/``: ``state.json`` (written before the services start), ``summary.json``.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, TypeVar

from clawbase.errors import ClawstreamError

STATE = "state.json"
SUMMARY = "summary.json"
# What --resume may change: how far and how long to go, how it is shown. Anything else would make the resumed part
# a different run under the same topics (another mix, group size or model under the same step numbers).
RESUMABLE = frozenset({"steps", "timeout_s", "progress", "track"})

C = TypeVar("C")


def parse_harnesses(text: str) -> tuple[str, ...]:
    """``--harnesses opencode,agentloop`` → ("opencode", "agentloop"): order kept, blanks and repeats dropped."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ClawstreamError(f"--harnesses {text!r}: name at least one harness, e.g. --harnesses opencode,agentloop")
    return names


def harness_mix(names: tuple[str, ...]) -> dict[str, float]:
    """Equal shares: the scheduler gives each harness the same number of a step's groups, the batcher fills each
    batch toward the same shares."""
    return {name: 1.0 for name in names}


def real_harnesses(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names that run an installed binary (not the built-in loops)."""
    from producers.harnesses.catalog import all_adapters

    adapters = all_adapters()
    return tuple(n for n in names if n in adapters and adapters[n].install is not None)


def check_harnesses(names: tuple[str, ...], tasks_per_step: int, home: Path | None = None) -> None:
    """Refuse, before anything starts, a name that is no built-in harness, a real harness whose binary is not
    installed (the sandbox worker would npm-install it mid-run, or fail every rollout offline), and fewer groups
    per step than harnesses (the batcher would wait for a harness that never gets a group)."""
    from producers.harnesses.catalog import all_adapters
    from producers.harnesses.install import NODE24, executable, harness_root, installed_spec, package_of

    ADAPTERS = all_adapters(home)  # noqa: N806 - the built-in adapters and the added ones
    if not names:
        raise ClawstreamError("--harnesses: name at least one harness, e.g. --harnesses opencode,agentloop")
    for name in names:
        adapter = ADAPTERS.get(name)
        if adapter is None:
            raise ClawstreamError(
                f"--harnesses: unknown harness {name!r}; known: {', '.join(sorted(ADAPTERS))} "
                "(`clawstream harness list`)"
            )
        if adapter.install is None:
            continue  # built in: runs in the sandbox's Python
        root = harness_root(home)
        pkg = package_of(adapter)
        if pkg is None or pkg.kind == "path":
            continue  # an executable named by path: used as it is
        exe, have = executable(pkg, root), installed_spec(pkg, root)
        if have is None or not exe.exists():
            raise ClawstreamError(
                f"--harnesses: {name} is a real harness and its binary is not installed ({exe} missing); install it "
                f"once with `clawstream harness install {name}` (needs npm and the npm registry)"
            )
        if have != pkg.spec:
            raise ClawstreamError(
                f"--harnesses: {name} is installed as {have}, pinned {pkg.spec}; `clawstream harness install "
                f"{name}` installs the pinned version (or set CLAWSTREAM_HARNESS_VERSIONS)"
            )
        if adapter.node24 and not executable(NODE24, root).exists():
            raise ClawstreamError(
                f"--harnesses: {name} needs Node 24, not installed; `clawstream harness install {name}` installs it too"
            )
    if tasks_per_step < len(names):
        raise ClawstreamError(
            f"--tasks-per-step {tasks_per_step} is fewer than the {len(names)} harnesses of --harnesses: every "
            f"harness needs a group in every step; use --tasks-per-step {len(names)} or more"
        )


def save_state(run_dir: Path, prefix: str, config: Any) -> None:
    """Record what ``--resume`` needs to continue the run (written before any service starts)."""
    _write_json(run_dir / STATE, {"prefix": prefix, "config": asdict(config)})


def load_state(home: Path, run: str, cls: type[C], overrides: dict[str, Any]) -> tuple[Path, str, C]:
    """(run dir, topic prefix, config) of run ``run`` under ``home/demo``, the recorded config with ``overrides``
    applied; an override of anything outside :data:`RESUMABLE` that differs from the recorded value is refused."""
    run_dir = home / "demo" / run
    if not run_dir.is_dir():
        raise ClawstreamError(f"--resume {run}: no run directory {run_dir} (runs: ls {home / 'demo'})")
    path = run_dir / STATE
    if not path.exists():
        raise ClawstreamError(
            f"--resume {run}: {path} is missing (the run was started before runs recorded their state, or was "
            "stopped before its services started); start a new run instead"
        )
    data = json.loads(path.read_text())
    recorded = restore(cls, data["config"])
    changed = {k: v for k, v in overrides.items() if getattr(recorded, k) != v and k not in RESUMABLE}
    if changed:
        flags = ", ".join(f"--{k.replace('_', '-').removesuffix('-s')}" for k in sorted(changed))
        raise ClawstreamError(
            f"--resume {run}: {flags} differ from the recorded run; a resumed run keeps its config "
            f"(only {', '.join(sorted(RESUMABLE))} may change); start a new run to change them"
        )
    merged = restore(cls, {**asdict(recorded), **{k: v for k, v in overrides.items() if k in RESUMABLE}})  # type: ignore[call-overload]
    return run_dir, str(data["prefix"]), merged


def restore(cls: type[C], data: dict[str, Any]) -> C:
    """A config dataclass from its ``asdict`` JSON (lists back to tuples, the model back to a Path)."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
    if values.get("model") is not None:
        values["model"] = Path(str(values["model"]))
    return cls(**values)


class Summary:
    """``summary.json`` of a run, rewritten whole (atomically) at every update, so an interrupted run leaves what it
    had measured; a resumed run starts from the file it left."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / SUMMARY
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def update(self, **values: Any) -> None:
        self.data.update(values)
        _write_json(self.path, self.data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)  # a reader (or a kill mid-write) never sees half a file
