"""The manifest from a save, and DCP's view of it: :func:`build_manifest` joins the save's layout and every
rank's write results into our :class:`~trainguard.format.Manifest` (at the commit; :func:`layout_from_metadata`
turns DCP's global ``Metadata`` into that layout for a save through ``dcp.save``), and
:func:`manifest_to_metadata` rebuilds DCP's ``Metadata`` from it (at a load through DCP; a single-process load
reads the manifest directly, :mod:`trainguard.distributed.chunkread`). DCP is imported inside the functions
(never at ``import trainguard``, see :mod:`trainguard._lazy`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._time import iso
from ..format import (
    ChunkRecord,
    Manifest,
    Segment,
    ShardRecord,
    TensorEntry,
    ValueEntry,
    chunk_relpath,
)
from ..format.run import RunInfo
from ..state.dtypes import dtype_from_name, dtype_name
from ..state.per_rank import strip_rank
from .chunkwrite import ItemResult, Layout, TensorLayout

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def layout_from_metadata(md: Metadata) -> Layout:
    """Every saved tensor's layout (dtype, global shape, shards) from DCP's global ``Metadata``; None for a
    value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    layout: Layout = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            layout[fqn] = TensorLayout(
                dtype_name(smd.properties.dtype),
                tuple(smd.size),
                tuple((tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks),
            )
        else:
            layout[fqn] = None
    return layout


def build_manifest(
    step: int,
    layout: Layout,
    results: list[list[ItemResult]],
    paths: Mapping[str, Any],
    top: dict[str, dict[str, Any]],
    metrics: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    run: RunInfo | None = None,
) -> Manifest:
    """Join the save's layout (what exists: dtypes, shapes, shard offsets) with every rank's write results
    (where the bytes are) into our manifest. A path starting with ``("r", rank)`` marks a per-rank entry
    (:mod:`trainguard.state.per_rank`).

    Args:
        step: the step saved.
        layout: fqn -> tensor layout, or None for a value (``layout_from_metadata`` for a save through DCP).
        results: every rank's item results (:class:`~trainguard.distributed.chunkwrite.ChunkWriter`).
        paths: fqn -> nested path of every entry.
        top, metrics, metadata, run: the manifest's fields of those names.
    """
    by_index: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
    chunks: dict[str, ChunkRecord] = {}
    new: set[str] = set()  # chunks this save wrote (not deduplicated): its new_bytes
    split_sizes: set[int] = set()  # the chunk_size_bytes each writer cut large tensors with
    for rank_results in results:
        for wr in rank_results:
            sd = wr.storage_data
            by_index[(wr.spec.fqn, wr.spec.offset)] = sd
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
    for fqn, tl in layout.items():
        path, rank = strip_rank(tuple(tuple(p) for p in paths[fqn]))
        if tl is not None:
            shards = []
            for offsets, sizes in tl.shards:
                sd = by_index[(fqn, offsets)]
                segs = tuple(Segment(h, o, n) for h, o, n in sd["segments"])
                shards.append(ShardRecord(offsets, sizes, segs))
            entries[fqn] = TensorEntry(fqn, path, tl.dtype, tl.size, tuple(shards), rank)
        else:
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


def manifest_to_metadata(m: Manifest) -> Metadata:
    """DCP ``Metadata`` equivalent of our manifest (what DCP's planners need to plan a load): the inverse of
    :func:`build_manifest` (the chunks are found through the manifest itself, see
    :class:`~trainguard.distributed.chunkread.ShardReader`)."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict[str, Any] = {}
    for fqn, e in m.entries.items():
        if isinstance(e, TensorEntry):
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(e.dtype)),
                size=torch.Size(e.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                    for s in e.shards
                ],
            )
        else:
            sdm[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=sdm)
