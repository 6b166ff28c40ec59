"""What every family of ``clawstream`` commands shares: the group class and the SIGTERM rule."""

from __future__ import annotations

import signal
import sys

import click

from clawbase.errors import ClawstreamError


class Group(click.Group):
    """Click group that prints our own errors as one clean line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ClawstreamError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)


def sigterm_interrupts() -> None:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does: the ``finally`` that stops a command's child services runs.
    (Python's default SIGTERM ends the process at once, leaving the engine, proxy, workers running.)"""

    def _interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
