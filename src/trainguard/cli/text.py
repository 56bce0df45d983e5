"""Terminal-safe text for the CLI's human-readable output.

A checkpoint is untrusted input: an entry key, a metric name, a problem string or a run root's path may hold
terminal control sequences (``ESC [ 2 J`` clears the screen, ``ESC ] 0 ; ... BEL`` retitles the window). Every
human-readable line the CLI prints from such data goes through :func:`printable` (plain text, via :func:`echo`)
or :func:`markup` (rich markup), which show each control character (C0, DEL, C1) as a visible ``\\xNN``
escape. ``--json`` output needs nothing: ``json.dumps`` already escapes them.
"""

from __future__ import annotations

import re
from typing import Any

import click

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _show(m: re.Match[str]) -> str:
    return f"\\x{ord(m.group()):02x}"


def printable(text: Any, *, lines: bool = False) -> str:
    """``str(text)`` with every control character (C0, DEL, C1) replaced by its ``\\xNN`` escape.

    Args:
        text: anything; converted with ``str``.
        lines: keep newlines and tabs (for a whole message the CLI composed; never for one field).

    Returns:
        The text, safe to write to a terminal: ``"k\\x1b[2J"`` becomes the 9 characters ``k\\x1b[2J``.
    """
    return (_CONTROL_BUT_LINES if lines else _CONTROL).sub(_show, str(text))


def markup(text: Any) -> str:
    """``text`` for a rich markup string: control characters escaped as by :func:`printable`, and ``[``
    escaped so that data never becomes markup."""
    from rich.markup import escape

    return escape(printable(text))


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
