"""``trainguard export`` and ``trainguard import``: checkpoints to and from safetensors, DCP and torch.save."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    MissingDependencyError,
    RunConflictError,
    TrainguardError,
)
from .main import main
from .text import echo


@contextmanager
def _progress(label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A progress bar on stderr when it is a terminal (stdout stays clean for ``--json``), else nothing."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress(
        label,
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as prog:
        task = prog.add_task(label, total=None)
        yield lambda done, total: prog.update(task, completed=done, total=total)


def _fail(e: BaseException, as_json: bool) -> None:
    """Exit 2 for a usage problem (bad option, missing input, output exists, missing package), 1 for a check
    that failed (no valid or a corrupt checkpoint, an unsafe source refused)."""
    usage = isinstance(
        e, (ConfigError, CheckpointNotFoundError, MissingDependencyError, FileExistsError, RunConflictError)
    )
    code = 2 if usage and not isinstance(e, CorruptCheckpointError) else 1
    if as_json:
        echo(json.dumps({"ok": False, "error": str(e), "error_type": type(e).__name__}))
    echo(f"error: {e}", err=True)
    sys.exit(code)


@main.command("export")
@click.argument("root")
@click.argument("out")
@click.option(
    "--format",
    "fmt",
    required=True,
    type=click.Choice(["safetensors", "dcp", "torch"]),
    help="Output format.",
)
@click.option("--step", type=int, default=None, help="The checkpoint's step (default: the newest valid one).")
@click.option(
    "--entry",
    default=None,
    help="State entry to export, or a dotted path to a part of one (e.g. `lightning.state_dict`); default: "
    "`model`, the model of the only ModelOptimizerState entry, or a Lightning checkpoint's `lightning.state_dict`.",
)
@click.option(
    "--all",
    "all_state",
    is_flag=True,
    help="Export the whole state (optimizer, RNG, data position...), keyed by FQN (dcp, torch).",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="safetensors: largest file; above it OUT is a directory of shards with model.safetensors.index.json.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object describing what was written.")
def export_cmd(
    root: str,
    out: str,
    fmt: str,
    step: int | None,
    entry: str | None,
    all_state: bool,
    max_shard_size: str,
    as_json: bool,
) -> None:
    """Export a checkpoint of ROOT to OUT as safetensors, a plain DCP directory or a torch.save file.

    Sharded tensors are consolidated. By default the weights of the entry `model` (a Lightning run's:
    `lightning.state_dict`), keyed by the model's own
    state_dict keys: `safetensors.torch.load_file(OUT)` and `model.load_state_dict(...)` accept them. OUT must
    not exist; it appears only when complete. Exit 0 ok, 1 the checkpoint is not valid (corrupt, no valid
    one), 2 usage error.
    """
    from ..interop.export import export
    from ..planning.units import parse_bytes

    try:
        limit = int(parse_bytes(max_shard_size, what="--max-shard-size"))
        with _progress("export") as prog:
            res = export(
                root,
                out,
                format=fmt,
                step=step,
                entry=entry,
                all_state=all_state,
                max_shard_bytes=limit,
                progress=prog,
            )
    except (TrainguardError, FileExistsError) as e:
        _fail(e, as_json)
        return
    if as_json:
        echo(json.dumps({"ok": True, **res.to_json()}, indent=1))
        return
    shape = f"{len(res.files) - 1} shards + index" if fmt == "safetensors" and res.files else fmt
    echo(
        f"exported step {res.step} ({res.entry}: {res.tensors} tensors, {res.bytes} bytes"
        + (f", {res.values} values" if res.values else "")
        + f") to {res.out} ({shape})"
    )


@main.command("import")
@click.argument("src")
@click.argument("root")
@click.option(
    "--format",
    "fmt",
    required=True,
    type=click.Choice(["dcp", "torch", "safetensors"]),
    help="Format of SRC.",
)
@click.option("--step", type=click.IntRange(min=0), required=True, help="Step of the new checkpoint.")
@click.option(
    "--entry", default="model", show_default=True, help="State entry the imported state_dict becomes."
)
@click.option("--key", default=None, help="Import SRC[KEY] of a nested source (e.g. `state_dict`).")
@click.option(
    "--all", "all_state", is_flag=True, help="Import each top-level key of a nested source as an entry."
)
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint of --step.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object describing what was committed.")
def import_cmd(
    src: str,
    root: str,
    fmt: str,
    step: int,
    entry: str,
    key: str | None,
    all_state: bool,
    overwrite: bool,
    as_json: bool,
) -> None:
    """Turn SRC (a DCP directory, a torch.save file, safetensors) into the checkpoint of --step under ROOT.

    Nothing from SRC runs: a torch.save file is read with torch.load(weights_only=True) and refused, with
    the reason, when that fails; DCP's pickled .metadata is read by an unpickler that builds only DCP's
    metadata records. Restore with `CheckpointManager(ROOT).restore(STEP, {"model": model})`. Exit 0 ok, 1
    SRC refused as unsafe, 2 usage error (bad option, SRC missing or of another layout, step exists).
    """
    from ..interop.import_ import import_checkpoint

    try:
        with _progress("import") as prog:
            res = import_checkpoint(
                src,
                root,
                format=fmt,
                step=step,
                entry=entry,
                key=key,
                all_state=all_state,
                overwrite=overwrite,
                progress=prog,
            )
    except (TrainguardError, FileExistsError) as e:
        _fail(e, as_json)
        return
    if as_json:
        out: dict[str, Any] = {"ok": True, **res.to_json()}
        echo(json.dumps(out, indent=1))
        return
    echo(
        f"imported {res.tensors} tensors ({res.bytes} bytes)"
        + (f" and {res.values} values" if res.values else "")
        + f" from {src} as step {res.step} under {res.root} (entries: {', '.join(res.entries)})"
    )
