"""Run identity at save, retention and restore time (the records are in :mod:`trainguard.format.run`).

- A manager that did not restore (and was not opened with ``new_run=True``) refuses its first save when the
  root holds another run's checkpoint at or after that step: the two runs' checkpoints would interleave,
  retention would delete one run's for the other's, and a restart would resume whichever step is highest.
  A first save after every existing checkpoint continues the root's newest run (recorded in the lineage).
- Retention orders only the checkpoints in the saving run's lineage.
- ``restore_latest`` follows the *head* run: the run of the most recently committed manifest (by its mtime).
  Checkpoints outside the head's lineage (another run kept apart with ``new_run=True``, or a branch an
  ancestor abandoned) are passed over, never resumed.

Rank 0 decides; the other ranks get its decision (these run inside collective calls).
"""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING

from .catalog import ParsedManifest, read_manifest, read_parsed, step_keys
from .errors import CheckpointExistsError, RunConflictError, TrainguardError
from .format import MANIFEST_NAME, Manifest
from .format.run import LEGACY_RUN_ID, RunInfo, run_from_json
from .storage.base import Storage, as_storage

if TYPE_CHECKING:
    from ._context import RootContext

log = logging.getLogger("trainguard")


def run_info(m: Manifest) -> RunInfo:
    """The run that wrote manifest ``m`` (the legacy run, id ``""``, for one written before run ids)."""
    return m.run or RunInfo(LEGACY_RUN_ID)


def run_of(
    root: str | os.PathLike[str] | Storage, step: int, cache: dict[int, str] | None = None
) -> str | None:
    """Id of the run that wrote the checkpoint of ``step`` (``""`` for one written before run ids), or None
    when its manifest cannot be read (deleted, corrupt)."""
    if cache is not None and step in cache:
        return cache[step]
    try:
        m = read_manifest(root, step)
    except TrainguardError:
        return None
    rid = run_info(m).run_id
    if cache is not None:
        cache[step] = rid
    return rid


def head(root: str | os.PathLike[str] | Storage) -> RunInfo | None:
    """The run of the most recently committed checkpoint (newest manifest mtime; the higher step on a tie) that
    parses, or None. Reads through the root's storage."""
    parsed = head_manifest(root)
    if parsed is None:
        return None
    return run_info(parsed.manifest)


def head_manifest(
    root: str | os.PathLike[str] | Storage, reuse: ParsedManifest | None = None
) -> ParsedManifest | None:
    """The manifest :func:`head` takes the run from (the most recently committed one that parses), with the size
    and CRC32C of its bytes: ``restore_latest`` passes it on (``read_manifest(reuse=...)``), so the checkpoint it
    usually loads next is not parsed twice. None when no manifest parses.

    Args:
        reuse: a manifest parsed before (a writer's open: ``ManifestCache.newest``), used when it is the one
            wanted and the file still holds the same bytes (see :func:`~trainguard.catalog.read_manifest`)."""
    storage = as_storage(root)
    keys, _ = step_keys(storage)
    stamped = []
    for s, key in keys.items():
        try:
            info = storage.stat(f"{key}/{MANIFEST_NAME}")
        except OSError:
            continue
        if info is not None and info.is_file:
            stamped.append((info.mtime, s))
    for _, s in sorted(stamped, reverse=True):
        try:
            return read_parsed(storage, s, reuse=reuse)
        except TrainguardError:
            continue
    return None


def foreign_steps(ctx: RootContext) -> dict[int, str]:
    """Committed checkpoints under the root that are not in ``ctx.run``'s lineage: step -> run id."""
    dirs, _ = step_keys(ctx.storage)
    out = {}
    for s in sorted(dirs):
        rid = run_of(ctx.storage, s, ctx.refs.runs)
        if rid is not None and not ctx.run.owns(rid, s):
            out[s] = rid
    return out


def _describe(foreign: dict[int, str]) -> str:
    runs: dict[str, list[int]] = {}
    for s, rid in foreign.items():
        runs.setdefault(rid, []).append(s)
    return "; ".join(
        f"run {rid or '(unnamed, written before run ids)'}: steps {steps[0]}..{steps[-1]} ({len(steps)})"
        for rid, steps in runs.items()
    )


