"""The ``verify`` scrub: re-read every chunk of the chosen checkpoints and check length and CRC32C.

Chunks shared by several checkpoints are read once. Memory is bounded (chunks are read in 16 MiB blocks).

What a scrub finds is recorded, so that every view (``ls``, ``info``, ``latest_step``, ``restore_latest``)
agrees with the last full read: a checked step whose chunks all match gets ``verified.json`` (clearing a stale
``corrupt.json``); a confirmed mismatch (read twice) condemns every committed step that references the chunk
(``corrupt.json``); a chunk that cannot be read (an I/O error, retried) is recorded as an unreadable check,
never as corruption. Recording is skipped where the root is not writable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..catalog import is_committed, read_manifest, record_check, record_corrupt, stable_committed_steps
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
    record: bool = True,
    limiter: Any = None,
) -> VerifyReport:
    """Re-read and check the checkpoints of ``steps`` (default: every committed checkpoint).

    Args:
        root: the run root.
        steps: the steps to check; None checks all committed ones.
        progress: called as ``progress(bytes_done, bytes_total)`` after each chunk.
        record: record the findings in the step directories (module docstring); False leaves the root
            untouched.
        limiter: caps the read rate (a :class:`trainguard.validation.scrub.RateLimiter`; its ``consume(n)`` is
            called after each block read), e.g. ``verify --max-bandwidth``.

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
    errors: dict[str, CorruptCheckpointError] = {}
    done = 0
    for s, m in manifests.items():
        owners = m.chunk_owners()
        for h, rec in m.chunks.items():
            if h not in results:
                try:
                    store.verify(
                        rec, step=s, owners=owners.get(h), on_block=limiter.consume if limiter else None
                    )
                    results[h] = None
                    report.bytes_read += rec.length
                except CorruptCheckpointError as e:
                    results[h] = str(e)
                    errors[h] = e
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
        _check_bools(store, m, s, report, results)
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
    if record:
        _record(root, committed, manifests, report, errors)
    return report


def _record(
    root: str | os.PathLike[str],
    committed: set[int],
    manifests: dict[int, Manifest],
    report: VerifyReport,
    errors: dict[str, CorruptCheckpointError],
) -> None:
    """Write what the scrub found into the step directories (advisory: failures to write are ignored)."""
    damaged = {h: e for h, e in errors.items() if e.damaged}
    condemned: dict[int, tuple[str, str | None, list[str]]] = {}
    if damaged:  # a confirmed bad chunk condemns every committed step that references it, checked or not
        for s in sorted(committed):
            m = manifests.get(s)
            if m is None:
                try:
                    m = read_manifest(root, s)
                except (CorruptCheckpointError, CheckpointNotFoundError):
                    continue
            for h in m.chunks:
                if h in damaged:
                    e = damaged[h]
                    condemned.setdefault(s, (str(e).replace(f" of step {e.step}", ""), e.chunk, e.tensors))
    for s, m in manifests.items():
        if s in condemned:
            continue
        by_path = {rec.path: h for h, rec in m.chunks.items()}
        content: list[dict[str, Any]] = []
        unreadable: list[CorruptCheckpointError] = []
        for c in (c for c in report.corrupt if c["step"] == s):
            found = errors.get(by_path.get(c["chunk"], ""))
            if (
                found is None
            ):  # an unsafe value or an unknown dtype: deterministic, from the manifest and good bytes
                content.append(c)
            elif found.unreadable:
                unreadable.append(found)
            # else: a missing chunk or one that is not a file: listing sees it without a record
        if content:
            c = content[0]
            record_corrupt(root, s, c["problem"], chunk=c["chunk"], tensors=c["tensors"])
        elif unreadable:
            record_check(
                root, s, by="verify", ok=False, problem=str(unreadable[0]), chunk=unreadable[0].chunk
            )
        elif not any(c["step"] == s for c in report.corrupt):
            record_check(root, s, by="verify")
    for s, (problem, chunk, tensors) in condemned.items():
        record_corrupt(root, s, f"verify: {problem}", chunk=chunk, tensors=tensors)


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


def _check_bools(
    store: ChunkStore, m: Manifest, step: int, report: VerifyReport, chunk_ok: dict[str, str | None]
) -> None:
    """Every bool tensor's bytes must be 0 or 1, as restore requires (a manifest calling another dtype's
    chunk ``bool`` passes every CRC32C)."""
    import torch

    from ..state.values import bool_bytes_valid, invalid_bools_problem

    cache: dict[str, bytearray] = {}
    for fqn, e in m.entries.items():
        if isinstance(e, ValueEntry) or e.dtype != "bool":
            continue
        segs = [seg for sh in e.shards for seg in sh.segments]
        if any(chunk_ok.get(seg.chunk) is not None for seg in segs):
            continue  # its chunk is already reported
        try:
            bad = any(
                len(b) and not bool_bytes_valid(torch.frombuffer(b, dtype=torch.bool))
                for b in (segment_bytes(store, m, seg, cache) for seg in segs)
            )
        except CorruptCheckpointError as err:
            bad, problem = True, str(err)
        else:
            problem = invalid_bools_problem([fqn])
        if bad:
            report.ok = False
            report.corrupt.append(
                # a manifest-level problem (as a dtype's): the chunk itself may be intact and shared with steps
                # that read it correctly
                {"step": step, "chunk": None, "tensors": [fqn], "problem": problem}
            )


def segment_bytes(store: ChunkStore, m: Manifest, seg: Any, cache: dict[str, bytearray]) -> memoryview:
    """The bytes of one segment (decoded where its chunk is encoded), its chunk read once per ``cache``."""
    if seg.chunk not in cache:
        rec = m.chunks[seg.chunk]
        if rec.encoded:
            from ..incremental.delta import read_decoded

            cache[seg.chunk] = bytearray(read_decoded(store, m.chunks, rec, step=m.step))
        else:
            cache[seg.chunk] = store.read(rec, step=m.step)
    return memoryview(cache[seg.chunk])[seg.offset : seg.offset + seg.length]


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
    for seg in e.segments:  # packed values of a compressed save are decoded
        data += segment_bytes(store, m, seg, cache)
    return decode_value((TAG_JSON if e.codec == "json" else TAG_TORCH) + bytes(data), e.fqn)
