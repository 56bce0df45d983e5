"""Lossless chunk codecs: byte shuffle + zstd (blosc2) and deltas against a base chunk (torch-free).

A chunk's stored bytes decode in two stages, both recorded in its :class:`~trainguard.format.ChunkRecord`:

1. ``codec``: ``"raw"`` (stored as is) or ``"blosc2"`` (a blosc2 frame: byte shuffle of ``typesize``-byte
   words + zstd level 1, the stored bytes self-describe their filters);
2. ``delta`` (optional): ``"xor"`` or ``"sub"`` against the decoded bytes of the ``base`` chunk, applied to
   little-endian unsigned words of ``word`` bytes (``sub``: the stored words are ``cur - base`` modulo
   2**(8*word); ``xor``: ``cur ^ base``). A delta chunk and its base have the same decoded size.

Why blosc2: measured on this machine (benchmarks/RESULTS.md, one core, real MiniLM fp32 weights) its shuffle +
zstd-1 compresses as well as byte planes by hand with numpy + python-zstandard (0.831 vs 0.829 of the raw
size), encodes faster (733 vs 611 MB/s) and decodes 3.5x faster (2.8 vs 0.8 GB/s); numcodecs 0.16's Blosc (C-Blosc
1) compressed like plain zstd (0.913) at lower speed.

Decoding is bounded by what the manifest declares: the blosc2 header's decoded size must equal the record's
``size`` (itself bounded by the tensor bytes the manifest declares), and decoding writes into a buffer of
exactly that size, so a hostile frame cannot make restore allocate more.

``blosc2`` is imported by :func:`load_library` (a manager's first save with compression on, or the first
:func:`compress` or :func:`decompress_into`), not with this module: it pulls
httpx, rich, click and threadpoolctl, 0.2-0.3 s of CPU that every relaunch paid in ``import trainguard``
although a restore of uncompressed chunks never decodes a frame (benchmarks/RESULTS.md, "Time to resume").
"""

from __future__ import annotations

import importlib
import random
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

CODECS = ("raw", "blosc2")
DELTA_OPS = ("xor", "sub")
WORD_SIZES = (1, 2, 4, 8)
MAX_TYPESIZE = 255  # blosc2's limit on the shuffle word
BLOSC2_MAX_BYTES = (1 << 31) - 64  # one blosc2 frame holds less than 2 GiB


_IMPORT_LOCK = threading.Lock()
_GIL_RELEASED = False  # blosc2.set_releasegil(True) done (see load_library)


def load_library() -> Any:
    """Import ``blosc2`` now (once per process; see the module notes) and return it, leaving Python's global
    ``random`` state as it was: rich, which blosc2 pulls in through httpx, draws ``getrandbits(24)`` at import,
    which would shift the training job's ``random`` stream and break a bit-exact resume. Call it from the
    thread that runs the training loop (a save's caller does at the first save with compression on): an import
    in a background thread, restoring the state, could undo the draws the training thread made meanwhile.

    It also sets ``blosc2.set_releasegil(True)`` (process-wide): blosc2 then encodes and decodes without
    holding the GIL, so the training thread runs beside an async save's compression, and the reading and
    writing threads encode and decode chunks in parallel."""
    global _GIL_RELEASED
    mod: Any = sys.modules.get("blosc2")
    if mod is not None and _GIL_RELEASED:
        return mod
    with _IMPORT_LOCK:
        if mod is None:
            state = random.getstate()
            try:
                mod = importlib.import_module("blosc2")
            finally:
                random.setstate(state)
        if not _GIL_RELEASED:
            # blosc2 holds the GIL while it compresses or decompresses unless told otherwise (its default): an
            # async save's encoding in the background would then stop the training thread for the whole
            # encode (0.45 s per save of a 230 MB state, seen with py-spy --gil), and the writer and reader
            # threads would encode one at a time. Our frames are whole chunks (MiBs), the case blosc2 documents
            # releasing the GIL for. Process-wide: it also applies to the caller's own blosc2 calls.
            mod.set_releasegil(True)
            _GIL_RELEASED = True
    return mod


class CodecError(ValueError):
    """Stored bytes that do not decode to what their record declares (the caller reports it as corruption)."""


