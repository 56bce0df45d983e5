"""``trainguard demo``: train a real GPT under the supervisor with injected failures and prove the result is
bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..errors import ConfigError
from .main import main
from .text import echo, markup


@main.command("demo")
@click.option("--steps", type=int, default=200, show_default=True, help="Training steps of each run.")
@click.option(
    "--failures",
    type=int,
    default=5,
    show_default=True,
    help="Failures to inject (the first five are one of each kind).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=Path("trainguard-demo"),
    show_default=True,
    help="Output directory (its faulted/ and reference/ runs are replaced).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the failure plan.")
@click.option("--save-every", type=int, default=20, show_default=True, help="Checkpoint interval in steps.")
@click.option(
    "--heartbeat-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds without a heartbeat before a hang is declared.",
)
@click.option(
    "--script",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="The training script (default: examples/train_gpt.py of this checkout).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def demo_cmd(
    steps: int,
    failures: int,
    out: Path,
    seed: int,
    save_every: int,
    heartbeat_timeout: float,
    script: Path | None,
    as_json: bool,
) -> None:
    """Train a byte-level GPT on the Python standard library's source under `trainguard run`, inject failures
    (SIGKILL in a step, SIGKILL mid-save, a hang, a corrupted newest checkpoint caught by CRC32C, and silent
    corruption: a weight and its recorded CRC32C both rewritten, caught only by the probe fingerprint), train
    the same job uninterrupted, and check both end bit-identical.

    Exit 0 when the final state is identical and every recovery succeeded, 1 otherwise, 2 on bad options.
    """
    from ..demo import DemoConfig, run_demo

    try:
        cfg = DemoConfig(
            steps=steps,
            failures=failures,
            out=out,
            seed=seed,
            save_every=save_every,
            heartbeat_timeout_s=heartbeat_timeout,
            script=script,
        )
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    say = (lambda msg: echo(msg, err=True)) if as_json else echo
    try:
        summary = run_demo(cfg, echo=say, progress=not as_json and sys.stdout.isatty())
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        echo(json.dumps(summary, indent=1, default=str))
    else:
        print_summary(summary)
    sys.exit(0 if summary["ok"] else 1)


SHORT = {
    "detection_s": "detect",
    "teardown_s": "teardown",
    "backoff_s": "backoff",
    "relaunch_s": "relaunch",
    "identification_s": "find",
    "load_s": "load",
    "validation_s": "validate",
    "first_step_s": "1st step",
}


def print_summary(s: dict) -> None:
    from rich.table import Table

    from ..demo import KIND_LABELS
    from .inspect import console, human_bytes

    c = console()
    ck = s["checkpoints"]
    c.print(
        f"\n[bold]trainguard demo[/]: {s['steps']} steps, final train loss {s['final_loss']:.4f}, "
        f"validation loss {s['val_loss']:.4f}"
        if s["final_loss"] is not None
        else "\n[bold]trainguard demo[/]"
    )
    c.print(
        f"checkpoints: {ck['count']} written, {human_bytes(ck['bytes'])} referenced "
        f"({human_bytes(ck['bytes_written'])} new), blocking per save mean {ck['mean_block_s'] * 1000:.1f} ms, "
        f"max {ck['max_block_s'] * 1000:.1f} ms, persist mean {ck['mean_persist_s'] * 1000:.0f} ms"
    )
    t = Table(title="failures and time-to-resume (TTR, seconds)")
    for col in ("failure", "after step", "resumed from", "steps lost", "TTR", "phases"):
        t.add_column(col, justify="left" if col in ("failure", "phases") else "right")
    for f in s["failures"]:
        ok = f["recovered"] and f["resumed_from_newest_valid"]
        label = KIND_LABELS[f["kind"]] + ("" if ok else " [red](FAILED)[/]")
        phases = " ".join(f"{SHORT.get(k, k)} {v:.2f}" for k, v in f["phases"].items() if v and v >= 0.005)
        t.add_row(
            label,
            str(f["step"]),
            str(f["resumed_from"]),
            str(f["steps_lost"]),
            f"{f['ttr_s']:.2f}" if f["ttr_s"] is not None else "-",
            phases,
        )
    c.print(t)
    for f in s["failures"]:
        if f["corrupt_chunk_reported"]:
            c.print(
                f"corrupt chunk detected at resume and skipped: {', '.join(map(str, f['corrupt_chunk_reported']))}"
            )
        for sk in f.get("suspect_skipped", []):
            c.print(
                f"suspect checkpoint detected at resume and skipped: step {sk['step']} ({markup(str(sk['problem']))})"
            )
    c.print(
        f"goodput: {s['goodput'] * 100:.1f}% (as in the report: productive training time over wall time, from the "
        f"event log; the surviving steps computed {s['useful_train_s']:.1f} s of {s['wall_s']:.1f} s wall; the "
        f"reference run took {s['reference_wall_s']:.1f} s)"
    )
    verdict = "[green]yes[/]" if s["identical"] else "[red]no[/]"
    c.print(
        f"final state identical to uninterrupted run: {verdict} ({s['tensors_compared']} model and optimizer "
        "tensors compared bitwise)"
    )
    if s["differences"]:
        c.print("differences: " + ", ".join(s["differences"]))
    c.print(f"logs and checkpoints: {s['out']}")
    if s.get("report"):
        c.print(f"report: {s['report']}")
