"""Manifest records and their JSON form (format version 1; docs/FORMAT.md is the contract).

A manifest describes one committed checkpoint: every state entry (tensor or value) by fully qualified name
(FQN), the path that rebuilds the nested state, and for tensors the dtype, global shape and each saved shard's
global offsets and sizes (as DCP's metadata does, so a later load can reshard). Tensor bytes and large values
live in content-addressed chunks; every chunk has its length, CRC32C and codec in the manifest. The manifest
carries a CRC32C of its own canonical JSON so a flipped bit in it is detected too.

Parsing is defensive: any wrong type, absurd length or unsafe path raises CorruptCheckpointError /
UnsafeCheckpointError, never an arbitrary exception.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc32c

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .bounds import (
    LEGACY_CHUNK_SIZES,
    MAX_PATH_DEPTH,
    check_chunk_coverage,
    check_shard_segments,
    check_tiling,
)
from .layout import MAX_STEP, LinkCheck, chunk_relpath, validate_relpath
from .run import RunInfo, run_from_json

FORMAT_VERSION = 1
PER_RANK_FORMAT_VERSION = (
    2  # written only by manifests holding per-rank entries (a v1 reader would misread them)
)
ENCODED_FORMAT_VERSION = (
    3  # written only by manifests holding compressed or delta chunks (and per-rank entries)
)
SUPPORTED_VERSIONS = (FORMAT_VERSION, PER_RANK_FORMAT_VERSION, ENCODED_FORMAT_VERSION)
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,40}")
MAX_CHUNK_BYTES = 1 << 40  # 1 TiB: anything larger in a manifest is corrupt or malicious
MAX_NDIM = 64
CODECS = ("raw", "blosc2")  # trainguard.incremental.codecs decodes them
DELTA_OPS = ("xor", "sub")
DELTA_WORDS = (1, 2, 4, 8)
MAX_DELTA_CHAIN = 64  # a chunk's chain of delta bases is at most this deep (a save writes at most max_chain)
VALUE_CODECS = ("json", "torch")

# dtype names on disk <-> torch dtypes are resolved in trainguard.state.dtypes (this module stays torch-free).
# Bytes per element of the dtypes whose size is known here; shards of these are checked against their bytes.
DTYPE_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk file: ``path`` relative to the run root, stored ``length`` in bytes, ``crc32c`` of the stored
    bytes (unsigned 32-bit), ``codec`` used to store it ("raw" or "blosc2", format version 3).

    Format version 3 adds, for encoded chunks: ``size``, the decoded bytes (segments address decoded bytes;
    None for raw chunks: ``length``), and for a delta chunk its ``base`` (the hash of the chunk whose decoded
    bytes the delta applies to, listed in the same manifest), the ``delta`` op ("xor" or "sub") and the
    ``word`` size in bytes it works on (:mod:`trainguard.incremental.codecs`)."""

    hash: str
    path: str
    length: int
    crc32c: int
    codec: str = "raw"
    size: int | None = None
    base: str | None = None
    delta: str | None = None
    word: int = 0

    @property
    def decoded_size(self) -> int:
        """Bytes the chunk holds once decoded (what segments address)."""
        return self.length if self.size is None else self.size

    @property
    def encoded(self) -> bool:
        """True for a compressed or delta chunk (format version 3)."""
        return self.codec != "raw" or self.base is not None or self.size is not None


@dataclass(frozen=True)
class Segment:
    """A byte range ``[offset, offset + length)`` of the chunk with content hash ``chunk``."""

    chunk: str
    offset: int
    length: int


