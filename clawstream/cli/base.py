"""What every family of ``clawstream`` commands shares: the group class and the SIGTERM rule."""

from __future__ import annotations

import sys

import click

from clawbase.errors import ClawstreamError
from clawbase.signals import sigterm_interrupts

__all__ = ["Group", "sigterm_interrupts"]


class Group(click.Group):
    """Click group that prints our own errors as one clean line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except ClawstreamError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            sys.exit(1)
