"""``trainguard mark`` (set or clear a checkpoint's suspect status) and ``trainguard gc``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from ..catalog import is_committed, read_manifest
from ..errors import ConfigError, CorruptCheckpointError, RootLockedError
from .inspect import _root, human_bytes, require_run_root
from .main import main
from .text import StepCommand, echo


@main.command("mark", cls=StepCommand)
@click.argument("root")
@click.argument("step", type=click.IntRange(min=0))
@click.option("--suspect", "reason", default=None, metavar="REASON", help="Mark STEP suspect, with why.")
@click.option(
    "--clear", is_flag=True, help="Clear the suspect mark of STEP (it is a restore candidate again)."
)
def mark_cmd(root: str, step: int, reason: str | None, clear: bool) -> None:
    """Mark the checkpoint of STEP under ROOT suspect (restore skips it) or clear its mark.

    Works while a job runs: the marker (``step-N/suspect.json``) is replaced atomically; no lock is taken.
    """
    from ..validation.suspect import clear_suspect, mark_suspect

    p = _root(root, "mark")
    if (reason is None) == (not clear):
        raise click.UsageError("give either --suspect REASON or --clear")
    if not is_committed(p, step):
        raise click.UsageError(f"no committed checkpoint of step {step} under {p} (`trainguard ls {root}`)")
    if clear:
        try:
            removed = clear_suspect(p, step)
        except OSError as e:
            echo(f"step {step}: could not remove the marker under {p} ({e.strerror or e})", err=True)
            sys.exit(1)
        echo(f"step {step}: suspect mark cleared" if removed else f"step {step}: was not marked suspect")
        return
    if not reason or not reason.strip():
        raise click.UsageError("--suspect needs a non-empty REASON")
    try:
        read_manifest(p, step)
    except CorruptCheckpointError as e:  # never restored anyway: a suspect mark would change nothing
        echo(
            f"step {step} is corrupt, not marked: {e}. A corrupt checkpoint is never restored, so a suspect mark "
            f"would change nothing (`trainguard ls {root}` shows it)",
            err=True,
        )
        sys.exit(1)
    if not mark_suspect(p, step, reason, by="operator"):
        echo(f"step {step}: could not write the marker under {p} (read-only?)", err=True)
        sys.exit(1)
    echo(f"step {step}: marked suspect ({reason})")


@main.command("gc")
@click.argument("root")
@click.option(
    "--quarantine-older-than",
    default="7d",
    show_default=True,
    metavar="AGE",
    help="Remove quarantined (corrupt, moved aside) chunks older than this.",
)
@click.option(
    "--orphans-older-than",
    default="1h",
    show_default=True,
    metavar="AGE",
    help="Remove chunks no manifest references, last written longer ago than this.",
)
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print {quarantined, orphans, bytes_freed, referenced}."
)
def gc_cmd(
    root: str, quarantine_older_than: str, orphans_older_than: str, dry_run: bool, as_json: bool
) -> None:
    """Remove quarantined chunks and orphans from ROOT's chunk store (never a chunk a manifest references).

    Takes the root lock: run it while no job writes to ROOT. ``--dry-run`` deletes nothing and also runs
    while a job writes (it then says so: the job may change the plan meanwhile).
    """
    from ..planning.units import parse_duration_s
    from ..validation.scrub import gc

    p = _root(root, "gc")
    require_run_root(p, "gc", as_json)  # before the lock: taking it would create ROOT/.lock
    try:
        q = parse_duration_s(quarantine_older_than, what="--quarantine-older-than")
        o = parse_duration_s(orphans_older_than, what="--orphans-older-than")
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    try:
        report = gc(p, quarantine_older_than_s=q, orphans_older_than_s=o, dry_run=dry_run)
    except ConfigError as e:  # not a run root: refused like verify/info, nothing created
        echo(f"gc: {e}", err=True)
        sys.exit(1)
    except RootLockedError:
        echo(
            f"gc: run root {p} is locked by a job writing to it{_holder(p)}. gc removes chunks a running job may still write or read, so it needs the root to "
            "itself: stop the job, or wait until it ends, then run gc again (while a job runs, its own "
            "retention removes the chunks its checkpoints no longer reference)",
            err=True,
        )
        sys.exit(1)
    if as_json:
        echo(json.dumps(report.to_json(), indent=1))
        return
    verb = "would remove" if dry_run else "removed"
    if report.writer_active:
        echo(
            f"gc --dry-run: a job holds {p}{_holder(p)} and writes to it; this plan is read beside it and may "
            "change (its commits and its own retention change what is referenced). Run gc itself once the job "
            "has stopped."
        )
    for rel in report.quarantined:
        echo(f"{verb} quarantined {rel}")
    for rel in report.orphans:
        echo(f"{verb} orphan {rel}")
    echo(
        f"{verb} {len(report.quarantined)} quarantined and {len(report.orphans)} orphan chunk(s), "
        f"{human_bytes(report.bytes_freed)}; {report.referenced} referenced chunk(s) kept"
    )
    if report.unreadable_manifests:
        steps = ", ".join(map(str, report.unreadable_manifests))
        echo(
            f"the manifest of step(s) {steps} cannot be read, so the chunks it references are unknown: no "
            "orphan was removed (`trainguard ls` shows why; remove or repair that step and run gc again)"
        )


def _holder(root: Path) -> str:
    """`` (pid N on HOST)`` from the root's lock file, or "" when it cannot be read."""
    from ..errors import UnsafeFileError
    from ..storage.safeio import open_regular

    try:  # a regular file only: never through a symlink, never blocking on a named pipe
        fd = open_regular(root / ".lock", os.O_RDONLY, what="lock file")
    except (OSError, UnsafeFileError):
        return ""
    try:
        text = os.read(fd, 200).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)
    return f" ({text})" if text else ""
