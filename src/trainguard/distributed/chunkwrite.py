"""One rank's chunk writes, without DCP: :class:`ChunkWriter` stores each item of a save as content-addressed
chunks, and :func:`save_local` saves one process's flat state through it without importing
``torch.distributed.checkpoint`` (DCP pulls DTensor, ``torch.fx`` and sympy: 0.3-0.6 s on a process's first
save, :mod:`trainguard._lazy`).

Tensors of at least ``pack_threshold_bytes`` get chunks of their own (split every ``chunk_size_bytes``), so an
unchanged tensor maps to the same chunk in the next checkpoint and is not written again. Smaller tensors and
values are packed together into shared chunks. Strictly-JSON values of up to ``inline_value_bytes`` go into the
manifest itself. Every chunk is durable before :meth:`ChunkWriter.write` returns (:meth:`ChunkStore.sync`);
the manifest is published by the ``commit`` callback, on the coordinator only, after all ranks wrote.

Under torch.distributed, :class:`~trainguard.distributed.writer.TrainguardWriter` (DCP's ``StorageWriter`` on
top of this class) is driven by ``dcp.save``, whose planner shards DTensors and deduplicates replicated
tensors across ranks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .._writers import WriterThreads
from ..incremental.chunkstore import ChunkStore
from ..incremental.delta import PieceKey, SaveEncoder, chunk_info
from ..state.dtypes import dtype_name
from ..state.values import TAG_JSON, EncodedValue, bool_bytes_valid, encode_value
from ..storage.local import aligned_empty
from ..validation.finite import SaveScan, byte_view
from .options import WriterOptions


@dataclass(frozen=True)
class ItemSpec:
    """One write of a save: a tensor (or one shard of it) or a non-tensor value.

    Attributes:
        fqn: the flat name.
        offset: the shard's offset in the whole tensor, one int per dimension (``()`` for a value).
        value: a non-tensor value, whose data is its encoded payload (:func:`trainguard.state.values.
            encode_value`: a one-byte tag, then JSON or ``torch.save`` bytes); False: a tensor.
        whole: the tensor is whole, not a shard (the writer's ``check_finite`` scan covers it).
        key: what the caller maps the result back with (DCP's ``MetadataIndex``); not compared.
    """

    fqn: str
    offset: tuple[int, ...] = ()
    value: bool = False
    whole: bool = True
    key: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class ItemResult:
    """Where one item's bytes went: ``storage_data`` holds ``segments`` ``[[hash, offset, length], ...]``,
    the ``chunks`` they need (with their delta bases) and ``split`` (bytes per piece of a large tensor), or an
    inline JSON ``value``; ``size_in_bytes`` is the item's raw byte count (0 for an inline value)."""

    spec: ItemSpec
    size_in_bytes: int
    storage_data: dict[str, Any]


@dataclass(frozen=True)
class TensorLayout:
    """What exists of one saved tensor: dtype name (``trainguard.state.dtypes``), global shape, and the
    ``(offsets, sizes)`` of every shard written (one per rank holding a distinct part)."""

    dtype: str
    size: tuple[int, ...]
    shards: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


# fqn -> the tensor's layout, or None for a non-tensor value
Layout = dict[str, "TensorLayout | None"]
CommitFn = Callable[[Layout, list[list[ItemResult]], dict[str, Any]], None]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of ``t`` in C order (a contiguous CPU copy only when needed: views store only their elements; a
    conjugate or negative view is materialized, so its stored elements are its values).

    A bool tensor holding bytes other than 0 and 1 (a ``uint8`` tensor viewed as bool) is stored as torch's
    ``copy_`` and ``clone`` give it, every nonzero byte as 1: what an async save's staging copy stores, and
    what a restore accepts (it refuses other bytes in a bool tensor)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    if not bool_bytes_valid(t):
        t = t.view(torch.uint8) != 0
    return memoryview(byte_view(t).numpy())  # type: ignore[arg-type]


class ChunkWriter:
    """Writes one rank's items of one save as chunks. Built by the manager per save.

    Args:
        store: the run's chunk store.
        staging: the staging prefix (a storage key) of this save's new chunks (``ChunkStore.staging_for``).
        commit: called on the coordinator with every tensor's layout, every rank's results and every rank's
            entry paths, once all ranks wrote.
        options: chunking options.
        step: the step being saved (for error messages).
        paths: this rank's ``{fqn: path}`` (see :mod:`trainguard.state.flatten`).
        encoder: compression and deltas of this save (:mod:`trainguard.incremental.delta`); None stores raw
            chunks.
        scan: the ``check_finite`` scan of the tensors stored as chunks of their own, run by the writer
            threads once a tensor's chunks are stored (:class:`~trainguard.validation.finite.SaveScan`); None:
            no scan here.
        writers: how many of the ``options.threads`` writer threads work at once (an async save: fewer
            until a caller waits for it, :class:`~trainguard._writers.WriterThreads`); None: all of them.
    """

    def __init__(
        self,
        store: ChunkStore,
        staging: str,
        commit: CommitFn,
        options: WriterOptions,
        step: int,
        paths: dict[str, Any] | None = None,
        encoder: SaveEncoder | None = None,
        scan: SaveScan | None = None,
        writers: WriterThreads | None = None,
    ) -> None:
        self.writers = writers
        self.encoder = encoder
        self.scan = scan
        self.write_s = 0.0  # seconds of write (chunks written and durable)
        self.store = store
        self.staging = staging
        self.commit = commit
        self.options = options
        self.step = step
        self.paths = paths or {}
        self.hashes: list[str] = []  # pinned chunk hashes of this rank; the manager unpins after commit/fail
        self.new_hashes: list[str] = []  # chunks this save wrote (not deduplicated): garbage if it fails
        self.bytes_written = 0
        self.bytes_total = 0
        self._lock = threading.Lock()

    def write(self, items: Iterable[tuple[ItemSpec, Any]]) -> list[ItemResult]:
        """Store every item's bytes as chunks and make them durable (visible under ``chunks/``).

        Args:
            items: ``(spec, data)`` pairs, read one at a time: ``data`` is the tensor (any device; a view
                stores only its elements) or, for a value, its encoded payload (``bytes``).

        Returns:
            One result per item, in no particular order.

        Raises:
            Whatever storing a chunk raises (``StorageFullError``, ``OSError``...); this save's unpublished
            chunks are dropped first.
        """
        t0 = time.perf_counter()
        try:
            results = self._write_all(items)
            self.store.sync(step=self.step)  # durable and visible under chunks/ before the commit
        except BaseException:  # KeyboardInterrupt too: the save's finally removes its partial directory
            self.store.drop_unpublished(self.staging)
            raise
        self.write_s = time.perf_counter() - t0
        return results

    def _put(
        self, view: memoryview, key: PieceKey | None = None, itemsize: int = 4
    ) -> tuple[str, dict[str, Any]]:
        """Store one chunk (a piece of a tensor named by ``key``, or a pack); returns its hash and the write
        result's ``chunks`` entries (the chunk and the chain of delta bases it needs)."""
        if self.encoder is not None:
            chain, written = self.encoder.put_piece(self.store, self.staging, key, view, itemsize, self.step)
        else:
            rec0, written = self.store.put(view, self.staging, step=self.step)
            chain = (rec0,)
        rec = chain[0]
        with self._lock:
            self.hashes.extend(r.hash for r in chain)
            if written:
                self.new_hashes.append(rec.hash)
            self.bytes_written += rec.length if written else 0
            self.bytes_total += rec.length
        return rec.hash, chunk_info(chain, written)

    def _write_all(self, items: Iterable[tuple[ItemSpec, Any]]) -> list[ItemResult]:
        opts = self.options
        results: list[ItemResult] = []
        pack: list[tuple[ItemSpec, memoryview, str | None]] = []  # (item, bytes, codec for values)
        pack_size = 0
        futures: list[tuple[ItemSpec, Future[list[tuple[str, dict[str, Any]]]], int]] = []
        packs: list[
            tuple[list[tuple[ItemSpec, int, int, str | None]], Future[tuple[str, dict[str, Any]]]]
        ] = []
        keep_alive: list[Any] = []  # tensors whose memory the views point into

        def put_many(
            views: list[memoryview], fqn: str, offsets: tuple[int, ...], t: torch.Tensor, whole: bool
        ) -> list[tuple[str, dict[str, Any]]]:
            parts = [self._put(v, (fqn, offsets, i), t.element_size()) for i, v in enumerate(views)]
            if self.scan is not None and whole:  # a shard's fqn names the whole tensor: scanned elsewhere
                self.scan.tensor(fqn, t, tuple(h for h, _ in parts))
            return parts

        limit = self.writers

        def limited(fn: Callable[..., Any]) -> Callable[..., Any]:
            if limit is None:
                return fn

            def run(*args: Any) -> Any:
                with limit.slot():
                    return fn(*args)

            return run

        with ThreadPoolExecutor(max_workers=opts.threads, thread_name_prefix="trainguard-write") as pool:

            def flush_pack() -> None:
                nonlocal pack, pack_size
                if not pack:
                    return
                blob = aligned_empty(pack_size)  # written with direct I/O without a bounce copy
                off = 0
                placed = []
                for item, view, codec in pack:
                    blob[off : off + len(view)] = view
                    placed.append((item, off, len(view), codec))
                    off += len(view)
                packs.append(
                    (placed, pool.submit(limited(self._put), memoryview(blob)))
                )  # written by the pool too
                pack, pack_size = [], 0

            for item, data in items:
                if item.value:
                    payload = bytes(data)
                    if payload[:1] == TAG_JSON and len(payload) <= opts.inline_value_bytes:
                        value = json.loads(payload[1:])
                        results.append(ItemResult(item, 0, {"codec": "json", "value": value}))
                        continue
                    codec: str | None = "json" if payload[:1] == TAG_JSON else "torch"
                    view = memoryview(payload)[1:]
                else:
                    codec = None
                    t = data if isinstance(data, torch.Tensor) else torch.as_tensor(data)
                    keep_alive.append(t)
                    view = tensor_bytes(t)
                    keep_alive.append(view)
                n = len(view)
                if n == 0:
                    sd0: dict[str, Any] = {"segments": [], "chunks": {}}
                    if codec is not None:
                        sd0["codec"] = codec
                    results.append(ItemResult(item, 0, sd0))
                    continue
                if codec is None and n >= max(opts.pack_threshold_bytes, 1):
                    pieces = [view[o : o + opts.chunk_size_bytes] for o in range(0, n, opts.chunk_size_bytes)]
                    futures.append(
                        (
                            item,
                            pool.submit(limited(put_many), pieces, item.fqn, item.offset, t, item.whole),
                            n,
                        )
                    )
                    continue
                if pack_size + n > opts.chunk_size_bytes:
                    flush_pack()
                pack.append((item, view, codec))
                pack_size += n
            flush_pack()
            for placed, pfut in packs:
                h, info = pfut.result()
                for item, o, n, codec in placed:
                    sd: dict[str, Any] = {"segments": [[h, o, n]], "chunks": info}
                    if codec is not None:
                        sd["codec"] = codec
                    results.append(ItemResult(item, n, sd))
            for item, fut, n in futures:
                parts = fut.result()
                segs = [[h, 0, info[h].get("size", info[h]["length"])] for h, info in parts]
                chunks: dict[str, Any] = {}
                for _, info in parts:
                    for h, d in info.items():  # a chunk new in one piece stays new
                        chunks[h] = {**d, "new": True} if chunks.get(h, {}).get("new") else d
                results.append(
                    ItemResult(item, n, {"segments": segs, "chunks": chunks, "split": opts.chunk_size_bytes})
                )
        return results


def plain_state(flat: Mapping[str, Any]) -> bool:
    """Whether :func:`save_local` can save ``flat``: its tensors are plain ``torch.Tensor`` or
    ``nn.Parameter`` (a DTensor or ShardedTensor, possible without trainguard's collectives when
    ``collective=False``, needs DCP's planner for its shards)."""
    plain = (torch.Tensor, torch.nn.Parameter)
    return all(type(v) in plain for v in flat.values() if isinstance(v, torch.Tensor))


def save_local(flat: Mapping[str, Any], writer: ChunkWriter) -> None:
    """Save ``flat`` in this process alone: every tensor whole, every other value encoded, in ``flat``'s
    order, then ``writer.commit``. The same items, chunks and manifest as DCP's default planner makes in one
    process (``create_default_local_save_plan``: one write item per tensor at offset 0, a ``BYTE_IO`` item per
    value), without importing DCP.

    Args:
        flat: flat name -> tensor or value (:func:`plain_state` holds; :func:`trainguard._statefn.collect`
            already replaced every ``Stateful`` by its ``state_dict()``); an
            :class:`~trainguard.state.values.EncodedValue` is stored as its payload.
        writer: this save's chunk writer.

    Raises:
        Whatever encoding a value, writing or committing raises.
    """
    layout: Layout = {}

    def items() -> Iterable[tuple[ItemSpec, Any]]:
        for fqn, obj in flat.items():
            if isinstance(obj, torch.Tensor):
                shape = tuple(obj.shape)
                zeros = (0,) * len(shape)
                layout[fqn] = TensorLayout(dtype_name(obj.dtype), shape, ((zeros, shape),))
                yield ItemSpec(fqn, zeros), obj
            else:
                layout[fqn] = None
                payload = obj.payload if isinstance(obj, EncodedValue) else encode_value(obj, fqn)
                yield ItemSpec(fqn, value=True), payload

    results = writer.write(items())
    writer.commit(layout, [results], dict(writer.paths))
