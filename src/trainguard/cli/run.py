"""``trainguard run``: supervise a training command, restart it on failure, report time-to-resume."""

from __future__ import annotations

import json
import os
import sys

import click
from rich import box
from rich.console import Console
from rich.table import Table

from ..errors import ConfigError
from ..recovery.config import EXIT_CODES, ROOT_ENV, Backoff, SupervisorConfig
from ..recovery.heartbeat import parse_signal
from ..recovery.supervisor import RunResult, Supervisor
from ..recovery.ttr import PHASES
from .main import main
from .text import echo

_EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {code:<6} {meaning}" for code, meaning in EXIT_CODES.items())


@main.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog=_EPILOG,
)
@click.option(
    "--max-restarts", type=int, default=10, show_default=True, help="Restarts before giving up (exit 3)."
)
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=None,
    help="Seconds without a heartbeat before the job counts as hung and its process group is killed. "
    "Armed by the job's first heartbeat. Default: off.",
)
@click.option(
    "--startup-timeout",
    type=float,
    default=None,
    help="Seconds from launch to the first heartbeat before the job counts as hung. Default: off.",
)
@click.option(
    "--grace-period", type=float, default=30.0, show_default=True, help="Seconds from SIGTERM to SIGKILL."
)
@click.option("--backoff", type=float, default=1.0, show_default=True, help="Initial restart delay, seconds.")
@click.option(
    "--max-backoff", type=float, default=60.0, show_default=True, help="Maximum restart delay, seconds."
)
@click.option(
    "--backoff-factor",
    type=float,
    default=2.0,
    show_default=True,
    help="Delay growth per restart in a row without progress.",
)
@click.option(
    "--no-progress-limit",
    type=int,
    default=3,
    show_default=True,
    help="Give up (exit 4) after this many restarts in a row whose heartbeat step did not advance; 0: off.",
)
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Run root for the event log; use the job's checkpoint root so the manager's restore timings join "
    "the TTR report. Default: $TRAINGUARD_ROOT, else ./trainguard-run.",
)
@click.option(
    "--run-id",
    default=None,
    help="The job's id, shared by every node's supervisor on the same --root: one restart budget "
    "(--max-restarts for the whole job) and one event history. Default: torchrun's --rdzv-id in COMMAND, "
    "else a new id.",
)
@click.option(
    "--preempt-signal",
    "preempt_signals",
    multiple=True,
    metavar="SIGNAL",
    help="A signal (e.g. USR1, as Slurm's --signal=USR1@120 sends) meaning the job is about to be stopped: "
    "the job gets SIGTERM (save_on_preemption=True saves and exits), the job's own handler also catches "
    "SIGNAL, and trainguard run exits 75 without restarting so the batch script can requeue. Repeatable.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics of the run at http://127.0.0.1:PORT/metrics while it runs (this machine "
    "only; 0: any free port). Default: off.",
)
@click.option(
    "--prefetch/--no-prefetch",
    default=None,
    help="While each attempt starts, have the newest usable checkpoint under --root read into this node's "
    "page cache so the job's restore reads memory, not the disk (at most half the available memory, not for a "
    "manifest over 1 MiB; the restore still checks every chunk). Default: on, off for a multi-node COMMAND "
    "(srun/mpirun/..., or torchrun --nnodes other than 1). Not `trainguard prefetch` (tiers to hot root).",
)
@click.option("--poll-interval", type=float, default=0.1, show_default=True, hidden=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary instead of the table.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_command(
    max_restarts: int,
    heartbeat_timeout: float | None,
    startup_timeout: float | None,
    grace_period: float,
    backoff: float,
    max_backoff: float,
    backoff_factor: float,
    no_progress_limit: int,
    root: str | None,
    run_id: str | None,
    preempt_signals: tuple[str, ...],
    metrics_port: int | None,
    prefetch: bool | None,
    poll_interval: float,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND, restarting it from its newest valid checkpoint when it fails or hangs.

    \b
      trainguard run --max-restarts 10 --heartbeat-timeout 300 --root ckpts/run1 \\
          -- torchrun --nproc-per-node 8 train.py

    COMMAND runs in its own process group with TRAINGUARD_RESTART_COUNT, TRAINGUARD_RUN_ID,
    TRAINGUARD_HEARTBEAT_FILE, TRAINGUARD_ROOT and TRAINGUARD_ATTEMPT_ID (a token per attempt, inherited
    by the job's descendants: after an attempt the supervisor stops only the processes carrying it) in its
    environment. SIGTERM/SIGINT are forwarded to it
    and the supervisor then stops without restarting. Each recovery's time-to-resume phases are printed as
    they complete; a summary follows at the end.
    """
    if not command:
        raise click.UsageError("no COMMAND given; usage: trainguard run [OPTIONS] -- COMMAND [ARGS]...")
    job_root = next((a for a in command if a == "--root" or a.startswith("--root=")), None)
    if root is None and job_root is not None and not os.environ.get(ROOT_ENV):
        echo(
            "[trainguard] note: the --root after COMMAND goes to the job, not to `trainguard run`, so the "
            "supervisor's event log goes to the default root (its path follows). Give the supervisor the "
            "same root before COMMAND: trainguard run --root R -- python train.py --root R",
            err=True,
        )
    try:
        config = SupervisorConfig(
            max_restarts=max_restarts,
            heartbeat_timeout_s=heartbeat_timeout,
            startup_timeout_s=startup_timeout,
            grace_period_s=grace_period,
            backoff=Backoff(initial_s=backoff, max_s=max(backoff, max_backoff), factor=backoff_factor),
            max_no_progress_restarts=no_progress_limit,
            root=root,
            poll_interval_s=poll_interval,
            run_id=run_id,
            preempt_signals=tuple(parse_signal(s) for s in preempt_signals),
            metrics_port=metrics_port,
            prefetch=prefetch,
        )
        supervisor = Supervisor(command, config)
        result = supervisor.run()  # a metrics port that cannot be bound fails here, before any launch
    except ConfigError as e:
        raise click.UsageError(str(e)) from e
    if as_json:
        echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        # A log file has no width; do not squeeze the phase columns into 80.
        print_summary(result, Console(file=sys.stdout, width=None if sys.stdout.isatty() else 132))
    sys.exit(result.exit_code)


_PHASE_HEADERS = {
    "detection_s": "detect",
    "teardown_s": "kill",
    "backoff_s": "backoff",
    "relaunch_s": "launch",
    "identification_s": "scan",
    "load_s": "load",
    "validation_s": "valid",
    "first_step_s": "1st step",
}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_summary(result: RunResult, console: Console) -> None:
    """Print the attempts, the recoveries with their TTR phases, and the final status as rich tables.

    Args:
        result: what :meth:`Supervisor.run` returned.
        console: where to print.
    """
    attempts = Table(
        title=f"trainguard run {result.run_id}: attempts", title_justify="left", box=box.SIMPLE_HEAD
    )
    for col in ("attempt", "pid", "outcome", "exit", "signal", "last step", "runtime s"):
        attempts.add_column(col, justify="right" if col not in ("outcome", "signal") else "left")
    for a in result.attempts:
        attempts.add_row(
            str(a.attempt),
            str(a.pid),
            a.outcome,
            "-" if a.exit_code is None else str(a.exit_code),
            a.signal or "-",
            "-" if a.last_step is None else str(a.last_step),
            _fmt(a.t_end - a.t_start),
        )
    if result.attempts:
        console.print(attempts)
    if result.recoveries:
        rec = Table(title="recoveries (time-to-resume, seconds)", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("restart", "restored", "lost", "ttr", *(_PHASE_HEADERS[p] for p in PHASES)):
            rec.add_column(col, justify="right")
        for r in result.recoveries:
            rec.add_row(
                str(r.restart_count),
                "-" if r.restored_step is None else str(r.restored_step),
                "-" if r.steps_lost is None else str(r.steps_lost),
                _fmt(r.ttr_s),
                *(_fmt(r.phases.get(p)) for p in PHASES),
            )
        console.print(rec)
    reason = f" ({result.error or result.reason})" if result.error or result.reason else ""
    console.print(
        f"status: {result.status}{reason}; attempts {len(result.attempts)}, failures {len(result.failures)}; "
        f"exit code {result.exit_code}",
        highlight=False,
        markup=False,
    )
    if result.event_log:
        console.print(f"event log: {result.event_log}", highlight=False, markup=False)
