"""Progress bars with ETA for the long phases a user waits on (warm start, evaluation, the demo's steps).

A thin layer over ``tqdm``: on a terminal a live bar (rate and ETA); when the output is a file or a pipe (CI logs,
``make demo > log``) a full line at most every ``log_interval_s`` seconds instead of carriage-return redraws, so a
log stays readable. Pure presentation: no Kafka, no torch.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class _Off:
    """The bar when progress is off: the same methods, nothing printed (``write`` still prints the line)."""

    disable = True
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, _text: str = "", refresh: bool = True) -> None:
        pass

    def set_description_str(self, _text: str = "", refresh: bool = True) -> None:
        pass

    def write(self, message: str) -> None:
        print(message, flush=True)

    def reset(self, total: int | None = None) -> None:
        self.n = 0

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(
    total: int | None,
    desc: str,
    unit: str = "it",
    *,
    enabled: bool = True,
    log_interval_s: float = 30.0,
    stream: TextIO | None = None,
) -> Any:
    """A tqdm bar on ``stream`` (stdout); a no-op object with the same methods when ``enabled`` is false or tqdm is
    missing. ``bar.write(line)`` prints a line above the bar."""
    if not enabled:
        return _Off()
    try:
        from tqdm import tqdm
    except ImportError:  # the `ml` extra brings it; without it the log lines still say what happens
        return _Off()
    out = stream or sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=out,
        dynamic_ncols=tty,
        ncols=None if tty else 100,
        mininterval=0.5 if tty else log_interval_s,
        maxinterval=max(log_interval_s, 10.0),
        ascii=not tty,
        leave=True,
        smoothing=0.1,
    )
