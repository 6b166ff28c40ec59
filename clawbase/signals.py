"""The SIGTERM rule of every command that starts child processes: ``kill`` stops them as Ctrl-C does."""

from __future__ import annotations

import signal


def sigterm_interrupts() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the ``finally`` that stops a command's child services runs.
    (Python's default SIGTERM ends the process at once, leaving the engine, proxy, workers running.)"""

    def _interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
