"""Entry point of the ``trainguard`` console script.

Exit codes shared by every command: 0 ok, 1 a check failed, 2 usage error (bad option or input).
``trainguard run`` has its own documented codes (see ``trainguard run --help``).
"""

from __future__ import annotations

import click

from .. import __version__
from .text import printable


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except click.ClickException as e:  # a usage error naming a path or checkpoint data: terminal-safe
            e.message = printable(e.message, lines=True)  # type: ignore[misc]
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trainguard")
def main() -> None:
    """trainguard: fast, verified, resumable checkpoints for PyTorch training jobs."""


# Each command module registers itself on `main`.
from . import demo, inspect, interop, observe, plan, run, validate  # noqa: E402, F401
