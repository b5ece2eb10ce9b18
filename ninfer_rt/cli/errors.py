"""How the commands report command-line mistakes: one "Error: ..." line and exit status 2, no usage screen."""

from __future__ import annotations

from typing import Any

import click


class OneLineErrors(click.Command):
    """Usage errors, while parsing or in the command itself, print as one line; the exit status stays 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            exc.ctx = None  # without a context click prints just "Error: message"
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.ctx = None
            raise


class BadUsage(click.ClickException):
    """A mistake found after parsing (missing model, invalid sampling values): one line, exit status 2."""

    exit_code = 2
