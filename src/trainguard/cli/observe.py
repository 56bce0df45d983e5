"""``trainguard report`` and ``trainguard status``: a run's figures, plots and live state from its event log."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .inspect import console, event_root, require_run_root
from .main import main
from .text import echo


@main.command("report")
@click.argument("root")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The HTML report to write (default: ROOT/report.html).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report's figures as one JSON object.")
def report_cmd(root: str, output: Path | None, as_json: bool) -> None:
    """Write a self-contained HTML report of the run under ROOT: timeline, save stall and persist times,
    checkpoint sizes and retention, time to resume by phase, goodput, and the checkpoint interval against
    the Young/Daly optimum, with a table of every failure.

    \b
      trainguard report ckpts/run1 -o report.html
      trainguard report ckpts/run1 --json      # the figures, no HTML unless -o is given

    Everything comes from ROOT's event log; a run that is still being written is reported as it stands.
    Exit codes: 0 ok, 2 ROOT is missing or holds no event log, or the report cannot be written.
    """
    from ..observe.figures import report_figures

    p = event_root(root, "report")
    if not (p / "events").is_dir():
        raise click.UsageError(
            f"{root} has no event log (events/); pass the run root that a CheckpointManager or "
            "`trainguard run --root` wrote"
        )
    figs = report_figures(str(p))
    path = None
    if output is not None or not as_json:
        from ..observe.html import write_report

        target = output if output is not None else p / "report.html"
        try:
            path = write_report(figs, target)
        except OSError as e:
            raise click.UsageError(f"cannot write the report to {target}: {e}") from None
    if as_json:
        if path is not None:
            figs["report"] = str(path)
        echo(json.dumps(figs, indent=1, default=str))
        return
    good = figs["goodput"]
    echo(
        f"report: {path}\n{len(figs['failures'])} failure(s), {figs['checkpoints']['count']} checkpoint(s), "
        f"goodput {'-' if good is None else f'{100 * good:.1f} %'}, status {figs['run']['status']}"
    )


@main.command("status")
@click.argument("root")
@click.option("--watch", is_flag=True, help="Refresh the view until Ctrl-C.")
@click.option(
    "--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes with --watch."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object and exit.")
def status_cmd(root: str, watch: bool, interval: float, as_json: bool) -> None:
    """Show where the run under ROOT stands: the current step (heartbeat), the newest valid checkpoint and its
    age, saves in flight, restarts and failures so far.

    Exit codes: 0 ok, 1 ROOT is not a run root (with ``--json``: ``{"error": ...}`` on stdout), 2 ROOT is
    missing or a bad option.
    """
    from ..observe.status import render_status, run_status

    p = event_root(root, "status")
    require_run_root(p, "status", as_json)
    if not interval > 0:
        raise click.UsageError(f"--interval must be > 0 seconds, got {interval}")
    if as_json:
        echo(json.dumps(run_status(p), indent=1, default=str))
        return
    c = console()
    if not watch:
        c.print(render_status(run_status(p)))
        return
    from rich.live import Live

    try:
        if not c.is_terminal:  # a pipe or a log file: one table per refresh, nothing redrawn in place
            while True:
                c.print(render_status(run_status(p)))
                sys.stdout.flush()
                time.sleep(interval)
        with Live(render_status(run_status(p)), console=c, refresh_per_second=4, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(render_status(run_status(p)))
    except KeyboardInterrupt:
        sys.exit(0)