@dataclass(frozen=True)
class ShardRecord:
    """One saved shard of a tensor: global ``offsets`` and ``sizes`` (elements per dim), and the segments
    that hold its bytes, in order (C-contiguous, native little-endian)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)


@dataclass(frozen=True)
class TensorEntry:
    """A tensor in the state: ``dtype`` name (e.g. "bfloat16"), global ``shape``, and its shards.

    ``rank`` is set on a per-rank entry: the value of ``path`` saved by that rank (ranks held different values
    under one key); None for an entry shared by every rank (sharded or replicated)."""

    fqn: str
    path: tuple[Any, ...]
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardRecord, ...]
    rank: int | None = None
    kind: str = field(default="tensor", init=False)


@dataclass(frozen=True)
class ValueEntry:
    """A non-tensor value: inline JSON (``value``) or bytes in ``segments`` decoded by ``codec``
    ("json", or "torch" = ``torch.load(weights_only=True)``). ``rank``: as for :class:`TensorEntry`."""

    fqn: str
    path: tuple[Any, ...]
    codec: str
    value: Any = None
    segments: tuple[Segment, ...] | None = None
    rank: int | None = None
    kind: str = field(default="value", init=False)


Entry = TensorEntry | ValueEntry


@dataclass
class Manifest:
    """A committed checkpoint. ``t`` is seconds since the epoch; ``bytes`` the total of referenced chunk bytes."""

    step: int
    t: float
    time: str
    world_size: int
    entries: dict[str, Entry]
    chunks: dict[str, ChunkRecord]
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    top_level: dict[str, dict[str, Any]] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    run: RunInfo | None = None
    chunk_sizes: tuple[int, ...] | None = None
    """Split sizes in bytes (``chunk_size_bytes``) the writers cut large tensors with; None: not recorded (a
    manifest written before trainguard recorded it, read as the default 64 MiB)."""

    new_bytes: int | None = None  # stored bytes the save that wrote it added (fixed at save time)

    @property
    def bytes(self) -> int:
        """Stored bytes of every chunk it references (delta bases included)."""
        return sum(c.length for c in self.chunks.values())

    @property
    def logical_bytes(self) -> int:
        """Bytes of its tensors and stored values as in memory (inline JSON values not counted)."""
        total = 0
        for e in self.entries.values():
            if isinstance(e, TensorEntry):
                total += sum(sh.nbytes for sh in e.shards)
            elif e.segments:
                total += sum(s.length for s in e.segments)
        return total

    def chunk_owners(self) -> dict[str, list[str]]:
        """Map chunk hash -> FQNs of the entries with bytes in it."""
        owners: dict[str, dict[str, None]] = {h: {} for h in self.chunks}  # ordered sets: one packed chunk
        for e in self.entries.values():  # can hold thousands of entries (a list's `in` made this quadratic)
            segs: list[Segment] = []
            if isinstance(e, TensorEntry):
                for sh in e.shards:
                    segs.extend(sh.segments)
            elif e.segments:
                segs.extend(e.segments)
            for s in segs:
                owners.setdefault(s.chunk, {})[e.fqn] = None
        return {h: list(names) for h, names in owners.items()}


# ----------------------------------------------------------------------------------------------------------
# path elements: how a leaf's position in the nested state is written ("s": str key, "i": int key,
# "l": list index, "t": tuple index)
PATH_TAGS = ("s", "i", "l", "t")


def _seg_to_json(s: Segment) -> list[Any]:
    return [s.chunk, s.offset, s.length]


def _entry_to_json(e: Entry) -> dict[str, Any]:
    d = _entry_body(e)
    if e.rank is not None:
        d["rank"] = e.rank
    return d


def _entry_body(e: Entry) -> dict[str, Any]:
    if isinstance(e, TensorEntry):
        return {
            "kind": "tensor",
            "path": [list(p) for p in e.path],
            "dtype": e.dtype,
            "shape": list(e.shape),
            "shards": [
                {
                    "offsets": list(s.offsets),
                    "sizes": list(s.sizes),
                    "segments": [_seg_to_json(x) for x in s.segments],
                }
                for s in e.shards
            ],
        }
    d: dict[str, Any] = {"kind": "value", "path": [list(p) for p in e.path], "codec": e.codec}
    if e.segments is None:
        d["value"] = e.value
    else:
        d["segments"] = [_seg_to_json(x) for x in e.segments]
    return d


def _chunk_to_json(c: ChunkRecord) -> dict[str, Any]:
    d: dict[str, Any] = {"path": c.path, "length": c.length, "crc32c": c.crc32c, "codec": c.codec}
    if c.encoded:
        d["size"] = c.decoded_size
    if c.base is not None:
        d.update(base=c.base, delta=c.delta, word=c.word)
    return d


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def manifest_to_json(m: Manifest) -> bytes:
    """Serialize to UTF-8 JSON bytes with a ``crc32c`` field over the canonical form of everything else."""
    per_rank = any(e.rank is not None for e in m.entries.values())
    encoded = any(c.encoded for c in m.chunks.values())
    version = ENCODED_FORMAT_VERSION if encoded else PER_RANK_FORMAT_VERSION if per_rank else m.format_version
    body: dict[str, Any] = {
        "format_version": version,
        "step": m.step,
        "t": m.t,
        "time": m.time,
        "world_size": m.world_size,
        "metrics": _jsonable(m.metrics),
        "metadata": _jsonable(m.metadata),
        "top_level": m.top_level,
        "chunks": {h: _chunk_to_json(c) for h, c in m.chunks.items()},
        "entries": {fqn: _entry_to_json(e) for fqn, e in m.entries.items()},
    }
    if m.new_bytes is not None:
        body["new_bytes"] = m.new_bytes
    if m.run is not None:
        body["run"] = m.run.to_json()
    if m.chunk_sizes is not None:
        body["chunk_sizes"] = list(m.chunk_sizes)
    # Encoded once: the canonical form is the sorted members joined; the output is the same with the
    # ``crc32c`` member inserted at its sorted place (byte-identical to encoding the dict with the field).
    members = [
        _members({k: v for k, v in body.items() if k < "crc32c"}),
        "",
        _members({k: v for k, v in body.items() if k > "crc32c"}),
    ]
    crc = _crc32c.crc32c(("{" + ",".join(x for x in members if x) + "}").encode())
    members[1] = f'"crc32c":{crc}'
    return ("{" + ",".join(x for x in members if x) + "}").encode()


def _members(obj: dict[str, Any]) -> str:
    """The canonical JSON of ``obj`` without its braces (empty for an empty dict)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)[1:-1]


