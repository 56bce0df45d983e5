"""The commit protocol (docs/FORMAT.md "Commit protocol").

1. Every rank writes its chunks as temporary files in the save's partial directory, makes them durable
   (one ``syncfs`` by default, or an fsync per file), renames them into ``chunks/`` and makes the renames
   durable; ``write_data`` returns only then.
2. DCP gathers every rank's results to the coordinator; only if no rank failed does it call ``finish``.
3. The coordinator builds the manifest, creates ``step-N/`` (fsync of the root), and publishes
   ``step-N/manifest.json`` with tmp + fsync + rename + directory fsync. Its presence is the commit.
   Just before the manifest, it records the save's check of the bytes (``step-N/verified.json``, not
   fsynced: losing it only makes the checkpoint list as ``unverified``; without the manifest it means
   nothing): every chunk was either written from the bytes whose CRC32C the manifest records, or re-read and
   matched before the save referenced it (ChunkStore). Written before the commit, so that a kill right after
   the commit never leaves a committed checkpoint without it.

A failure anywhere before step 3 completes leaves no manifest, so no reader ever sees the step as valid, and
nothing earlier was modified (chunks are immutable and content-addressed; manifests of other steps are never
touched).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._time import iso
from .catalog import CHECK_RECORD, CORRUPT_MARKER, record_check
from .errors import SaveError
from .format import (
    MANIFEST_NAME,
    ChunkRecord,
    Manifest,
    Segment,
    ShardRecord,
    TensorEntry,
    ValueEntry,
    chunk_relpath,
    manifest_to_json,
    step_dir_name,
)
from .format.run import RunInfo
from .state.dtypes import dtype_name
from .state.per_rank import strip_rank
from .storage.base import Storage, as_storage
from .validation.probe import PROBE_FILE
from .validation.suspect import SUSPECT_MARKER

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult


def build_manifest(
    step: int,
    md: Metadata,
    results: list[list[WriteResult]],
    paths: Mapping[str, Any],
    top: dict[str, dict[str, Any]],
    metrics: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    run: RunInfo | None = None,
) -> Manifest:
    """Join DCP's global metadata (what exists: dtypes, shapes, shard offsets) with every rank's write results
    (where the bytes are) into our manifest. A path starting with ``("r", rank)`` marks a per-rank entry
    (:mod:`trainguard.state.per_rank`)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    by_index: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    chunks: dict[str, ChunkRecord] = {}
    new: set[str] = set()  # chunks this save wrote (not deduplicated): its new_bytes
    split_sizes: set[int] = set()  # the chunk_size_bytes each writer cut large tensors with
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            by_index[(wr.index.fqn, tuple(wr.index.offset or ()))] = sd
            if "split" in sd:
                split_sizes.add(sd["split"])
            for h, info in sd.get("chunks", {}).items():
                chunks[h] = ChunkRecord(
                    h,
                    chunk_relpath(h),
                    info["length"],
                    info["crc32c"],
                    info["codec"],
                    info.get("size"),
                    info.get("base"),
                    info.get("delta"),
                    info.get("word", 0),
                )
                if info.get("new"):
                    new.add(h)
    entries: dict[str, TensorEntry | ValueEntry] = {}
    for fqn, smd in md.state_dict_metadata.items():
        path, rank = strip_rank(tuple(tuple(p) for p in paths[fqn]))
        if isinstance(smd, TensorStorageMetadata):
            shards = []
            for c in smd.chunks:
                sd = by_index[(fqn, tuple(c.offsets))]
                segs = tuple(Segment(h, o, n) for h, o, n in sd["segments"])
                shards.append(ShardRecord(tuple(c.offsets), tuple(c.sizes), segs))
            entries[fqn] = TensorEntry(
                fqn, path, dtype_name(smd.properties.dtype), tuple(smd.size), tuple(shards), rank
            )
        elif isinstance(smd, BytesStorageMetadata):
            sd = by_index[(fqn, ())]
            if "value" in sd:
                entries[fqn] = ValueEntry(fqn, path, "json", sd["value"], None, rank)
            else:
                segs = tuple(Segment(h, o, n) for h, o, n in sd["segments"])
                entries[fqn] = ValueEntry(fqn, path, sd["codec"], None, segs, rank)
    t = time.time()
    return Manifest(
        step=step,
        t=t,
        time=iso(t),
        world_size=len(results),
        entries=entries,
        chunks=chunks,
        metrics=dict(metrics or {}),
        metadata=dict(metadata or {}),
        top_level=top,
        run=run,
        new_bytes=sum(chunks[h].length for h in new),
        chunk_sizes=tuple(sorted(split_sizes)),
    )


def publish(
    root: str | os.PathLike[str] | Storage,
    m: Manifest,
    *,
    fsync: bool = True,
    extra: Callable[[bytes], dict[str, bytes]] | None = None,
) -> None:
    """Step 3 of the protocol: create the step directory and publish the manifest last, atomically.

    Args:
        root: the run root (a directory or its :class:`~trainguard.storage.base.Storage`).
        m: the manifest to commit.
        fsync: make the step directory and the manifest durable.
        extra: ``extra(manifest bytes)`` -> per-step side files (name -> bytes, e.g. ``probe.json``, which
            records the CRC32C of the manifest it belongs to), published before the manifest so a committed
            checkpoint always has them. A ``suspect.json`` of the checkpoint this one replaces is removed after
            the manifest (a crash in between leaves a marker bound to the old manifest's CRC32C: ignored).

    Raises:
        StorageFullError: no space left for the manifest (nothing is committed; its ``step`` is set).
        OSError: the manifest could not be written (nothing is committed).
    """
    storage = as_storage(root)
    d = step_dir_name(m.step)
    created = storage.make_dir(d)
    if created and fsync:
        storage.barrier("")
    for stale in (CORRUPT_MARKER, CHECK_RECORD, PROBE_FILE):  # records of a checkpoint this one replaces
        storage.delete(f"{d}/{stale}")
    try:
        data = manifest_to_json(m)
        for name, side in (extra(data) if extra is not None else {}).items():
            storage.publish(f"{d}/{name}", side, durable=fsync)
        record_check(storage, m.step, by="save")
        storage.publish(f"{d}/{MANIFEST_NAME}", data, durable=fsync)
        storage.delete(f"{d}/{SUSPECT_MARKER}")
    except BaseException as e:
        if created:  # leave nothing behind that lists as a checkpoint of this step
            storage.delete_prefix(d)
        else:  # the record must not vouch for the checkpoint this one failed to replace
            storage.delete(f"{d}/{CHECK_RECORD}")
        if isinstance(e, SaveError) and e.step is None:
            e.step = m.step
        raise
