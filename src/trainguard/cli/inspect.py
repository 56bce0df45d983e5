"""``trainguard ls``, ``info`` and ``verify``: read-only inspection of a run root."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import click

from ..catalog import (
    find_run_roots,
    inspect_step,
    is_committed,
    is_run_root,
    read_manifest,
    scan,
    stable_committed_steps,
    step_dirs,
)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..eventlog import read_events
from ..format import TensorEntry, step_dir_name
from ..storage.objects import is_url
from .main import main
from .remote import ls_url, tier_listing, url_cache, verify_url
from .text import StepCommand, echo, markup

RACE_RETRIES = 100  # rescans when a writer's retention deletes the checkpoint being read


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


def _root(root: str, command: str = "") -> Path:
    """The local run root ``root``; a URL is refused naming the command (``ls``, ``info`` and ``verify``
    take URLs; the others read local files)."""
    if is_url(root):
        raise click.UsageError(
            f"{root!r} is a URL: `trainguard {command or 'this command'}` needs a local run root (a directory); "
            "`trainguard ls|info|verify` take URL roots"
        )
    p = Path(root)
    if not p.is_dir():
        raise click.UsageError(f"run root {root!r} does not exist or is not a directory")
    return p


def event_root(root: str, command: str) -> Path:
    """The local directory holding the event log of ``root``: ``root`` itself, or for a URL run root the
    local cache its writer kept (``$TRAINGUARD_CACHE_DIR``), where its events, heartbeat and metrics are."""
    if not is_url(root):
        return _root(root, command)
    from ..tiers.attach import cache_root

    cache = cache_root(root.rstrip("/"))
    if (cache / "events").is_dir():
        return cache
    raise click.UsageError(
        f"`trainguard {command}` reads the run's event log, which a URL run root keeps on the local disk of the "
        f"machine that ran the job (its cache {cache}, under $TRAINGUARD_CACHE_DIR); there is none here: run "
        f"it on that machine (same TRAINGUARD_CACHE_DIR), or give a local run root. `trainguard ls {root}` "
        "lists the checkpoints stored at the URL"
    )


def _save_timings(root: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for ev in read_events(root, event="save"):
        if isinstance(ev.get("step"), int):
            out[ev["step"]] = ev
    return out


@main.command("ls")
@click.argument("root")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON array of {step, status, bytes, new_bytes, logical_bytes, time, problem, reason}.",
)
def ls_cmd(root: str, as_json: bool) -> None:
    """List the checkpoints under ROOT with status (valid / unverified / corrupt / suspect / incomplete), size
    and time. ``reason`` says why a checkpoint is suspect (its content failed validation) or corrupt.

    ROOT may be a URL (``s3://bucket/run1``). With tiers, ``--json`` adds each step's ``tiers`` mapping."""
    if is_url(root):
        return ls_url(root, as_json)
    p = _root(root)
    require_run_root(p, "ls", as_json)
    infos = scan(p, failed_saves=True)  # a failed save leaves no directory: listed from the event log
    timings = _save_timings(p)
    tiered = tier_listing(p, infos)  # with tiers: each step's tiers mapping, and the steps only on a tier
    if tiered is not None:
        infos = tiered
    if as_json:
        if not infos:
            hint = _runs_hint(p, "ls")
            if hint:
                echo(f"no checkpoints in {p}{hint}", err=True)
        rows = []
        for i in infos:
            row: dict[str, Any] = i.to_json()
            ev = timings.get(i.step)
            if ev is not None:
                row.update(block_s=ev.get("block_s"), persist_s=ev.get("persist_s"))
            rows.append(row)
        echo(json.dumps(rows, indent=1))
        return
    rows = []
    for i in infos:
        ev = timings.get(i.step, {})
        rows.append({**i.to_json(), "block_s": ev.get("block_s"), "persist_s": ev.get("persist_s")})
    if rows:
        print_listing(str(p), rows)
    else:
        echo(f"no checkpoints in {p}" + _runs_hint(p, "ls"))


def print_listing(where: str, rows: list[dict[str, Any]]) -> None:
    """The ``ls`` table of a run root (a path or a URL): one row per step, then each problem whole.

    Args:
        where: the run root as the user gave it (the table's title).
        rows: ``{step, status, bytes, time, problem}`` (and optionally ``block_s``, ``persist_s``) per step;
            ``time`` is ISO 8601 UTC, shown to the second.
    """
    from rich.table import Table

    table = Table(title=f"checkpoints in {markup(where)}")  # every string from data is escaped: no markup
    for col in ("step", "status", "size", "time (UTC)", "block s", "persist s"):
        # fold: a value that does not fit wraps onto the next line, never cut with an ellipsis
        right = col in ("step", "size", "block s", "persist s")
        table.add_column(col, justify="right" if right else "left", overflow="fold")
    problems = []
    for r in rows:
        color = STATUS_COLORS.get(r["status"], "none")
        status = markup(r["status"])
        table.add_row(
            str(r["step"]),
            f"[{color}]{status}[/]",
            human_bytes(r["bytes"]),
            markup((r["time"] or "")[:19].replace("T", " ")),
            _fmt_s(r.get("block_s")),
            _fmt_s(r.get("persist_s")),
        )
        if r["problem"]:
            problems.append(f"step {r['step']} [{color}]{status}[/]: {markup(r['problem'])}")
    c = console()
    c.print(table)
    # Problems are printed whole below the table, wrapped at spaces: never cut to a column's width.
    for line in problems:
        c.print(line, highlight=False, overflow="fold")


def corrupt_line(step: int, problem: str) -> str:
    """``verify``'s line for a corrupt step (``problem`` may itself start with "corrupt")."""
    text = str(problem)
    if text.lower().startswith("corrupt "):
        text = text[len("corrupt ") :]
    return f"step {step}: CORRUPT {text}"


def verify_summary(ok: bool, n_checked: int, n_bad: int, bytes_read: int) -> str:
    """``verify``'s last line: the verdict, the checkpoints checked and the bytes re-read."""
    if ok:
        return f"OK {n_checked} checkpoint(s) checked, {human_bytes(bytes_read)} re-read"
    return f"FAILED: {n_bad} of {n_checked} checkpoint(s) checked failed, {human_bytes(bytes_read)} re-read"


STATUS_COLORS = {
    "valid": "green",
    "unverified": "cyan",
    "corrupt": "red",
    "suspect": "magenta",
    "incomplete": "yellow",
}


def _runs_hint(p: Path, command: str) -> str:
    """Where ``p`` holds no checkpoints: the run roots inside it, and the command to run on one of them."""
    if is_run_root(p):
        return " yet"
    runs = find_run_roots(p)
    if not runs:
        return " (not a run root: it holds no step-N directories, chunks/ or events/)"
    names = ", ".join(str(r) for r in runs)
    return (
        f"; it is not a run root but holds {len(runs)} run root(s): {names}. "
        f"Give one of them, e.g. `trainguard {command} {runs[0]}`"
    )


def require_run_root(p: Path, command: str, as_json: bool) -> None:
    """Refuse a folder that is not a run root, the same way for every command: with ``--json`` a JSON object
    ``{"error": ...}`` on stdout, always a message on stderr, and exit 1. Nothing is created in ``p``."""
    if is_run_root(p):
        return
    message = f"no checkpoints in {p}{_runs_hint(p, command)}"
    if as_json:
        echo(json.dumps({"error": message}))
    echo(f"{command}: {message}", err=True)
    sys.exit(1)


def _fmt_s(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else ""


@main.command("info", cls=StepCommand)
@click.argument("root")
@click.argument("step", required=False, type=click.IntRange(min=0))
@click.option("--json", "as_json", is_flag=True, help="Print the checkpoint's summary as JSON.")
def info_cmd(root: str, step: int | None, as_json: bool) -> None:
    """Show what the checkpoint of STEP (default: the newest valid or unverified one) under ROOT holds.

    Lists every entry (tensors with dtype, shape and bytes; non-tensor values such as a loader position or
    a scheduler's state with their stored value) and the metrics. Exit 1 when the checkpoint is not valid
    (a missing or damaged chunk, a recorded CRC32C mismatch): what can still be read is shown with the
    problem; exit 2 when there is no checkpoint of STEP (the message lists the steps there are).
    """
    from ..incremental.chunkstore import ChunkStore

    p = url_cache(root, step) if is_url(root) else _root(root)
    if not is_url(root):
        require_run_root(p, "info", as_json)
    store = ChunkStore(p)
    latest = step is None
    for _ in range(RACE_RETRIES):  # the newest checkpoint may be deleted by a writer's retention meanwhile
        if latest:
            valid = [i.step for i in scan(p, store) if i.usable]  # what restore_latest would try first
            if not valid:
                message = f"no valid checkpoint in {p}"
                if as_json:
                    echo(json.dumps({"error": message}))
                echo(message, err=True)
                sys.exit(1)
            step = valid[-1]
        assert step is not None
        try:
            m = read_manifest(p, step)
        except CheckpointNotFoundError:
            if latest:
                continue
            steps = [i.step for i in scan(p, store)]
            message = f"no checkpoint of step {step} under {root}; " + (
                f"its steps are {', '.join(map(str, steps))} (`trainguard ls {root}`)"
                if steps
                else "it holds no checkpoint"
            )
            if as_json:
                echo(json.dumps({"error": message}))
            echo(f"error: {message}", err=True)
            sys.exit(2)
        except CorruptCheckpointError as e:
            if latest and not is_committed(p, step):
                continue
            echo(f"step {step}: {e}", err=True)
            sys.exit(1)
        status = inspect_step(p, step, p / step_dir_name(step), store)[0]
        if latest and not status.usable and not is_committed(p, step):
            continue  # deleted (chunks and all) while being read: take the new newest
        break
    else:
        echo(f"{p}: the newest checkpoint kept being deleted while being read; try again", err=True)
        sys.exit(1)
    entries = _entries(store, m)
    state, problem = status.status, status.problem
    unreadable = [e for e in entries if "error" in e]
    if unreadable and state != "corrupt":  # a value's chunk failed its CRC32C while info read it
        state, problem = "corrupt", unreadable[0]["error"]
    summary = {
        "step": m.step,
        "status": state,
        "problem": problem,
        "time": m.time,
        "world_size": m.world_size,
        "format_version": m.format_version,
        "bytes": m.bytes,
        "chunks": len(m.chunks),
        "metrics": json_safe(m.metrics),
        "metadata": json_safe(m.metadata),
        "top_level": m.top_level,
        "run": _run_json(m),
        "entries": entries,
    }
    bad = state in ("corrupt", "suspect", "incomplete")  # lacking only a full read is not a failure
    if as_json:
        echo(json.dumps(summary, indent=1, allow_nan=False))
        if bad:
            echo(f"step {step} is {state}: {problem}", err=True)
        sys.exit(1 if bad else 0)
    _print_info(summary)
    if bad:
        if state == "suspect":  # its bytes are intact: re-reading them changes nothing
            nxt = (
                f"once you have checked it, `trainguard mark {root} {step} --clear` makes it restorable again"
            )
        else:
            nxt = f"`trainguard verify {root} --step {step}` re-reads every chunk"
        echo(f"step {step} is {state}: {problem}; it will not be restored ({nxt})", err=True)
        sys.exit(1)


def _run_json(m: Any) -> dict[str, Any] | None:
    """The run that wrote the checkpoint: ``id``, ``resumed_from`` (``run_id``, ``step``) and ``lineage``."""
    if m.run is None:
        return None
    src = m.run.resumed_from
    return {
        "id": m.run.run_id,
        "resumed_from": None if src is None else {"run_id": src[0], "step": src[1]},
        "lineage": m.run.to_json()["lineage"],
    }


def _entries(store: Any, m: Any) -> list[dict[str, Any]]:
    """One row per manifest entry; values are decoded safely (JSON or weights_only) and made JSON-safe."""
    from ..integrity.verify import read_value

    cache: dict[str, bytearray] = {}
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
            if ent.rank is not None:
                entries[-1]["rank"] = ent.rank
            continue
        row: dict[str, Any] = {"fqn": fqn, "kind": "value", "codec": ent.codec}
        if ent.rank is not None:
            row["rank"] = ent.rank
        try:
            row["value"] = json_safe(read_value(store, m, ent, cache=cache))
        except CorruptCheckpointError as e:
            row["value"] = None
            row["error"] = str(e)
        entries.append(row)
    return entries


def json_safe(x: Any, depth: int = 0) -> Any:
    """``x`` as strict JSON: tuples become lists, non-str keys strings, NaN/inf and other objects their repr."""
    if depth > 50:
        return repr(x)
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (list, tuple)):
        return [json_safe(v, depth + 1) for v in x]
    if isinstance(x, dict):
        return {str(k): json_safe(v, depth + 1) for k, v in x.items()}
    return repr(x)


_VALUE_CHARS = 160


def _value_rows(row: dict[str, Any]) -> list[tuple[str, str]]:
    """``(label, text)`` lines for a value: one line, or one per key of a dict too long for one line."""
    if "error" in row:
        return [(row["fqn"], f"unreadable: {row['error']}")]
    value = row["value"]
    if isinstance(value, dict) and value and len(json.dumps(value)) > _VALUE_CHARS:
        head = [(row["fqn"], f"{{{len(value)} keys}}")]
        return head + [(f"  .{k}", _show_value(v)) for k, v in value.items()]
    return [(row["fqn"], _show_value(value))]


def _show_value(value: Any) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    if len(text) > _VALUE_CHARS:
        # Elided visibly at a separator, never inside a number or a key: --json prints the whole value.
        cut = max(text.rfind(", ", 0, _VALUE_CHARS), text.rfind(": ", 0, _VALUE_CHARS))
        head = text[: cut if cut > 0 else _VALUE_CHARS]
        text = f"{head}, ... (+{len(text) - len(head)} chars; --json shows all)"
    return text


def _print_info(summary: dict[str, Any]) -> None:
    from rich.table import Table

    c = console()
    c.print(
        f"[bold]step {summary['step']}[/]  {markup(str(summary['time']))}  world size {summary['world_size']}  "
        f"format v{summary['format_version']}  {human_bytes(summary['bytes'])} in {summary['chunks']} chunks"
    )
    if summary["status"] != "valid":
        problem = f": {markup(str(summary['problem']))}" if summary["problem"] else ""
        color = "cyan" if summary["status"] == "unverified" else "red"
        c.print(f"[{color}]{summary['status']}[/]{problem}")
    if summary["run"] is not None:
        run, src = summary["run"], summary["run"]["resumed_from"]
        c.print(
            f"run {markup(run['id'] or '(unnamed)')}"
            + (
                f", resumed from run {markup(src['run_id'] or '(unnamed)')} at step {src['step']}"
                if src
                else ", started fresh"
            )
        )
    if summary["metrics"]:
        c.print("metrics: " + ", ".join(markup(f"{k}={v}") for k, v in summary["metrics"].items()))
    table = Table()
    for col in ("entry", "kind", "dtype / codec", "shape", "bytes"):
        table.add_column(col, overflow="fold")  # wrap, never cut a name or a shape
    table.add_column("value", overflow="fold")
    for row in summary["entries"]:
        if row["kind"] == "tensor":
            table.add_row(
                markup(row["fqn"]),
                "tensor",
                markup(row["dtype"]),
                str(row["shape"]),
                human_bytes(row["bytes"]),
                "",
            )
            continue
        style = "red" if "error" in row else "none"
        for i, (label, text) in enumerate(_value_rows(row)):
            first = i == 0
            table.add_row(
                markup(label),
                "value" if first else "",
                markup(row["codec"]) if first else "",
                "",
                "",
                f"[{style}]{markup(text)}[/]",
            )
    c.print(table)


@main.command("verify")
@click.argument("root")
@click.option("--step", type=click.IntRange(min=0), default=None, help="Check only this step (>= 0).")
@click.option("--all", "all_steps", is_flag=True, help="Check every committed checkpoint.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print {ok, checked, corrupt: [{step, chunk, tensors}]}."
)
@click.option(
    "--max-bandwidth",
    default=None,
    metavar="RATE",
    help="Cap the re-read rate, e.g. 200MB/s (a scrub of a live job's storage); default: as fast as it reads.",
)
def verify_cmd(
    root: str, step: int | None, all_steps: bool, as_json: bool, max_bandwidth: str | None
) -> None:
    """Re-read every chunk of the checkpoints under ROOT and check CRC32C.

    Default: the newest committed checkpoint. Exit 1 if anything is corrupt, naming the chunk and the
    tensors it holds.
    """
    from ..errors import ConfigError
    from ..integrity.verify import verify
    from ..planning.units import parse_bandwidth_bytes_per_s
    from ..validation.scrub import RateLimiter

    limiter = None
    if max_bandwidth is not None:
        try:
            limiter = RateLimiter(parse_bandwidth_bytes_per_s(max_bandwidth, what="--max-bandwidth"))
        except ConfigError as e:
            raise click.BadParameter(str(e), param_hint="--max-bandwidth") from None
    if step is not None and all_steps:
        raise click.UsageError("give either --step N or --all, not both")
    if is_url(root):
        return verify_url(root, step, all_steps, as_json, on_read=limiter.consume if limiter else None)
    p = _root(root)
    if not is_run_root(p):
        message = f"no checkpoints in {p}{_runs_hint(p, 'verify')}; nothing was verified"
        if as_json:
            echo(json.dumps({"ok": False, "checked": [], "corrupt": [], "bytes_read": 0, "error": message}))
        echo(f"FAILED: {message}", err=True)
        sys.exit(1)
    dirs, partials = step_dirs(p)
    # A stable listing: a single one can see no checkpoint while a writer commits one and deletes the last.
    committed = stable_committed_steps(p)
    if not committed and step is None:
        # Nothing to check is a failed check: a mistyped root must not pass.
        what = "no committed checkpoint" if dirs or partials else "no checkpoints"
        hint = "" if dirs or partials else _runs_hint(p, "verify")
        message = f"{what} in {p}{hint}; nothing was verified"
        if as_json:
            echo(json.dumps({"ok": False, "checked": [], "corrupt": [], "bytes_read": 0, "error": message}))
        echo(f"FAILED: {message}", err=True)
        sys.exit(1)
    show = not as_json and sys.stderr.isatty()
    for attempt in range(RACE_RETRIES):  # the newest checkpoint may be deleted by a writer meanwhile
        if attempt:
            committed = stable_committed_steps(p)
        if step is not None:
            steps: list[int] | None = [step]
        elif all_steps:
            steps = None
        else:
            steps = [max(committed)] if committed else []
        try:
            if show:
                from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

                with Progress(
                    "verify", BarColumn(), DownloadColumn(), TransferSpeedColumn(), transient=True
                ) as prog:
                    task = prog.add_task("verify", total=None)

                    def progress(done: int, total: int, task: Any = task, prog: Any = prog) -> None:
                        prog.update(task, completed=done, total=total)

                    report = verify(p, steps, progress=progress, limiter=limiter)
            else:
                report = verify(p, steps, limiter=limiter)
            break
        except CheckpointNotFoundError as e:
            if step is not None or attempt == RACE_RETRIES - 1:
                raise click.UsageError(str(e)) from None
    from ..validation.suspect import suspect_reason

    # CRC32C vouches for the bytes, not the content: a suspect step stays suspect (reported, not a failure)
    suspect = {s: r for s in report.checked if (r := suspect_reason(p, s)) is not None}
    if as_json:
        doc = report.to_json()
        doc["suspect"] = [{"step": s, "reason": r} for s, r in sorted(suspect.items())]
        echo(json.dumps(doc, indent=1))
    else:
        for s in report.checked:
            bad = [c for c in report.corrupt if c["step"] == s]
            if not bad and s in suspect:
                echo(
                    f"step {s}: ok (bytes intact) but SUSPECT: {suspect[s]}; it will not be restored until "
                    f"`trainguard mark {root} {s} --clear` (once you have checked it)"
                )
            elif not bad:
                echo(f"step {s}: ok")
            for c in bad:
                echo(corrupt_line(s, c["problem"]))
        n_bad = len({c["step"] for c in report.corrupt})
        echo(verify_summary(report.ok, len(report.checked), n_bad, report.bytes_read))
    sys.exit(0 if report.ok else 1)


@main.command("prefetch")
@click.argument("root")
@click.option("--tier", "tiers", multiple=True, help="A tier URL or path (default: the tiers ROOT records).")
@click.option("--json", "as_json", is_flag=True, help="Print {ok, step, root}.")
def prefetch_cmd(root: str, tiers: tuple[str, ...], as_json: bool) -> None:
    """Copy the newest checkpoint restorable from the tiers into the hot root ROOT ahead of a restart.

    Chunks already intact in ROOT are kept (each is re-read and its CRC32C checked); the others are read from
    the first tier holding them intact. Exit 1 when no tier holds a restorable checkpoint.
    """
    from .remote import prefetch_cmd_impl

    prefetch_cmd_impl(root, tiers, as_json)