def _jsonable(x: Any) -> Any:
    """Metrics and user metadata: floats that are NaN/Inf become strings, unknown objects become repr."""
    if isinstance(x, float):
        return x if math.isfinite(x) else repr(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    item = getattr(x, "item", None)  # 0-dim tensors and numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except Exception:  # noqa: BLE001 - metadata is best effort, the save must not fail on it
            pass
    return repr(x)


# ----------------------------------------------------------------------------------------------------------
def _bad(msg: str, step: int | None = None) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"corrupt manifest: {msg}", step=step)


def _int(x: Any, what: str, lo: int = 0, hi: int = MAX_CHUNK_BYTES) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise _bad(f"{what} must be an integer, got {type(x).__name__}")
    if not lo <= x <= hi:
        raise _bad(f"{what}={x} is out of range [{lo}, {hi}]")
    return x


def _seg(x: Any, chunks: dict[str, ChunkRecord], what: str) -> Segment:
    if not isinstance(x, list) or len(x) != 3 or not isinstance(x[0], str):
        raise _bad(f"{what}: a segment must be [chunk, offset, length]")
    c = chunks.get(x[0])
    if c is None:
        raise _bad(f"{what}: segment names chunk {x[0]!r} that is not in the chunk table")
    off = _int(x[1], f"{what} offset")
    ln = _int(x[2], f"{what} length")
    if off + ln > c.decoded_size:
        raise _bad(
            f"{what}: segment [{off}, {off + ln}) runs past the end of chunk {x[0]} ({c.decoded_size} bytes)"
        )
    return Segment(x[0], off, ln)


def _path(x: Any, what: str) -> tuple[Any, ...]:
    if not isinstance(x, list) or not x:
        raise _bad(f"{what}: path must be a non-empty list")
    if len(x) > MAX_PATH_DEPTH:
        raise _bad(f"{what}: path is {len(x)} levels deep, more than the {MAX_PATH_DEPTH} a save writes")
    out = []
    for el in x:
        if not isinstance(el, list) or len(el) != 2 or el[0] not in PATH_TAGS:
            raise _bad(f"{what}: bad path element {el!r}")
        tag, v = el
        if tag == "s" and not isinstance(v, str):
            raise _bad(f"{what}: path key must be a string")
        if tag == "i":  # a dict's int key: any signed 64-bit value (flatten refuses others at save)
            _int(v, f"{what} path int key", -(1 << 63), (1 << 63) - 1)
        elif tag != "s":  # a list or tuple index
            _int(v, f"{what} path index", 0, 1 << 40)
        out.append((tag, v))
    return tuple(out)


