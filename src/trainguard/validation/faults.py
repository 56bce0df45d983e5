"""Fault injection for demos and tests: silent corruption that CRC32C cannot see.

:func:`corrupt_silently` imitates memory corrupted before the checksum was computed: a bit of a floating
tensor's bytes is flipped in its chunk and the chunk's recorded CRC32C (and the manifest's own CRC32C) are
rewritten to match, so every integrity check passes. Only content validation (the probe) can catch it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import crc32c

from ..catalog import read_manifest
from ..format import TensorEntry, step_dir_name
from ..format.layout import MANIFEST_NAME
from ..format.manifest import DTYPE_ITEMSIZE, manifest_to_json
from ..storage.local import atomic_write

FLOATS = ("float64", "float32", "float16", "bfloat16")


def corrupt_silently(root: str | os.PathLike[str], step: int, *, fqn: str | None = None) -> tuple[str, str]:
    """Flip one mantissa bit of a floating tensor of ``step`` (the value stays finite) and re-record the CRCs.

    The tensor chosen is ``fqn``, or the largest floating tensor whose chunk no other committed checkpoint
    references (so only ``step`` is damaged). Its chunk file is rewritten in place.

    Args:
        root: the run root.
        step: the committed checkpoint to damage.
        fqn: the tensor to damage (default: chosen as above).

    Returns:
        ``(fqn, chunk path)`` of what was changed.

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
    elems = seg.length // item
    # a mantissa byte of the middle element: the value changes a little and stays finite
    at = seg.offset + (elems // 2) * item + max(0, item - 2)
    rec = m.chunks[seg.chunk]
    path = root / rec.path
    data = bytearray(path.read_bytes())
    data[at] ^= 0x04
    mode = path.stat().st_mode & 0o777
    os.chmod(path, mode | 0o200)
    try:
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes([data[at]]))
            f.flush()
            os.fsync(f.fileno())
    finally:
        os.chmod(path, mode)
    chunks = dict(m.chunks)
    chunks[seg.chunk] = dataclasses.replace(rec, crc32c=crc32c.crc32c(bytes(data)))
    m.chunks = chunks
    atomic_write(root / step_dir_name(step) / MANIFEST_NAME, manifest_to_json(m))
    return ent.fqn, rec.path
