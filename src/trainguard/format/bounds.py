"""Consistency rules that bound what a manifest can make a reader allocate (torch-free).

A manifest is signed by its own CRC32C, which anyone can recompute, so its numbers are checked against each
other before anything is allocated. The rules (docs/FORMAT.md "Validity"):

- **shards tile each tensor exactly once**: every shard lies inside the shape, no two shards overlap, and
  together they cover every element (a half-shard listed twice would leave the other half at old values);
- **a shard lists a chunk byte range at most once**, unless the range is a whole chunk of a split size the
  manifest records in ``chunk_sizes`` (the writer cuts a large tensor into pieces of ``chunk_size_bytes`` and
  stores identical pieces, e.g. of zeros, as one chunk listed once per piece; only the last piece of a tensor
  is shorter, and it is listed once). A manifest that records no ``chunk_sizes`` was written before they were
  recorded and is read with the default 64 MiB (``LEGACY_CHUNK_SIZES``). So a small chunk listed 2,000 times
  to declare a tensor 2,000 times its size is refused before anything is allocated;
- **chunk lengths agree with what the entries reference**: the distinct byte ranges referenced in a chunk do
  not overlap, and the chunk is at most twice their total plus ``CHUNK_SLACK_BYTES`` (a save writes chunks
  tiled exactly), so a 64 GiB sparse chunk behind a 1 MB tensor is refused before it is opened;
- **paths are at most ``MAX_PATH_DEPTH`` levels deep** (deeper is never written: flattening stops at 100).

With these, the bytes a verify or restore reads are bounded by the tensor and value bytes the manifest
declares; the declared bytes themselves are checked against the dtype's item size (here for well-known dtypes,
in :func:`trainguard.state.dtypes.check_shard_bytes` for every dtype) and against the available memory before
a restore allocates them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError

if TYPE_CHECKING:
    from .manifest import ChunkRecord, Segment, ShardRecord

MAX_PATH_DEPTH = 200
LEGACY_CHUNK_SIZES = (64 << 20,)
"""Split sizes assumed for a manifest that records none: the default ``chunk_size_bytes``."""
CHUNK_SLACK_BYTES = 64 << 10
"""Unreferenced bytes a chunk may hold beyond as many as it references (a save writes none)."""


def _bad(msg: str, step: int | None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"corrupt manifest: {msg}", step=step)


def check_shard_segments(
    fqn: str,
    shard: ShardRecord,
    chunks: dict[str, ChunkRecord],
    chunk_sizes: Sequence[int],
    step: int | None,
) -> None:
    """Refuse a shard that lists the same part of a chunk twice, unless it is a whole chunk whose length is
    one of the split sizes ``chunk_sizes`` (bytes) the writers used: a save repeats only such chunks."""
    seen: set[tuple[str, int, int]] = set()
    for s in shard.segments:
        key = (s.chunk, s.offset, s.length)
        if key in seen and not (
            s.offset == 0 and s.length == chunks[s.chunk].decoded_size and s.length in chunk_sizes
        ):
            whole = s.offset == 0 and s.length == chunks[s.chunk].decoded_size
            raise _bad(
                f"{fqn}: shard at {shard.offsets} lists bytes [{s.offset}, {s.offset + s.length}) of chunk "
                f"{s.chunk} more than once"
                + (
                    f"; a save repeats only whole chunks of its split size ({', '.join(map(str, chunk_sizes))} "
                    "bytes): the shard declares more bytes than its chunks hold"
                    if whole
                    else ""
                ),
                step,
            )
        seen.add(key)


def check_tiling(fqn: str, shape: Sequence[int], shards: Sequence[ShardRecord], step: int | None) -> None:
    """Refuse shards that overlap (the caller has checked that they lie inside ``shape`` and that their
    element counts add up to the tensor's)."""
    if len(shards) < 2:  # nothing to overlap with (most entries: 0.3 s of a 32,000-tensor manifest's parse)
        return
    boxes = sorted(
        (tuple(sh.offsets), tuple(o + n for o, n in zip(sh.offsets, sh.sizes, strict=True)))
        for sh in shards
        if all(sh.sizes)  # an empty shard holds no element
    )
    if not shape:
        if len(boxes) > 1:
            raise _bad(f"{fqn}: a 0-dim tensor has {len(boxes)} shards", step)
        return
    # sweep along dim 0: only boxes whose dim-0 ranges overlap can overlap
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for lo, hi in boxes:
        active = [b for b in active if b[1][0] > lo[0]]
        for alo, ahi in active:
            if all(a0 < b1 and b0 < a1 for a0, a1, b0, b1 in zip(alo, ahi, lo, hi, strict=True)):
                raise _bad(
                    f"{fqn}: shards at offsets {alo} and {lo} overlap; each element must be stored exactly once",
                    step,
                )
        active.append((lo, hi))


def check_chunk_coverage(
    chunks: dict[str, ChunkRecord], references: Iterable[Segment], step: int | None
) -> None:
    """Refuse a chunk whose referenced byte ranges overlap (other than the same range listed again) or that
    is longer than its referenced bytes allow: at most ``2 * referenced + CHUNK_SLACK_BYTES`` (a save writes
    chunks tiled exactly by their ranges; readers read whole chunks to check their CRC32C)."""
    ranges: dict[str, set[tuple[int, int]]] = {h: set() for h in chunks}
    for s in references:
        if s.length:
            ranges[s.chunk].add((s.offset, s.length))
    # a delta base is needed whole by its dependent, whose decoded size the parser checked it has
    bases = {c.base for c in chunks.values() if c.base is not None}
    for h, rs in ranges.items():
        end = 0
        used = 0
        for off, ln in sorted(rs):
            if off < end:
                raise _bad(f"the byte ranges the entries reference in chunk {h} overlap", step)
            end = off + ln
            used += ln
        if h in bases:  # pinned to its dependent's size (checked by the parser), needed whole
            used = max(used, chunks[h].decoded_size)
        size = max(chunks[h].length, chunks[h].decoded_size)
        if size > 2 * used + CHUNK_SLACK_BYTES:
            raise _bad(
                f"chunk {h} is {size} bytes long but the entries reference only {used} of them; "
                "a chunk holds the bytes the manifest declares",
                step,
            )