@dataclass(frozen=True)
class Encoding:
    """How one chunk's stored bytes decode: ``codec``, ``size`` (decoded bytes), and for a delta its ``base``
    (chunk hash), ``delta`` op and ``word`` size in bytes."""

    codec: str = "raw"
    size: int = 0
    base: str | None = None
    delta: str | None = None
    word: int = 0

    def recipe(self) -> bytes:
        """Canonical bytes of the decoding recipe (part of a chunk's name, so one name means one content)."""
        if self.codec == "raw" and self.base is None:
            return b""
        return f"|{self.codec}|{self.size}|{self.base or ''}|{self.delta or ''}|{self.word}".encode()


def compress(view: memoryview | bytes, typesize: int) -> bytes:
    """Shuffle ``typesize``-byte words and compress with zstd level 1 (one thread: the writer's threads run
    chunks in parallel).

    Args:
        view: the bytes to compress (at most ``BLOSC2_MAX_BYTES``).
        typesize: bytes per element (1..255), e.g. 4 for float32.

    Returns:
        a blosc2 frame.
    """
    blosc2 = load_library()
    typesize = min(max(int(typesize), 1), MAX_TYPESIZE)
    src = np.frombuffer(view, dtype=np.uint8)
    if src.nbytes > BLOSC2_MAX_BYTES:
        raise ValueError(f"a compressed chunk holds at most {BLOSC2_MAX_BYTES} bytes, got {src.nbytes}")
    return bytes(
        blosc2.compress2(
            src,
            codec=blosc2.Codec.ZSTD,
            clevel=1,
            filters=[blosc2.Filter.SHUFFLE],
            typesize=typesize,
            nthreads=1,
        )
    )


def decompress_into(stored: memoryview | bytes, out: memoryview) -> None:
    """Decode a blosc2 frame into ``out`` (exactly its declared size).

    Raises:
        CodecError: the frame is malformed or declares another size than ``out``'s.
    """
    blosc2 = load_library()
    out = out.cast("B") if out.format != "B" else out
    src = bytes(stored) if not isinstance(stored, bytes) else stored
    try:
        nbytes, _cbytes, _block = blosc2.get_cbuffer_sizes(src)
    except Exception as e:  # noqa: BLE001 - any parse failure of stored bytes is a codec error
        raise CodecError(f"not a blosc2 frame ({e})") from None
    if nbytes != len(out):
        raise CodecError(f"blosc2 frame declares {nbytes} decoded bytes, the manifest {len(out)}")
    if nbytes == 0:
        return
    dst = np.frombuffer(out, dtype=np.uint8)
    try:
        n = blosc2.decompress2(src, dst=dst)
    except Exception as e:  # noqa: BLE001
        raise CodecError(f"blosc2 frame does not decode ({e})") from None
    if n is not None and not isinstance(n, (bytes, bytearray)) and int(n) != nbytes:
        raise CodecError(f"blosc2 frame decoded to {n} bytes, expected {nbytes}")


def _words(buf: memoryview | bytes | bytearray | np.ndarray, word: int) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8)
    if word > 1 and a.nbytes % word == 0:
        return a.view(np.dtype(f"<u{word}"))
    return a


def delta_encode(cur: memoryview | bytes, base: memoryview | bytes, op: str, word: int) -> np.ndarray:
    """``cur - base`` (mod 2**(8*word), word-wise) or ``cur ^ base``; a new array of ``len(cur)`` bytes.

    Raises:
        ValueError: different lengths or an unknown op.
    """
    if len(cur) != len(base):
        raise ValueError(f"a delta needs equal lengths, got {len(cur)} and {len(base)}")
    c, b = _words(cur, word), _words(base, word)
    if op == "xor":
        return np.bitwise_xor(c, b)
    if op == "sub":
        return np.subtract(c, b)  # unsigned: wraps modulo 2**(8*word)
    raise ValueError(f"unknown delta op {op!r}; expected one of {DELTA_OPS}")


def delta_decode_inplace(
    delta_out: memoryview, base: memoryview | bytes | bytearray, op: str, word: int
) -> None:
    """Turn ``delta_out`` (holding a decoded delta) into the chunk's bytes, in place: ``+ base`` or ``^ base``."""
    d = _words(np.frombuffer(delta_out.cast("B") if delta_out.format != "B" else delta_out, np.uint8), word)
    b = _words(base, word)
    if d.nbytes != b.nbytes:
        raise CodecError(f"a delta of {d.nbytes} bytes has a base of {b.nbytes} bytes")
    if op == "xor":
        np.bitwise_xor(d, b, out=d)
    elif op == "sub":
        np.add(d, b, out=d)
    else:
        raise CodecError(f"unknown delta op {op!r}")
