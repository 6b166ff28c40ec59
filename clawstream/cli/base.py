"""What every family of ``clawstream`` commands shares: the group class (the SIGTERM rule: clawbase/signals.py)."""

from __future__ import annotations

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