def _encoding(c: dict[str, Any], h: str, version: int, step: int | None) -> tuple[Any, ...]:
    """``(size, base, delta, word)`` of a chunk entry (format version 3 fields; absent for raw chunks)."""
    size = _int(c["size"], f"chunk {h} size") if "size" in c else None
    base = c.get("base")
    if base is None:
        if c.get("codec") != "raw" and size is None:
            raise _bad(f"chunk {h}: an encoded chunk must declare its decoded size", step)
        return size, None, None, 0
    if not isinstance(base, str) or base == h:
        raise _bad(f"chunk {h}: bad delta base {str(base)[:60]!r}", step)
    chunk_relpath(base)  # validates the hash
    delta, word = c.get("delta"), c.get("word")
    if delta not in DELTA_OPS:
        raise _bad(f"chunk {h}: unknown delta op {delta!r}", step)
    if word not in DELTA_WORDS or isinstance(word, bool):
        raise _bad(f"chunk {h}: delta word must be one of {DELTA_WORDS}, got {word!r}", step)
    if size is None:
        raise _bad(f"chunk {h}: a delta chunk must declare its decoded size", step)
    return size, base, delta, word


def _check_delta_chains(chunks: dict[str, ChunkRecord], step: int | None) -> None:
    """Every delta base is in the chunk table with the same decoded size; chains end within
    ``MAX_DELTA_CHAIN`` links (no cycle)."""
    for h, c in chunks.items():
        depth = 0
        cur = c
        while cur.base is not None:
            base = chunks.get(cur.base)
            if base is None:
                raise _bad(f"chunk {cur.hash} has delta base {cur.base} that is not in the chunk table", step)
            if base.decoded_size != cur.decoded_size:
                raise _bad(
                    f"chunk {cur.hash} ({cur.decoded_size} bytes) has a delta base of {base.decoded_size} bytes",
                    step,
                )
            depth += 1
            if depth > MAX_DELTA_CHAIN:
                raise _bad(f"chunk {h}: delta chain longer than {MAX_DELTA_CHAIN} (or a cycle)", step)
            cur = base


