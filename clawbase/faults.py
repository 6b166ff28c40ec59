"""The one fault-injection seam: named points in the code where a test makes the process crash, raise, or hold still.

Code marks a point with ``fault_point("learner.after_save")``. Nothing happens unless the environment variable
``CLAWSTREAM_FAULTS`` names it, as a comma-separated list of ``NAME=ACTION`` (``NAME`` may end in ``@N``: act on the
N-th time the point is reached, counted per process, default the first; or in ``@armed``: act on the first arrival
after a test armed the point, :func:`arm`, when the system reached the state it wants):

- ``crash``: exit at once with status 86 (``os._exit``: no ``finally``, no flush, no commit — as a kill -9 would);
- ``kill``: SIGKILL itself (the exit a supervisor sees after an OOM kill);
- ``raise``: raise :class:`InjectedFault` (an unexpected error at that point, e.g. inside a training step);
- ``hold``: write ``NAME.held`` (the pid) into ``CLAWSTREAM_FAULT_DIR``, then wait until ``NAME.release`` appears
  there; meanwhile the test acts on the held process (kill -9, SIGSTOP, stopping a broker) at a moment chosen by the
  system's state, never by a sleep.

Helpers for tests: :func:`fault_env`, :func:`arm`, :func:`wait_held`, :func:`release`. Imports nothing of the
project (the bottom of the layers), so any module may mark a point. docs/faults.md lists the points.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "CLAWSTREAM_FAULTS"
DIR_ENV = "CLAWSTREAM_FAULT_DIR"
CRASH_STATUS = 86
ACTIONS = ("crash", "kill", "hold", "raise")


class FaultSpecError(ValueError):
    """``CLAWSTREAM_FAULTS`` is malformed (raised at the first fault point reached, naming the fix)."""


class InjectedFault(RuntimeError):
    """Action ``raise``: stands for any unexpected error at the point (not a ``ClawstreamError``: nothing planned)."""


@dataclass(frozen=True)
class Fault:
    point: str
    action: str
    nth: int = 1  # 0: armed (acts on the first arrival after the test armed it)


def parse(spec: str) -> dict[str, Fault]:
    """``"a.b=crash,c.d@3=hold"`` → faults by point name."""
    faults: dict[str, Fault] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, action = item.partition("=")
        point, _, nth = name.partition("@")
        armed = nth == "armed"
        if not sep or action not in ACTIONS or not point or (nth and not nth.isdigit() and not armed) or nth == "0":
            raise FaultSpecError(
                f"{ENV}: {item!r} is not NAME[@N|@armed]=ACTION with ACTION one of {', '.join(ACTIONS)}"
            )
        faults[point] = Fault(point, action, 0 if armed else int(nth or 1))
    return faults


_seen: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Crash, kill, raise or hold here when ``CLAWSTREAM_FAULTS`` names this point (its N-th arrival); else nothing."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    fault = parse(spec).get(name)
    if fault is None:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if fault.nth == 0:  # armed: one stat per arrival, and the arming is used up
        armed = _folder() / f"{name}.arm"
        try:
            armed.unlink()
        except FileNotFoundError:
            return
    elif _seen[name] != fault.nth:
        return
    print(f"fault injection: {fault.action} at {name} (arrival {_seen[name]}, pid {os.getpid()})", flush=True)
    if fault.action == "crash":
        os._exit(CRASH_STATUS)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "raise":
        raise InjectedFault(f"fault injection: raise at {name} (arrival {_seen[name]})")
    _hold(name)


def _folder() -> Path:
    return Path(os.environ.get(DIR_ENV) or ".")


def _hold(name: str) -> None:
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    release_file = folder / f"{name}.release"
    (folder / f"{name}.held").write_text(str(os.getpid()))
    while not release_file.exists():
        time.sleep(0.05)


def fault_env(folder: Path, **points: str) -> dict[str, str]:
    """Environment entries for a child process: ``fault_env(tmp, **{"learner.after_save": "hold"})``."""
    return {ENV: ",".join(f"{point}={action}" for point, action in points.items()), DIR_ENV: str(folder)}


def arm(folder: Path, name: str) -> None:
    """Make point ``name`` (configured ``NAME@armed=ACTION``) act at its next arrival in the process of ``folder``."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{name}.arm").touch()


def wait_held(folder: Path, name: str, timeout: float = 120.0, alive: object = None) -> int:
    """Wait until a process holds at point ``name``; returns its pid. ``alive`` (a ``Popen``) ends the wait early
    with an error when that process exits instead."""
    marker = Path(folder) / f"{name}.held"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if alive is not None and alive.poll() is not None:  # type: ignore[attr-defined]
            raise RuntimeError(f"the process exited ({alive.returncode}) before reaching fault point {name}")  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process reached fault point {name} within {timeout:.0f}s")
        time.sleep(0.05)
    while True:  # the pid is written after the file is created: wait for a whole number
        text = marker.read_text().strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.01)


def release(folder: Path, name: str) -> None:
    """Let a process held at ``name`` go on."""
    (Path(folder) / f"{name}.release").touch()
