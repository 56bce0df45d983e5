"""Encoding a save's chunks (compression, deltas against the previous save) and decoding them on restore.

A tensor of its own chunks is cut into pieces (``chunk_size_bytes``); a piece is identified across saves by
``(fqn, shard offsets, piece index)``. For each piece a save either

- reuses the previous save's chunk when the piece's bytes are unchanged (xxh3 of the raw bytes), or
- writes a delta (``sub``: word-wise integer difference, or ``xor``) against the previous save's chunk of the
  same piece, compressed, when that is smaller than compressing the piece alone (the delta of a slowly
  changing tensor, or of an embedding table of which few rows changed, is mostly zero words), or
- writes the piece compressed (or raw when compression is off for this save).

Chains are bounded: every ``max_chain``-th save writes no new delta, and no chunk's chain of bases grows to
``max_chain`` links. A delta chunk's record names its base; the manifest lists the whole chain of bases in its
chunk table, so retention and garbage collection treat every base as referenced by the checkpoints that need
it (deleting a checkpoint never breaks a kept one; a kill during GC deletes only unreferenced chunks).

The previous save's pieces are kept in host memory (one copy of the tensors saved in their own chunks) while
``delta=True``: that is the base a delta needs without reading storage back.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..errors import CorruptCheckpointError
from ..format import ChunkRecord
from .codecs import CodecError, Encoding, compress, decompress_into, delta_decode_inplace, delta_encode

if TYPE_CHECKING:
    from .chunkstore import ChunkStore

PieceKey = tuple[str, tuple[int, ...], int]  # (fqn, shard offsets, piece index)
DELTA_OPS_DEFAULT = "sub"  # integer difference: 79.7% vs XOR's 81.1% on dense AdamW (benchmarks/RESULTS.md)


def delta_word(itemsize: int) -> int:
    """Word size a delta works on for elements of ``itemsize`` bytes (complex128: two 8-byte words)."""
    for w in (8, 4, 2):
        if itemsize % w == 0:
            return w
    return 1


@dataclass
class Piece:
    """What a save stored for one piece: its raw xxh3, its chunk and that chunk's chain of bases (nearest
    first), and (delta mode) a copy of its raw bytes, the next save's delta base."""

    raw_hash: str
    chain: tuple[ChunkRecord, ...]
    data: np.ndarray | None = None

    @property
    def depth(self) -> int:
        return len(self.chain) - 1


@dataclass
class EncodeStats:
    """Per save: raw bytes encoded, stored bytes they became, CPU seconds spent encoding (all threads)."""

    raw_bytes: int = 0
    stored_bytes: int = 0
    encode_s: float = 0.0
    deltas: int = 0
    reused: int = 0


class IncrementalState:
    """The manager's memory of the previous committed save's pieces (survives across saves).

    Args:
        delta: write deltas against the previous save.
        max_chain: a save is written without new deltas at least every ``max_chain`` saves (>= 1; 1 = never
            a delta).
        delta_op: ``"sub"`` or ``"xor"``.
    """

    def __init__(self, *, delta: bool, max_chain: int, delta_op: str = DELTA_OPS_DEFAULT) -> None:
        if max_chain < 1:
            raise ValueError(f"max_chain must be >= 1, got {max_chain}")
        self.delta = delta
        self.max_chain = max_chain
        self.delta_op = delta_op
        self.prev: dict[PieceKey, Piece] = {}
        self.saves = 0  # committed saves seen (the full-save cadence counts them)
        self._lock = threading.Lock()

    def begin(self, *, compress: bool) -> SaveEncoder:
        full = self.saves % self.max_chain == 0
        return SaveEncoder(self, compress=compress, allow_delta=self.delta and compress and not full)

    def committed(self, enc: SaveEncoder) -> None:
        """The save of ``enc`` committed: its pieces are the next save's bases."""
        with self._lock:
            self.prev = enc.pieces
            self.saves += 1

    def forget(self) -> None:
        """Drop the memory (after a restore: the next save starts a fresh chain)."""
        with self._lock:
            self.prev = {}
            self.saves = 0


