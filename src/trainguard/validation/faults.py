"""Fault injection for demos and tests: silent corruption that CRC32C cannot see.

:func:`corrupt_silently` imitates memory corrupted before the checksum was computed: a bit of a floating
tensor's bytes is flipped, and the damaged bytes are stored as a save would have stored them, as a chunk of
their own (named by the hash of the damaged bytes, with their CRC32C recorded in the manifest, whose own CRC32C
is recomputed). Every integrity check passes; only content validation (the probe) can catch it. The original
chunk is left in place (no longer referenced by this checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import crc32c

from ..catalog import read_manifest
from ..format import TensorEntry, step_dir_name
from ..format.layout import MANIFEST_NAME, chunk_relpath
from ..format.manifest import DTYPE_ITEMSIZE, manifest_to_json
from ..incremental.chunkstore import content_hash
from ..storage.local import atomic_write, write_file
from .probe import PROBE_FILE

FLOATS = ("float64", "float32", "float16", "bfloat16")


def corrupt_silently(root: str | os.PathLike[str], step: int, *, fqn: str | None = None) -> tuple[str, str]:
    """Flip one mantissa bit of a floating tensor of ``step`` (the value stays finite), as memory corrupted
    before checksumming would: the damaged chunk is stored under its own hash with its own CRC32C.

    The tensor chosen is ``fqn``, or the largest floating tensor whose chunk no other committed checkpoint
    references (so only ``step`` is damaged).

    Args:
        root: the run root.
        step: the committed checkpoint to damage.
        fqn: the tensor to damage (default: chosen as above).

    Returns:
        ``(fqn, path of the damaged chunk)``.

    Raises:
        ValueError: no floating tensor of ``step`` lies in a chunk only it uses.
    """
    root = Path(root)
    m = read_manifest(root, step)
    others: set[str] = set()
    for d in root.iterdir():
        if d.name.startswith("step-") and d.name != step_dir_name(step) and (d / MANIFEST_NAME).exists():
            try:
                others |= set(read_manifest(root, int(d.name[5:])).chunks)
            except Exception:  # noqa: BLE001 - a damaged neighbour: its chunks are not protected
                continue
    candidates = [
        e
        for e in m.entries.values()
        if isinstance(e, TensorEntry)
        and e.dtype in FLOATS
        and (fqn is None or e.fqn == fqn)
        and e.shards
        and e.shards[0].segments
        and e.shards[0].segments[0].chunk not in others
        and e.shards[0].segments[0].length >= DTYPE_ITEMSIZE[e.dtype]
    ]
    if not candidates:
        raise ValueError(f"step {step}: no floating tensor{' ' + fqn if fqn else ''} in a chunk only it uses")
    ent = max(candidates, key=lambda e: e.shards[0].segments[0].length)
    seg = ent.shards[0].segments[0]
    item = DTYPE_ITEMSIZE[ent.dtype]
    # a mantissa byte of the middle element: the value changes a little and stays finite
    at = seg.offset + (seg.length // item // 2) * item + max(0, item - 2)
    old = m.chunks[seg.chunk]
    data = bytearray((root / old.path).read_bytes())
    data[at] ^= 0x04
    new_hash = content_hash(bytes(data))
    new = dataclasses.replace(
        old, hash=new_hash, path=chunk_relpath(new_hash), crc32c=crc32c.crc32c(bytes(data))
    )
    (root / new.path).parent.mkdir(parents=True, exist_ok=True)
    write_file(root / new.path, bytes(data))
    m.chunks = {
        (new_hash if h == old.hash else h): (new if h == old.hash else c) for h, c in m.chunks.items()
    }
    m.entries = {k: _moved(e, old.hash, new_hash) for k, e in m.entries.items()}
    mbytes = manifest_to_json(m)
    atomic_write(root / step_dir_name(step) / MANIFEST_NAME, mbytes)
    probe = root / step_dir_name(step) / PROBE_FILE
    if probe.is_file():  # the save would have bound its probe record to this manifest
        doc = json.loads(probe.read_bytes())
        doc["manifest_crc32c"] = crc32c.crc32c(mbytes)
        atomic_write(probe, json.dumps(doc).encode())
    return ent.fqn, new.path


def _moved(entry: Any, old: str, new: str) -> Any:
    """``entry`` with its segments in chunk ``old`` pointing at chunk ``new``."""

    def segs(ss: Any) -> Any:
        return tuple(dataclasses.replace(x, chunk=new) if x.chunk == old else x for x in ss)

    if isinstance(entry, TensorEntry):
        return dataclasses.replace(
            entry, shards=tuple(dataclasses.replace(sh, segments=segs(sh.segments)) for sh in entry.shards)
        )
    if getattr(entry, "segments", None):
        return dataclasses.replace(entry, segments=segs(entry.segments))
    return entry