def check_before_first_save(ctx: RootContext, step: int) -> None:
    """Before the first save of a manager that did not restore: never interleave with another run.

    - No other run's checkpoint under the root: a new run starts.
    - Every other checkpoint is older than ``step``: the save continues the root's history (a process that
      saves on where the last one stopped without loading, e.g. a tool or a test harness); the run of the
      newest checkpoint becomes this run's parent, recorded in its lineage (event ``resume`` with
      ``implicit``).
    - Another run has a checkpoint at or after ``step``: refused, the choices spelled out.

    Raises:
        RunConflictError: on every rank, naming the other run(s), their steps and the three ways out.
    """
    if ctx.resumed or ctx.new_run:
        return
    msg = b""
    parent: list[int] = []
    if ctx.dist.is_coordinator:
        foreign = foreign_steps(ctx)
        if foreign and max(foreign) >= step:
            msg = (
                f"{ctx.root} holds checkpoints of another run ({_describe(foreign)}) and this manager "
                f"(run {ctx.run.run_id}) did not resume it; saving step {step} would interleave the two runs' "
                "checkpoints. Either call restore_latest(state) before the first save to resume that run, use a "
                "new run root for a new run, or pass CheckpointManager(..., new_run=True) to start a new run "
                "here that keeps the old run's checkpoints apart (its retention and restore_latest ignore them)."
            ).encode()
        elif foreign:
            parent = [max(foreign)]
    msg = ctx.dist.broadcast_bytes(msg)
    if msg:
        raise RunConflictError(msg.decode())
    parent = ctx.dist.broadcast_ints(parent)
    if parent:
        m = read_manifest(ctx.storage, parent[0]) if ctx.dist.is_coordinator else None
        info = ctx.dist.broadcast_bytes(json.dumps(m.run.to_json() if m and m.run else None).encode())
        ctx.run = ctx.run.resume(run_from_json(json.loads(info)), parent[0])
        src = ctx.run.resumed_from
        log.info(
            "run %s continues after step %d of run %s (it did not restore)", ctx.run.run_id, parent[0], src
        )
        ctx.event(
            "resume",
            resumed_from={"run_id": src[0] if src else "", "step": parent[0]},
            lineage=ctx.run.to_json()["lineage"],
            implicit=True,
        )


def record_resume(ctx: RootContext, m: Manifest) -> None:
    """Record the checkpoint ``m`` just loaded as the parent of the context's run (a writing manager only): its
    lineage goes into every later manifest, and a ``resume`` event is logged."""
    if ctx.read_only:
        return
    ctx.run = ctx.run.resume(m.run, m.step)
    ctx.resumed = True
    parent = run_info(m).run_id
    log.info("run %s resumes run %s at step %d", ctx.run.run_id, parent or "(unnamed)", m.step)
    ctx.event("resume", resumed_from={"run_id": parent, "step": m.step}, lineage=ctx.run.to_json()["lineage"])


def check_step_owner(ctx: RootContext, step: int) -> None:
    """Explain a step collision with another run's checkpoint (a root holds one checkpoint per step).

    Raises:
        CheckpointExistsError: the committed checkpoint of ``step`` belongs to a run outside this lineage.
    """
    rid = run_of(ctx.storage, step)
    if rid is not None and not ctx.run.owns(rid, step):
        raise CheckpointExistsError(
            f"step {step} under {ctx.root} holds a checkpoint of another run ({rid or '(unnamed)'}), kept apart "
            f"from this run ({ctx.run.run_id}); a run root holds one checkpoint per step, so this run cannot "
            "save that step here. Start the new run in a new run root, or delete the other run's checkpoints "
            "deliberately."
        )


def own(ctx: RootContext, steps: list[int]) -> list[int]:
    """The steps whose checkpoints are in ``ctx.run``'s lineage (unreadable ones are left out)."""
    out = []
    for s in steps:
        rid = run_of(ctx.storage, s, ctx.refs.runs)
        if rid is not None and ctx.run.owns(rid, s):
            out.append(s)
    return out