@dataclass
class SaveEncoder:
    """Encoding of one save's pieces (thread-safe: the writer's threads call :meth:`put_piece`)."""

    state: IncrementalState
    compress: bool
    allow_delta: bool
    pieces: dict[PieceKey, Piece] = field(default_factory=dict)
    stats: EncodeStats = field(default_factory=EncodeStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put_piece(
        self,
        store: ChunkStore,
        staging: str,
        key: PieceKey | None,
        view: memoryview,
        itemsize: int,
        step: int,
    ) -> tuple[tuple[ChunkRecord, ...], bool]:
        """Store one piece. Returns ``(chain, written)``: the chunk holding it followed by its chain of bases
        (all pinned in ``store``; the caller unpins them after the commit), and whether a chunk was written."""
        raw_hash = xxhash.xxh3_128_hexdigest(view) if key is not None else ""
        prev = self.state.prev.get(key) if key is not None else None
        if key is not None and prev is not None and prev.raw_hash == raw_hash and len(prev.chain):
            if self._reuse(store, prev):
                self._remember(key, Piece(raw_hash, prev.chain, prev.data), reused=True)
                return prev.chain, False
            head = prev.chain[0]
            if head.base is None:  # damaged or gone: written anew the same way, which repairs older saves
                stored = view if head.codec == "raw" else compress(view, itemsize)
                enc = None if head.codec == "raw" else Encoding(head.codec, len(view))
                rec, written = store.put(stored, staging, step=step, encoding=enc, raw_hash=raw_hash)
                assert key is not None
                self._remember(key, Piece(raw_hash, (rec,), self._copy(view)))
                return (rec,), written
        if not self.compress:
            rec, written = store.put(view, staging, step=step, raw_hash=raw_hash)
            if key is not None:
                self._remember(key, Piece(raw_hash, (rec,), self._copy(view)))
            return (rec,), written
        t0 = time.perf_counter()
        stored, enc = compress(view, itemsize), Encoding("blosc2", len(view))
        chain_tail: tuple[ChunkRecord, ...] = ()
        use_delta = (
            self.allow_delta
            and prev is not None
            and prev.data is not None
            and prev.data.nbytes == len(view)
            and prev.depth + 1 < self.state.max_chain
        )
        if use_delta:
            assert prev is not None and prev.data is not None
            word = delta_word(itemsize)
            d = delta_encode(view, prev.data.data, self.state.delta_op, word)
            dstored = compress(d.data.cast("B"), word)
            # the base chain must still be intact on storage (pinned from here on while it is used)
            if len(dstored) < len(stored) and self._reuse(store, prev):
                stored = dstored
                enc = Encoding("blosc2", len(view), prev.chain[0].hash, self.state.delta_op, word)
                chain_tail = prev.chain
        dt = time.perf_counter() - t0
        try:
            rec, written = store.put(stored, staging, step=step, encoding=enc)
        except BaseException:
            if chain_tail:
                store.unpin(r.hash for r in chain_tail)
            raise
        chain = (rec, *chain_tail)
        with self._lock:
            self.stats.raw_bytes += len(view)
            self.stats.stored_bytes += len(stored)
            self.stats.encode_s += dt
            self.stats.deltas += bool(chain_tail)
        if key is not None:
            self._remember(key, Piece(raw_hash, chain, self._copy(view)))
        return chain, written

    def _reuse(self, store: ChunkStore, prev: Piece) -> bool:
        """Pin the previous chunk of an unchanged piece and its bases; False when one is not intact."""
        pinned: list[str] = []
        for r in prev.chain:
            if not store.reuse(r):
                store.unpin(pinned)
                return False
            pinned.append(r.hash)
        return True

    def _copy(self, view: memoryview) -> np.ndarray | None:
        if not self.state.delta:
            return None
        return np.frombuffer(view, dtype=np.uint8).copy()

    def _remember(self, key: PieceKey, piece: Piece, *, reused: bool = False) -> None:
        with self._lock:
            self.pieces[key] = piece
            self.stats.reused += reused


def read_decoded(
    store: ChunkStore,
    chunks: dict[str, ChunkRecord],
    rec: ChunkRecord,
    out: memoryview | None = None,
    *,
    step: int | None = None,
    owners: list[str] | None = None,
) -> memoryview:
    """Read chunk ``rec`` and every delta base it needs (each CRC32C-checked), decode, and return its decoded
    bytes (in ``out`` when given: exactly ``rec.decoded_size`` bytes).

    Memory: ``out`` plus one buffer of the same size, whatever the chain's length (the manifest parser
    bounded every size by the tensor bytes it declares, and chains by ``MAX_DELTA_CHAIN``).

    Raises:
        CorruptCheckpointError: a chunk of the chain is missing, fails its CRC32C, or does not decode to the
            size its record declares (naming that chunk: a corrupt base condemns every checkpoint using it).
    """
    size = rec.decoded_size
    if out is None:
        out = memoryview(bytearray(size))
    out = out.cast("B") if out.format != "B" else out
    if not rec.encoded:
        store.readinto(rec, out, step=step, owners=owners)
        return out
    chain = [rec]
    while chain[-1].base is not None:
        chain.append(chunks[chain[-1].base])  # the parser checked the chain: present, same size, bounded
    tmp = memoryview(bytearray(size)) if len(chain) > 1 else None
    for i, link in enumerate(reversed(chain)):
        dest = out if i == 0 else tmp
        assert dest is not None
        _decode_one(store, link, dest, step, owners)
        if i > 0:
            assert link.delta is not None
            try:
                delta_decode_inplace(dest, out, link.delta, link.word)
            except CodecError as e:
                raise _undecodable(link, e, step, owners) from None
            out[:] = dest
    return out


def _decode_one(
    store: ChunkStore, rec: ChunkRecord, dest: memoryview, step: int | None, owners: list[str] | None
) -> None:
    """Stage one of decoding (codec only) into ``dest``."""
    if rec.codec == "raw":
        if rec.length != len(dest):
            raise _undecodable(rec, CodecError(f"{rec.length} raw bytes, {len(dest)} declared"), step, owners)
        store.readinto(rec, dest, step=step, owners=owners)
        return
    stored = store.read(rec, step=step, owners=owners)
    try:
        decompress_into(memoryview(stored), dest)
    except CodecError as e:
        raise _undecodable(rec, e, step, owners) from None


def _undecodable(
    rec: ChunkRecord, e: Exception, step: int | None, owners: list[str] | None
) -> CorruptCheckpointError:
    where = f" of step {step}" if step is not None else ""
    return CorruptCheckpointError(
        f"chunk {rec.path}{where} does not decode ({e})",
        step=step,
        chunk=rec.path,
        tensors=owners,
        damaged=True,
    )


def chunk_info(chain: tuple[ChunkRecord, ...], written: bool) -> dict[str, dict[str, Any]]:
    """The write result's ``chunks`` entries for a piece: its chunk (``new`` when this save wrote it) and its
    chain of bases (:func:`trainguard.distributed.manifest.build_manifest` turns them into records)."""
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(chain):
        d: dict[str, Any] = {"length": r.length, "crc32c": r.crc32c, "codec": r.codec}
        if r.encoded:
            d["size"] = r.decoded_size
        if r.base is not None:
            d.update(base=r.base, delta=r.delta, word=r.word)
        if i == 0 and written:
            d["new"] = True
        out[r.hash] = d
    return out
