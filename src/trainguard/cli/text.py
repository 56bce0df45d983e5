"""The CLI's terminal-safe output (:func:`echo`; :func:`printable` and :func:`markup` from
:mod:`trainguard._text`) and its STEP-argument commands."""

from __future__ import annotations

import re
from typing import Any

import click

from .._text import markup, printable

__all__ = ["StepCommand", "echo", "markup", "printable"]


def echo(message: Any = "", err: bool = False) -> None:
    """``click.echo`` of a message composed by the CLI, control characters escaped (newlines kept)."""
    click.echo(printable(message, lines=True), err=err)


_NEGATIVE = re.compile(r"-\d+")


class StepCommand(click.Command):
    """A command with a STEP argument: a negative-looking STEP (``-1``) is a clear usage error (exit 2), not
    click's "No such option: -1"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        takes_value = {
            name for p in self.params if isinstance(p, click.Option) and not p.is_flag for name in p.opts
        }
        for prev, a in zip([None, *args], args, strict=False):
            if a == "--":
                break
            if _NEGATIVE.fullmatch(a) and prev not in takes_value:  # `--suspect -1` is a reason
                raise click.UsageError(
                    f"STEP {a} is negative: steps are integers >= 0 (`trainguard ls ROOT` lists them)", ctx
                )
        return super().parse_args(ctx, args)
