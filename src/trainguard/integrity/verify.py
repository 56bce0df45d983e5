"""The ``verify`` scrub: re-read every chunk of the chosen checkpoints and check length and CRC32C.

Chunks shared by several checkpoints are read once. Memory is bounded (chunks are read in 16 MiB blocks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..catalog import is_committed, read_manifest, stable_committed_steps
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format import Manifest, ValueEntry
from ..format.manifest import DTYPE_ITEMSIZE
from ..incremental.chunkstore import ChunkStore


@dataclass
class VerifyReport:
    """Result of a scrub.

    Attributes:
        ok: True when every checked checkpoint is intact.
        checked: the steps checked, ascending.
        corrupt: one record per problem: ``step``, ``chunk`` (relative path, or None for a manifest problem),
            ``tensors`` (FQNs stored in that chunk) and ``problem``.
        bytes_read: bytes re-read.
    """

    ok: bool = True
    checked: list[int] = field(default_factory=list)
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    bytes_read: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "corrupt": self.corrupt,
            "bytes_read": self.bytes_read,
        }


def verify(
    root: str | os.PathLike[str],
    steps: Iterable[int] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Re-read and check the checkpoints of ``steps`` (default: every committed checkpoint).

    Args:
        root: the run root.
        steps: the steps to check; None checks all committed ones.
        progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.

    A checkpoint that a writer's retention deletes while it is being checked is dropped from the report when
    ``steps`` is None (it was deleted, not damaged); a requested step raises CheckpointNotFoundError.

    Raises:
        CheckpointNotFoundError: a requested step has no committed checkpoint (or was deleted meanwhile).
    """
    store = ChunkStore(root)
    committed = set(stable_committed_steps(root))  # stable listing; no manifest: incomplete, not checked
    wanted = sorted(committed) if steps is None else sorted(set(steps))
    report = VerifyReport()
    manifests = {}
    for s in wanted:
        try:
            manifests[s] = read_manifest(root, s)
            report.checked.append(s)
        except CheckpointNotFoundError:
            if steps is not None:
                raise
        except CorruptCheckpointError as e:
            report.checked.append(s)
            report.ok = False
            report.corrupt.append({"step": s, "chunk": None, "tensors": [], "problem": str(e)})
    total = sum(c.length for m in manifests.values() for c in m.chunks.values())
    results: dict[str, str | None] = {}
    done = 0
    for s, m in manifests.items():
        owners = m.chunk_owners()
        for h, rec in m.chunks.items():
            if h not in results:
                try:
                    store.verify(rec, step=s, owners=owners.get(h))
                    results[h] = None
                    report.bytes_read += rec.length
                except CorruptCheckpointError as e:
                    results[h] = str(e)
                    report.bytes_read += rec.length
            done += rec.length
            if progress is not None:
                progress(done, total)
            if results[h] is not None:
                report.ok = False
                report.corrupt.append(
                    {"step": s, "chunk": rec.path, "tensors": owners.get(h, []), "problem": results[h]}
                )
        _check_values(store, m, s, report, results)
        _check_dtypes(m, s, report)
    vanished = {c["step"] for c in report.corrupt if not is_committed(root, c["step"])}
    if vanished:  # deleted by a writer while being checked: its chunks went with it
        if steps is not None:
            raise CheckpointNotFoundError(
                f"the checkpoint of step {min(vanished)} under {root} was deleted while it was being verified"
            )
        report.checked = [s for s in report.checked if s not in vanished]
        report.corrupt = [c for c in report.corrupt if c["step"] not in vanished]
        report.ok = not report.corrupt
    return report


def _check_dtypes(m: Manifest, step: int, report: VerifyReport) -> None:
    """Every tensor's dtype must exist in this torch and every shard must hold exactly its elements' bytes
    (names of well-known dtypes are checked without torch)."""
    if all(isinstance(e, ValueEntry) or e.dtype in DTYPE_ITEMSIZE for e in m.entries.values()):
        return  # the parser has checked these shards' bytes already
    from ..state.dtypes import check_shard_bytes

    try:
        check_shard_bytes(m)
    except CorruptCheckpointError as err:
        report.ok = False
        report.corrupt.append({"step": step, "chunk": None, "tensors": err.tensors, "problem": str(err)})


def _check_values(
    store: ChunkStore, m: Manifest, step: int, report: VerifyReport, chunk_ok: dict[str, str | None]
) -> None:
    """Decode every stored (non-inline) value the way restore would, so an unsafe payload (a pickle that
    ``torch.load(weights_only=True)`` refuses) is reported here too, not only at restore."""
    cache: dict[str, bytearray] = {}
    for fqn, e in m.entries.items():
        if not isinstance(e, ValueEntry) or e.segments is None:
            continue
        if any(chunk_ok.get(seg.chunk) is not None for seg in e.segments):
            continue  # its chunk is already reported
        try:
            read_value(store, m, e, cache=cache)
        except CorruptCheckpointError as err:
            report.ok = False
            report.corrupt.append(
                {
                    "step": step,
                    "chunk": m.chunks[e.segments[0].chunk].path if e.segments else None,
                    "tensors": [fqn],
                    "problem": str(err),
                }
            )


def read_value(
    store: ChunkStore, m: Manifest, e: ValueEntry, *, cache: dict[str, bytearray] | None = None
) -> Any:
    """Decode one stored non-tensor value of a checkpoint the way restore does (never executes code).

    Args:
        store: the run root's chunk store.
        m: the checkpoint's manifest.
        e: the value's entry in ``m``.
        cache: chunks already read, by content hash (filled in), so values sharing a chunk read it once.

    Returns:
        The value: inline JSON, JSON from its chunk, or ``torch.load(weights_only=True)`` of its bytes.

    Raises:
        CorruptCheckpointError: a chunk it lives in is missing or fails its CRC32C, or the payload does not
            decode (``UnsafeCheckpointError`` when ``weights_only`` refuses it).
    """
    from ..state.values import TAG_JSON, TAG_TORCH, decode_value

    if e.segments is None:
        return e.value
    cache = {} if cache is None else cache
    data = bytearray()
    for seg in e.segments:
        if seg.chunk not in cache:
            cache[seg.chunk] = store.read(m.chunks[seg.chunk], step=m.step)
        data += cache[seg.chunk][seg.offset : seg.offset + seg.length]
    return decode_value((TAG_JSON if e.codec == "json" else TAG_TORCH) + bytes(data), e.fqn)