def manifest_from_json(data: bytes, *, root: str | None = None, expect_step: int | None = None) -> Manifest:
    """Parse and validate manifest bytes.

    Args:
        data: the manifest file's bytes.
        root: the run root; when given, chunk paths are also checked not to resolve outside it.
        expect_step: the step the directory name says; a mismatch is corruption.

    Raises:
        CorruptCheckpointError: bad JSON, a wrong type or range, a CRC32C mismatch.
        UnsafeCheckpointError: a chunk path that is absolute, has ``..``, or escapes the root.
    """
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, huge ints, deep nesting
        raise _bad(f"not valid JSON ({str(e)[:200]})", expect_step) from None
    if not isinstance(body, dict):
        raise _bad("top level is not an object", expect_step)
    version = body.get("format_version")
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        raise CorruptCheckpointError(
            f"manifest format_version {version!r} is not supported by this trainguard (reads "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}); "
            "upgrade trainguard to read it",
            step=expect_step,
        )
    crc = body.pop("crc32c", None)
    try:
        actual = _crc32c.crc32c(_canonical(body))
    except (TypeError, ValueError) as e:
        raise _bad(f"unserializable content ({e})", expect_step) from None
    if crc != actual:
        raise _bad(f"manifest CRC32C mismatch (stored {crc!r}, computed {actual})", expect_step)
    step = _int(body.get("step"), "step", 0, MAX_STEP)
    if expect_step is not None and step != expect_step:
        raise _bad(f"manifest says step {step} but lives in the directory of step {expect_step}", expect_step)
    chunk_sizes = _chunk_sizes(body.get("chunk_sizes"), step)
    chunks: dict[str, ChunkRecord] = {}
    raw_chunks = body.get("chunks")
    if not isinstance(raw_chunks, dict):
        raise _bad("chunks must be an object", step)
    for h, c in raw_chunks.items():
        if not isinstance(c, dict):
            raise _bad(f"chunk {h!r} must be an object", step)
        expected_path = chunk_relpath(h)  # validates the hash itself
        path = validate_relpath(c.get("path"))  # type: ignore[arg-type]  # the spelling; links: below
        if path != expected_path:
            raise UnsafeCheckpointError(
                f"chunk {h} has path {path!r}; content-addressed chunks live at {expected_path!r}"
            )
        codec = c.get("codec")
        if codec not in CODECS:
            raise _bad(f"chunk {h} has unknown codec {codec!r}", step)
        rec = ChunkRecord(
            h,
            path,
            _int(c.get("length"), f"chunk {h} length"),
            _int(c.get("crc32c"), f"chunk {h} crc32c", 0, 0xFFFFFFFF),
            codec,
            *_encoding(c, h, version, step),
        )
        if rec.encoded and version < ENCODED_FORMAT_VERSION:
            raise _bad(f"chunk {h}: a {codec} chunk needs format_version {ENCODED_FORMAT_VERSION}", step)
        chunks[h] = rec
    links = LinkCheck(root, [c.path for c in chunks.values()])  # looks the files up while the entries parse
    try:
        _check_delta_chains(chunks, step)
        entries = _entries(body, chunks, version, chunk_sizes, step)
    finally:
        links.join()  # every path's verdict, also when the entries were refused first
    links.raise_first()
    t = body.get("t")
    try:
        t_ok = not isinstance(t, bool) and isinstance(t, (int, float)) and math.isfinite(float(t))
    except OverflowError:
        t_ok = False
    if not t_ok:
        raise _bad("t must be a finite number", step)
    ws = _int(body.get("world_size"), "world_size", 1, 1 << 24)
    metrics = body.get("metrics") or {}
    metadata = body.get("metadata") or {}
    top = body.get("top_level") or {}
    if not isinstance(metrics, dict) or not isinstance(metadata, dict) or not isinstance(top, dict):
        raise _bad("metrics, metadata and top_level must be objects", step)
    check_chunk_coverage(
        chunks,
        (
            seg
            for e in entries.values()
            for seg in (
                [x for sh in e.shards for x in sh.segments]
                if isinstance(e, TensorEntry)
                else list(e.segments or ())
            )
        ),
        step,
    )
    return Manifest(
        step=step,
        t=float(t),  # type: ignore[arg-type]
        time=str(body.get("time", "")),
        world_size=ws,
        entries=entries,
        chunks=chunks,
        metrics=metrics,
        metadata=metadata,
        top_level=top,
        format_version=version,
        run=run_from_json(body.get("run"), step),
        new_bytes=_int(body["new_bytes"], "new_bytes", 0, 1 << 62) if "new_bytes" in body else None,
        chunk_sizes=chunk_sizes,
    )


