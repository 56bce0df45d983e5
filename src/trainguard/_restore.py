"""Choosing and loading the newest valid checkpoint (``CheckpointManager.restore_latest``).

Under torch.distributed every rank takes the same path: rank 0 lists the committed steps and judges each
candidate cheaply (manifest, chunk presence), broadcasting both; every rank then loads the chosen step through
DCP, whose load raises the same CheckpointException on all ranks when any rank fails, so a chunk found corrupt
on one rank makes all ranks fall back to the next older step together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch.distributed.checkpoint as dcp

from . import _statefn
from ._persist import quiet_dcp, unwrap
from .catalog import corrupt_marker, inspect_step, read_manifest, record_check, record_corrupt, step_dirs
from .distributed import TrainguardLoadPlanner, TrainguardReader
from .errors import CorruptCheckpointError, NoValidCheckpointError
from .format import MANIFEST_NAME, TensorEntry, step_dir_name
from .state.dtypes import dtype_from_name

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .results import RestoreTimings

log = logging.getLogger("trainguard")


def committed_steps(mgr: CheckpointManager) -> list[int]:
    """Steps with a manifest, newest first (rank 0's view, on every rank)."""
    steps: list[int] | None = None
    if mgr.dist.is_coordinator:
        dirs, partials = step_dirs(mgr.root)
        uncommitted = sorted(s for s, d in dirs.items() if not (d / MANIFEST_NAME).exists())
        if uncommitted:
            log.warning(
                "ignoring uncommitted step directories (a save was killed mid-commit): %s", uncommitted
            )
        steps = sorted((s for s in dirs if s not in uncommitted), reverse=True)
        if not steps and partials:
            log.warning(
                "%s holds only uncommitted saves (steps %s); starting from scratch",
                mgr.root,
                sorted(partials),
            )
    return mgr.dist.broadcast_ints(steps)


def restore_latest(
    mgr: CheckpointManager, state: MutableMapping[str, Any], timings: RestoreTimings
) -> int | None:
    t0 = time.perf_counter()
    problems: list[str] = []
    unreadable: list[int] = []
    steps = committed_steps(mgr)
    for step in steps:
        ok, problem, chunk, tensors = True, "", None, None
        if mgr.dist.is_coordinator:
            info, _ = inspect_step(mgr.root, step, mgr.root / step_dir_name(step), mgr.store)
            ok, problem, chunk = info.usable, info.problem or info.status, info.chunk
            marker = corrupt_marker(mgr.root, step) if not ok else None
            listed = marker.get("tensors") if marker is not None else None
            if isinstance(listed, list):
                tensors = [str(t) for t in listed]
        if not mgr.dist.broadcast_ints([int(ok)])[0]:
            err = CorruptCheckpointError(problem, step=step, chunk=chunk, tensors=tensors) if chunk else None
            skip(mgr, step, problem or "not valid on rank 0", err, timings, problems)
            continue
        t_chosen = time.perf_counter()
        try:
            mgr._load(step, state)
        except CorruptCheckpointError as e:
            if e.unreadable:
                unreadable.append(step)
            skip(mgr, step, str(e), e, timings, problems)
            continue
        t_loaded = time.perf_counter()
        timings.scan_s = t_chosen - t0
        timings.load_s = t_loaded - t_chosen
        timings.validate_s = 0.0
        timings.bytes = mgr.last_restore.bytes
        mgr._event(
            "restore",
            step=step,
            scan_s=timings.scan_s,
            load_s=timings.load_s,
            validate_s=timings.validate_s,
            bytes=timings.bytes,
            skipped=timings.skipped,
        )
        log.info("restored step %d from %s in %.3f s", step, mgr.root, t_loaded - t0)
        return step
    if not steps:
        mgr._event(
            "restore",
            step=None,
            scan_s=time.perf_counter() - t0,
            load_s=0.0,
            validate_s=0.0,
            bytes=0,
            skipped=[],
        )
        return None
    if unreadable:
        raise NoValidCheckpointError(
            f"{mgr.root} holds {len(steps)} checkpoint(s) but none could be loaded; steps {sorted(unreadable)} "
            "could not be read (I/O errors, retried) and are NOT marked corrupt:\n  "
            + "\n  ".join(problems)
            + "\nFix access to the storage (permissions, mounts) and retry; do not start a new run root."
        )
    raise NoValidCheckpointError(
        f"{mgr.root} holds {len(steps)} checkpoint(s) but none is valid:\n  "
        + "\n  ".join(problems)
        + f"\nRun `trainguard verify {mgr.root} --all` for details; restore a replica or start a new run root "
        "deliberately."
    )


def skip(
    mgr: CheckpointManager,
    step: int,
    problem: str,
    err: CorruptCheckpointError | None,
    timings: RestoreTimings,
    problems: list[str],
) -> None:
    if mgr.dist.is_coordinator:
        log.warning("skipping checkpoint of step %d: %s", step, problem)
    rec: dict[str, Any] = {"step": step, "problem": problem}
    if err is not None:
        rec.update(chunk=err.chunk, tensors=err.tensors)
    timings.skipped.append(rec)
    problems.append(f"step {step}: {problem}")
    mgr._event("restore_skipped", **rec)


def load(mgr: CheckpointManager, step: int, state: MutableMapping[str, Any]) -> None:
    m = read_manifest(mgr.root, step)
    try:  # an unknown dtype (saved by a newer torch?) is a clear error, before DCP runs
        for e in m.entries.values():
            if isinstance(e, TensorEntry):
                dtype_from_name(e.dtype)
    except CorruptCheckpointError as bad_dtype:
        bad_dtype.step = step
        if mgr.dist.is_coordinator:
            mgr._mark_corrupt(step, bad_dtype)
        raise
    template, paths = _statefn.build_template(m, state)
    reader = TrainguardReader(mgr.store, m)
    try:
        with quiet_dcp():
            dcp.load(
                template, storage_reader=reader, planner=TrainguardLoadPlanner(), **mgr.dist.dcp_kwargs()
            )
    except BaseException as e:
        err = unwrap(e, step, prefer=CorruptCheckpointError)
        if isinstance(err, CorruptCheckpointError) and mgr.dist.is_coordinator:
            mgr._mark_corrupt(step, err)
        raise err from None
    _statefn.apply(template, paths, state, step)
    mgr.last_restore.bytes = reader.bytes_read


def mark_corrupt(mgr: CheckpointManager, step: int, err: CorruptCheckpointError) -> None:
    """Record what a restore's full read found, so that every view agrees with it.

    Only a confirmed mismatch (``err.damaged``: read twice) or a manifest-level problem condemns the step (and,
    in a writing manager, quarantines the chunk); an I/O error is recorded as an unreadable check, never as
    corruption; a missing chunk needs no record (listing sees it). A read-only manager records too (the records
    are advisory files; nothing is written where the root is read-only) but never moves a chunk.
    """
    if err.unreadable:
        record_check(mgr.root, step, by="restore", ok=False, problem=str(err), chunk=err.chunk)
        return
    if err.chunk and not err.damaged:
        return
    if err.chunk and not mgr.read_only:
        moved = mgr.store.quarantine(err.chunk)
        if moved:
            log.warning("moved corrupt chunk %s aside to %s", err.chunk, moved)
    record_corrupt(mgr.root, step, str(err), chunk=err.chunk, tensors=err.tensors, fsync=mgr.fsync)
