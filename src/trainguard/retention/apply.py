"""Applying retention and cleaning up after a crash (rank 0 only: the holder of the run root's lock).

Invariants: a checkpoint is deleted by removing its manifest first (a crash after that leaves garbage, never a
half checkpoint); a chunk is deleted only when no remaining manifest references it and no save in progress
may use it. In one process, saves in progress pin their chunks in the ChunkStore. Under torch.distributed the
other ranks' saves cannot pin rank 0's store, so rank 0 also spares every chunk modified (written, or touched
when deduplicated) less than ``GC_GRACE_S`` before the oldest save still in flight began.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..catalog import read_manifest, scan, step_dirs
from ..errors import TrainguardError
from ..format import MANIFEST_NAME, step_dir_name
from ..storage.local import remove_tree

if TYPE_CHECKING:
    from ..manager import CheckpointManager

log = logging.getLogger("trainguard")
GC_GRACE_S = 300.0


def chunks_of(mgr: CheckpointManager, step: int) -> set[str] | None:
    """Chunk hashes the manifest of ``step`` references (cached), or None if it cannot be read."""
    if step not in mgr._manifest_chunks:
        try:
            mgr._manifest_chunks[step] = set(read_manifest(mgr.root, step).chunks)
        except TrainguardError:
            return None
    return mgr._manifest_chunks[step]


def referenced_chunks(mgr: CheckpointManager) -> set[str] | None:
    """Every chunk a committed manifest references; None if a manifest cannot be read."""
    referenced: set[str] = set()
    steps, _ = step_dirs(mgr.root)
    for s, d in steps.items():
        chunks = chunks_of(mgr, s)
        if chunks is None and (d / MANIFEST_NAME).exists():
            return None  # an unreadable manifest: its chunks are unknown, collect nothing
        referenced |= chunks or set()
    return referenced


def apply_retention(mgr: CheckpointManager) -> None:
    """Delete the valid checkpoints the policy does not keep (never the newest valid one), then their chunks."""
    valid = [i.step for i in scan(mgr.root, mgr.store) if i.usable]  # valid or unverified
    if not valid:
        return
    keep = set(mgr.retention.keep(valid)) | {max(valid)}
    doomed = [s for s in valid if s not in keep]
    if not doomed:
        return
    candidates: set[str] = set()
    for s in doomed:
        candidates |= chunks_of(mgr, s) or set()
        d = mgr.root / step_dir_name(s)
        try:
            (d / MANIFEST_NAME).unlink()  # uncommit first
        except FileNotFoundError:
            pass
        remove_tree(d)
        mgr._manifest_chunks.pop(s, None)
        mgr._event("retention_delete", step=s)
    referenced = referenced_chunks(mgr)
    if referenced is None:
        log.warning("a manifest under %s is unreadable; not deleting chunks", mgr.root)
        return
    protect = None
    if mgr.dist.enabled:
        candidates = mgr.store.all_hashes()  # also sweeps chunks spared by earlier passes
        protect = mgr._oldest_in_flight_t() - GC_GRACE_S
    freed = mgr.store.collect(candidates, referenced, protect_newer_than=protect)
    log.info("retention deleted steps %s (%d bytes freed)", doomed, freed)


def cleanup_after_crash(mgr: CheckpointManager) -> None:
    """With the lock held, before any save: remove partial directories and step directories without a manifest
    (commits killed midway) and the orphan chunks they left."""
    steps, partials = step_dirs(mgr.root)
    dead = [s for s, d in steps.items() if not (d / MANIFEST_NAME).exists()]
    if not partials and not dead:
        return
    for d in steps.values():  # temporary manifests of a publish killed before its rename
        for tmp in d.glob(f".{MANIFEST_NAME}.tmp-*"):
            tmp.unlink(missing_ok=True)
    for s in dead:
        remove_tree(steps.pop(s))
    for ps in partials.values():
        for p in ps:
            remove_tree(p)
    referenced = referenced_chunks(mgr)
    if referenced is None:
        log.warning("a manifest under %s is unreadable; not collecting orphan chunks", mgr.root)
        return
    freed = mgr.store.collect(mgr.store.all_hashes(), referenced)
    mgr._event(
        "cleanup",
        partials=sum(len(v) for v in partials.values()),
        uncommitted_steps=dead,
        orphan_bytes_freed=freed,
        t_cleanup=time.time(),
    )