def _entries(
    body: dict[str, Any],
    chunks: dict[str, ChunkRecord],
    version: int,
    chunk_sizes: tuple[int, ...] | None,
    step: int,
) -> dict[str, Entry]:
    """The checked entries of a manifest body whose chunk table ``chunks`` is already checked."""
    entries: dict[str, Entry] = {}
    raw_entries = body.get("entries")
    if not isinstance(raw_entries, dict):
        raise _bad("entries must be an object", step)
    for fqn, raw in raw_entries.items():
        if not isinstance(raw, dict):
            raise _bad(f"entry {fqn!r} must be an object", step)
        epath = _path(raw.get("path"), fqn)
        erank = raw.get("rank")
        if erank is not None:
            if version < PER_RANK_FORMAT_VERSION:
                raise _bad(f"{fqn}: a per-rank entry needs format_version {PER_RANK_FORMAT_VERSION}", step)
            erank = _int(erank, f"{fqn} rank", 0, 1 << 24)
        # the name is the path's keys joined with '.' (+ "@rank<r>"): a restore matches entries by name and
        # rebuilds containers by path, so the name is taken from the path. A stored name that differs comes
        # from a save before names showed a str/int subclass key by its value (an Enum key saved as
        # "stats.Phase.TRAIN" with path key "train") or from an edited file; either way the path decides.
        # The state's top-level keys are strings.
        if epath[0][0] != "s":
            raise _bad(f"{fqn}: a path starts with a top-level state key (tag 's')", step)
        name = ".".join(str(k) for _, k in epath) + ("" if erank is None else f"@rank{erank}")
        if name in entries:
            raise _bad(f"two entries have paths that name {name[:200]!r}", step)
        fqn = name
        kind = raw.get("kind")
        if kind == "tensor":
            dtype = raw.get("dtype")
            if not isinstance(dtype, str) or not _DTYPE_RE.fullmatch(dtype):
                raise _bad(f"{fqn}: unknown dtype {str(dtype)[:60]!r} (not a dtype name)", step)
            shape_raw = raw.get("shape")
            if not isinstance(shape_raw, list) or len(shape_raw) > MAX_NDIM:
                raise _bad(f"{fqn}: shape must be a list of at most {MAX_NDIM} ints", step)
            shape = tuple(_int(s, f"{fqn} shape", 0, 1 << 48) for s in shape_raw)
            shards = []
            raw_shards = raw.get("shards")
            if not isinstance(raw_shards, list):
                raise _bad(f"{fqn}: shards must be a list", step)
            for sh in raw_shards:
                if not isinstance(sh, dict):
                    raise _bad(f"{fqn}: shard must be an object", step)
                offs, sizes = sh.get("offsets"), sh.get("sizes")
                if (
                    not isinstance(offs, list)
                    or not isinstance(sizes, list)
                    or len(offs) != len(shape)
                    or len(sizes) != len(shape)
                ):
                    raise _bad(f"{fqn}: shard offsets/sizes must be lists of {len(shape)} ints", step)
                o = tuple(_int(v, f"{fqn} offset", 0, 1 << 48) for v in offs)
                z = tuple(_int(v, f"{fqn} size", 0, 1 << 48) for v in sizes)
                if any(a + b > s for a, b, s in zip(o, z, shape, strict=False)):
                    raise _bad(f"{fqn}: shard {o}+{z} lies outside the shape {shape}", step)
                segs_raw = sh.get("segments")
                if not isinstance(segs_raw, list):
                    raise _bad(f"{fqn}: segments must be a list", step)
                segs = tuple(_seg(s, chunks, fqn) for s in segs_raw)
                shard = ShardRecord(o, z, segs)
                itemsize = DTYPE_ITEMSIZE.get(dtype)
                if itemsize is not None and shard.nbytes != math.prod(z) * itemsize:
                    raise _bad(
                        f"{fqn}: shard {o} holds {shard.nbytes} bytes but {z} x {dtype} needs "
                        f"{math.prod(z) * itemsize}",
                        step,
                    )
                check_shard_segments(
                    fqn, shard, chunks, LEGACY_CHUNK_SIZES if chunk_sizes is None else chunk_sizes, step
                )
                shards.append(shard)
            covered = sum(math.prod(sh.sizes) for sh in shards)
            if covered != math.prod(shape):
                raise _bad(
                    f"{fqn}: shards cover {covered} of the {math.prod(shape)} elements of shape {shape}", step
                )
            check_tiling(fqn, shape, shards, step)
            entries[fqn] = TensorEntry(fqn, epath, dtype, shape, tuple(shards), erank)
        elif kind == "value":
            codec = raw.get("codec")
            if codec not in VALUE_CODECS:
                raise _bad(f"{fqn}: unknown value codec {codec!r}", step)
            if "segments" in raw:
                if not isinstance(raw["segments"], list):
                    raise _bad(f"{fqn}: segments must be a list", step)
                entries[fqn] = ValueEntry(
                    fqn, epath, codec, None, tuple(_seg(s, chunks, fqn) for s in raw["segments"]), erank
                )
            else:
                if codec != "json":
                    raise _bad(f"{fqn}: an inline value must use the json codec", step)
                entries[fqn] = ValueEntry(fqn, epath, codec, raw.get("value"), None, erank)
        else:
            raise _bad(f"{fqn}: unknown entry kind {kind!r}", step)
    return entries


MAX_CHUNK_SIZES = 64


def _chunk_sizes(raw: Any, step: int) -> tuple[int, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_CHUNK_SIZES:
        raise _bad(f"chunk_sizes must be a list of at most {MAX_CHUNK_SIZES} sizes in bytes", step)
    return tuple(_int(v, "chunk_sizes element", 1, MAX_CHUNK_BYTES) for v in raw)
