"""Applying retention and cleaning up after a crash (rank 0 only: the holder of the run root's lock).

Invariants: a checkpoint is deleted by removing its manifest first (a crash after that leaves garbage, never a
half checkpoint); a chunk is deleted only when no remaining manifest references it and no save in progress
may use it. In one process, saves in progress pin their chunks in the ChunkStore. Under torch.distributed the
other ranks' saves cannot pin rank 0's store, so rank 0 also spares every chunk modified (written, or touched
when deduplicated) less than ``GC_GRACE_S`` before the oldest save still in flight began.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..catalog import committed_split, corrupt_marker, read_manifest, read_parsed, scan, step_keys
from ..errors import TrainguardError
from ..format import CHUNKS_DIR, MANIFEST_NAME, step_dir_name
from . import KeepAll, select, uses_metrics

if TYPE_CHECKING:
    from .._context import RootContext

log = logging.getLogger("trainguard")
GC_GRACE_S = 300.0


def _learn(ctx: RootContext, step: int, *, keep_newest: bool = False) -> bool:
    """Read the manifest of ``step`` into the manager's cache (chunks, run, metrics). False if unreadable.

    ``keep_newest``: also keep the parsed manifest in ``ctx.refs.newest`` when ``step`` is the highest so far
    (at open, for ``restore_latest``)."""
    try:
        parsed = read_parsed(ctx.storage, step)
    except TrainguardError:
        return False
    m = parsed.manifest
    ctx.refs.add(step, m.chunks, run_id=m.run.run_id if m.run is not None else "", metrics=m.metrics)
    if keep_newest and (ctx.refs.newest is None or step > ctx.refs.newest.step):
        ctx.refs.newest = parsed
    return True


def chunks_of(ctx: RootContext, step: int) -> frozenset[str] | None:
    """Chunk hashes the manifest of ``step`` references (cached), or None if it cannot be read."""
    if step not in ctx.refs.chunks and not _learn(ctx, step):
        return None
    return ctx.refs.chunks[step]


def metrics_of(ctx: RootContext, step: int) -> dict[str, Any] | None:
    """The metrics the manifest of ``step`` recorded (cached with its chunks), or None if it cannot be read."""
    if step not in ctx.refs.metrics and not _learn(ctx, step):
        return None
    return ctx.refs.metrics[step]


def referenced_chunks(ctx: RootContext, *, keep_newest: bool = False) -> Mapping[str, int] | None:
    """Every chunk a committed manifest references (hash -> references); None if a manifest cannot be read.

    One listing of the root; only manifests not cached yet are read (at open: all of them; then none, unless
    a checkpoint was copied in), so the cost per save does not grow with the number of checkpoints.
    ``keep_newest``: see :func:`_learn`."""
    steps, _ = step_keys(ctx.storage)
    for s in ctx.refs.steps() - set(steps):  # deleted meanwhile (by hand): its chunks are unreferenced
        ctx.refs.drop(s)
    for s, d in steps.items():
        if (
            s not in ctx.refs.chunks
            and not _learn(ctx, s, keep_newest=keep_newest)
            and ctx.storage.exists(f"{d}/{MANIFEST_NAME}")
        ):
            return None  # an unreadable manifest: its chunks are unknown, collect nothing
    return ctx.refs.referenced()


def apply_retention(ctx: RootContext, *, at_open: bool = False) -> None:
    """Delete the valid checkpoints of this run's lineage that the policy does not keep (never the newest valid
    one), then their chunks. Other runs' checkpoints are neither counted nor deleted.

    Runs after each commit and, with ``at_open``, before the first save of a writing manager writes anything
    (after its restore, so the lineage it resumed is known: reopening with a stricter ``keep`` frees space
    before the save needs it). Then nothing has just been written: the newest checkpoint, the one kept, is
    re-read in full first, and if a chunk of it is not intact nothing is deleted.

    The doomed checkpoints' manifests are removed here; their chunks are deleted by a background pass
    (:class:`~trainguard.retention.collector.BackgroundCollection`: ``ctx.collection``), which the next save
    waits for before it writes a chunk.
    """
    from ..lineage import own

    if isinstance(ctx.retention, KeepAll):  # nothing is ever deleted: no need to look at the checkpoints
        return
    ctx.collection.wait()  # the previous pass's deletions first (this pass reads the chunks it leaves)
    if len(ctx.store.repaired) != ctx.refs.repairs_seen:  # a save rewrote damaged chunks: the checkpoints
        ctx.refs.repairs_seen = len(ctx.store.repaired)  # sharing them may be valid again
        ctx.refs.invalidate()
    if at_open or ctx.refs.usable is None:  # a full scan (once per writer, and after a restore condemned one)
        ctx.refs.usable = {i.step for i in scan(ctx.storage, ctx.store) if i.usable}
    valid = own(ctx, sorted(ctx.refs.usable))  # valid or unverified
    if not valid:
        return
    metrics: dict[int, dict[str, Any]] = {}
    if uses_metrics(ctx.retention):
        metrics = {s: m for s in valid if (m := metrics_of(ctx, s)) is not None}
    keep = select(ctx.retention, valid, metrics) | {max(valid)}
    if ctx.tiers is not None:
        keep |= ctx.tiers.protected()  # still to be sent to a tier
    # one cheap check per doomed step: a checkpoint condemned meanwhile by another process is not retention's
    doomed = [s for s in valid if s not in keep and corrupt_marker(ctx.storage, s) is None]
    if not doomed:
        return
    if at_open and not _intact(ctx, max(valid)):
        return
    candidates: set[str] = set()
    for s in doomed:
        candidates |= chunks_of(ctx, s) or set()
        d = step_dir_name(s)
        ctx.storage.delete(f"{d}/{MANIFEST_NAME}")  # uncommit first
        ctx.storage.delete_prefix(d)
        ctx.refs.drop(s)
        ctx.event("retention_delete", step=s)
    referenced = referenced_chunks(ctx)
    if referenced is None:
        log.warning("a manifest under %s is unreadable; not deleting chunks", ctx.root)
        return
    # the store as it is now: a tiered restore swaps ctx.store for a while
    dist, store = ctx.dist.enabled, ctx.store
    protect = ctx.in_flight_since() - GC_GRACE_S if dist else None
    # ``referenced`` is the live count (ctx.refs), asked again under the store's lock right before each
    # deletion: a save records its manifest's chunks there before it unpins them, so a chunk committed since
    # the pass began stays. Nothing drops a step from it while a pass runs (retention and a failed save's
    # cleanup wait for the pass first), so no snapshot is needed.
    coll = ctx.collection

    def collect() -> None:  # in the background (retention.collector): one unlink per chunk file
        # under torch.distributed, every unreferenced chunk: also those spared by earlier passes
        hashes = store.all_hashes() if dist else candidates
        freed = store.collect(hashes, referenced, protect_newer_than=protect, stop=coll.cancelled)
        log.info("retention deleted steps %s (%d bytes freed)", doomed, freed)

    coll.start(collect)


def _intact(ctx: RootContext, step: int) -> bool:
    """Re-read every chunk of ``step`` (retention at open deletes nothing unless the checkpoint it keeps is
    intact); records the check like ``verify`` does."""
    from ..catalog import record_check

    try:
        m = read_manifest(ctx.storage, step)
        owners = m.chunk_owners()
        for h, rec in m.chunks.items():
            ctx.store.verify(rec, step=step, owners=owners.get(h))
    except TrainguardError as e:
        log.warning(
            "retention at open deletes nothing: the newest checkpoint (step %d) is not intact: %s", step, e
        )
        ctx.event("retention_deferred", step=step, problem=str(e))
        return False
    record_check(ctx.storage, step, by="verify")
    return True


def cleanup_after_crash(ctx: RootContext) -> None:
    """With the lock held, before any save: remove partial directories and step directories without a manifest
    (commits killed midway), and collect every orphan chunk (left by a killed or failed save, or by step
    directories deleted by hand)."""
    storage = ctx.storage
    steps, partials = step_keys(storage)
    dead = committed_split(storage)[1]
    # temporary chunk files of killed saves when chunks/ is on another filesystem (ChunkStore.staging_for)
    for e in storage.list(CHUNKS_DIR):
        if e.is_dir and fnmatch.fnmatchcase(e.name, ".step-*.partial-*"):
            storage.delete_prefix(f"{CHUNKS_DIR}/{e.name}")
    for d in steps.values():  # temporary manifests of a publish killed before its rename
        for e in storage.list(d):
            if e.name.startswith(f".{MANIFEST_NAME}.tmp-"):
                storage.delete(f"{d}/{e.name}")
    for s in dead:
        storage.delete_prefix(steps.pop(s))
    for ps in partials.values():
        for p in ps:
            storage.delete_prefix(p)
    referenced = referenced_chunks(ctx, keep_newest=True)  # restore_latest takes the newest one parsed
    if referenced is None:
        log.warning("a manifest under %s is unreadable; not collecting orphan chunks", ctx.root)
        return
    freed = ctx.store.collect(ctx.store.all_hashes(), referenced)
    if not (partials or dead or freed):
        return
    ctx.event(
        "cleanup",
        partials=sum(len(v) for v in partials.values()),
        uncommitted_steps=dead,
        orphan_bytes_freed=freed,
        t_cleanup=time.time(),
    )


def space_hint(ctx: RootContext) -> str:
    """What reopening with ``keep=1`` would free, naming the step it keeps (for a StorageFullError)."""
    try:
        usable = sorted(i.step for i in scan(ctx.storage, ctx.store) if i.usable)
    except OSError:
        return ""
    if not usable:
        return " No checkpoint exists yet: free space on the device."
    newest, older = usable[-1], usable[:-1]
    if not older:
        return f" The only checkpoint is step {newest}: free space on the device."
    try:
        manifests = {s: read_manifest(ctx.storage, s) for s in usable}
    except TrainguardError:
        return ""
    kept = set(manifests[newest].chunks)
    freed = {h: rec.length for s in older for h, rec in manifests[s].chunks.items() if h not in kept}
    return (
        f" To make room, reopen the manager with keep=1: before its first save it keeps step {newest} (the "
        f"newest valid checkpoint, re-read first) and deletes steps {older}, freeing {sum(freed.values())} bytes of chunks; "
        "or delete step directories by hand (the next writer collects their orphaned chunks at open)."
    )
