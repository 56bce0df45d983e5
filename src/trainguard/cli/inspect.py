"""``trainguard ls``, ``info`` and ``verify``: read-only inspection of a run root."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..catalog import read_manifest, scan
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format import MANIFEST_NAME, TensorEntry
from ..recovery.events import read_events
from .main import main


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def console() -> Any:
    """A rich console that does not cut tables to 80 columns when the output is a pipe or a CI log."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200, highlight=False)


def _root(root: str) -> Path:
    p = Path(root)
    if not p.is_dir():
        raise click.UsageError(f"run root {root!r} does not exist or is not a directory")
    return p


def _save_timings(root: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for ev in read_events(root, event="save"):
        if isinstance(ev.get("step"), int):
            out[ev["step"]] = ev
    return out


@main.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of {step, status, bytes, time}.")
def ls_cmd(root: str, as_json: bool) -> None:
    """List the checkpoints under ROOT with status (valid / corrupt / incomplete), size and time."""
    p = _root(root)
    infos = scan(p, failed_saves=True)
    timings = _save_timings(p)
    if as_json:
        rows = []
        for i in infos:
            row: dict[str, Any] = i.to_json()
            ev = timings.get(i.step)
            if ev is not None:
                row.update(block_s=ev.get("block_s"), persist_s=ev.get("persist_s"))
            rows.append(row)
        click.echo(json.dumps(rows, indent=1))
        return
    from rich.table import Table

    table = Table(title=f"checkpoints in {p}")
    for col in ("step", "status", "size", "time", "block s", "persist s", "problem"):
        table.add_column(col, justify="right" if col in ("step", "size", "block s", "persist s") else "left")
    for i in infos:
        ev = timings.get(i.step, {})
        color = {"valid": "green", "unverified": "cyan", "corrupt": "red", "incomplete": "yellow"}[i.status]
        table.add_row(
            str(i.step),
            f"[{color}]{i.status}[/]",
            human_bytes(i.bytes),
            i.time or "",
            _fmt_s(ev.get("block_s")),
            _fmt_s(ev.get("persist_s")),
            (i.problem or "")[:80],
        )
    console().print(table if infos else f"no checkpoints in {p}")


def _fmt_s(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else ""


@main.command("info")
@click.argument("root")
@click.argument("step", required=False, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the checkpoint's summary as JSON.")
def info_cmd(root: str, step: int | None, as_json: bool) -> None:
    """Show what the checkpoint of STEP (default: the newest valid or unverified one) under ROOT holds, and its
    status as ``ls`` lists it."""
    p = _root(root)
    listed = {i.step: i for i in scan(p)}
    if step is None:
        valid = [s for s, i in sorted(listed.items()) if i.usable]
        if not valid:
            click.echo(f"no valid checkpoint in {p}", err=True)
            sys.exit(1)
        step = valid[-1]
    try:
        m = read_manifest(p, step)
    except CheckpointNotFoundError as e:
        raise click.UsageError(str(e)) from None
    except CorruptCheckpointError as e:
        click.echo(f"step {step}: {e}", err=True)
        sys.exit(1)
    entries: list[dict[str, Any]] = []
    for fqn, ent in m.entries.items():
        if isinstance(ent, TensorEntry):
            entries.append(
                {
                    "fqn": fqn,
                    "kind": "tensor",
                    "dtype": ent.dtype,
                    "shape": list(ent.shape),
                    "shards": len(ent.shards),
                    "bytes": sum(s.nbytes for s in ent.shards),
                }
            )
        else:
            entries.append({"fqn": fqn, "kind": "value", "codec": ent.codec})
    summary = {
        "step": m.step,
        "time": m.time,
        "world_size": m.world_size,
        "format_version": m.format_version,
        "bytes": m.bytes,
        "chunks": len(m.chunks),
        "metrics": m.metrics,
        "metadata": m.metadata,
        "top_level": m.top_level,
        "entries": entries,
        "status": listed[step].status if step in listed else None,  # as `ls` lists it (the last full read)
        "problem": listed[step].problem if step in listed else None,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1))
        return
    from rich.table import Table

    c = console()
    c.print(
        f"[bold]step {m.step}[/]  {m.time}  world size {m.world_size}  format v{m.format_version}  "
        f"{human_bytes(m.bytes)} in {len(m.chunks)} chunks"
    )
    if summary["status"] is not None:
        c.print(f"status: {summary['status']}" + (f" ({summary['problem']})" if summary["problem"] else ""))
    if m.metrics:
        c.print("metrics: " + ", ".join(f"{k}={v}" for k, v in m.metrics.items()))
    table = Table()
    for col in ("entry", "kind", "dtype / codec", "shape", "bytes"):
        table.add_column(col)
    for row in entries:
        table.add_row(
            row["fqn"],
            row["kind"],
            row.get("dtype") or row.get("codec", ""),
            str(row.get("shape", "")),
            human_bytes(row["bytes"]) if "bytes" in row else "",
        )
    c.print(table)


@main.command("verify")
@click.argument("root")
@click.option("--step", type=int, default=None, help="Check only this step.")
@click.option("--all", "all_steps", is_flag=True, help="Check every committed checkpoint.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print {ok, checked, corrupt: [{step, chunk, tensors}]}."
)
def verify_cmd(root: str, step: int | None, all_steps: bool, as_json: bool) -> None:
    """Re-read every chunk of the checkpoints under ROOT and check CRC32C.

    Default: the newest committed checkpoint. Exit 1 if anything is corrupt, naming the chunk and the
    tensors it holds.
    """
    from ..catalog import step_dirs
    from ..integrity.verify import verify

    p = _root(root)
    if step is not None and all_steps:
        raise click.UsageError("give either --step N or --all, not both")
    dirs, _ = step_dirs(p)
    committed = [s for s, d in dirs.items() if (d / MANIFEST_NAME).exists()]
    if step is not None:
        steps: list[int] | None = [step]
    elif all_steps:
        steps = None
    else:
        steps = [max(committed)] if committed else []
    show = not as_json and sys.stderr.isatty()
    try:
        if show:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            with Progress(
                "verify", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True
            ) as prog:
                task = prog.add_task("verify", total=None)
                report = verify(p, steps, progress=lambda d, t: prog.update(task, completed=d, total=t))
        else:
            report = verify(p, steps)
    except CheckpointNotFoundError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=1))
    else:
        if not report.checked:
            click.echo(f"no committed checkpoints in {p}")
        for s in report.checked:
            bad = [c for c in report.corrupt if c["step"] == s]
            if not bad:
                click.echo(f"step {s}: ok")
            for c in bad:
                click.echo(f"step {s}: CORRUPT {c['problem']}")
        n_bad = len({c["step"] for c in report.corrupt})
        verdict = "OK" if report.ok else f"FAILED: {n_bad} of"
        click.echo(
            f"{verdict} {len(report.checked)} checkpoint(s) checked, {human_bytes(report.bytes_read)} re-read"
        )
    sys.exit(0 if report.ok else 1)
