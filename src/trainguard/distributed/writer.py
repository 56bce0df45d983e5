"""``TrainguardWriter``: a DCP ``StorageWriter`` that stores each rank's items as content-addressed chunks.

Tensors of at least ``pack_threshold_bytes`` get chunks of their own (split every ``chunk_size_bytes``), so an
unchanged tensor maps to the same chunk in the next checkpoint and is not written again. Smaller tensors and
values are packed together into shared chunks. Strictly-JSON values of up to ``inline_value_bytes`` go into the
manifest itself. Every chunk is durable before ``write_data`` returns (:meth:`ChunkStore.sync`); the manifest
is published by the ``commit`` callback in ``finish``, on the coordinator only, after all ranks wrote.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as _CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._writers import WriterThreads
from ..incremental.chunkstore import ChunkStore
from ..incremental.delta import PieceKey, SaveEncoder, chunk_info
from ..state.values import TAG_JSON
from ..validation.finite import SaveScan, byte_view
from .options import WriterOptions

CommitFn = Callable[[Metadata, list[list[WriteResult]], dict[str, Any]], None]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of ``t`` in C order (a contiguous CPU copy only when needed: views store only their elements; a
    conjugate or negative view is materialized, so its stored elements are its values)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    return memoryview(byte_view(t).numpy())  # type: ignore[arg-type]


def whole_tensor(item: Any, t: torch.Tensor) -> bool:
    """Whether the write item ``item`` (holding ``t``) is a whole tensor, not a shard of one."""
    td = getattr(item, "tensor_data", None)
    offsets = tuple(item.index.offset or ())
    return td is not None and tuple(td.size) == tuple(t.shape) and not any(offsets)


class TrainguardWriter(StorageWriter):
    """StorageWriter for one save. Built by the manager per save.

    Args:
        store: the run's chunk store.
        staging: the staging prefix (a storage key) of this save's new chunks (``ChunkStore.staging_for``).
        commit: called by ``finish`` on the coordinator with DCP's metadata, every rank's results and every
            rank's entry paths.
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
        super().__init__()
        self.writers = writers
        self.encoder = encoder
        self.scan = scan
        self.write_s = 0.0  # seconds of write_data (chunks written and durable)
        self.store = store
        self.staging = staging
        self.commit = commit
        self.options = options
        self.step = step
        self.paths = paths or {}
        self.global_paths: dict[str, Any] = {}
        self.rank = 0
        self.is_coordinator = True
        self.hashes: list[str] = []  # pinned chunk hashes of this rank; the manager unpins after commit/fail
        self.new_hashes: list[str] = []  # chunks this save wrote (not deduplicated): garbage if it fails
        self.bytes_written = 0
        self.bytes_total = 0
        self._lock = threading.Lock()

    # -- DCP protocol -------------------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Every rank sends the nested-state paths of its entries to the coordinator (ranks hold different
        # entries, e.g. each rank's RNG state), which needs all of them for the manifest.
        return dataclasses.replace(plan, storage_data={"paths": dict(self.paths)})

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        for p in plans:
            if isinstance(p.storage_data, dict):
                self.global_paths.update(p.storage_data.get("paths", {}))
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        t0 = time.perf_counter()
        try:
            results = self._write_all(plan, planner)
            self.store.sync(step=self.step)  # durable and visible under chunks/ before the commit
            self.write_s = time.perf_counter() - t0
            fut.set_result(results)
        except Exception as e:  # noqa: BLE001 - DCP collects it per rank
            self.store.drop_unpublished(self.staging)
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's Future stubs type the value, not errors
        except BaseException:  # KeyboardInterrupt, SystemExit: a Future cannot hold them; they propagate
            self.store.drop_unpublished(self.staging)  # the save's finally removes its partial directory
            raise
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.commit(metadata, results, self.global_paths or self.paths)

    # -- writing ------------------------------------------------------------------------------------------
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

    def _write_all(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        opts = self.options
        results: list[WriteResult] = []
        pack: list[tuple[Any, memoryview, str | None]] = []  # (item, bytes, codec for values)
        pack_size = 0
        futures: list[tuple[Any, _CFuture[list[tuple[str, dict[str, Any]]]], int]] = []
        packs: list[tuple[list[tuple[Any, int, int, str | None]], _CFuture[tuple[str, dict[str, Any]]]]] = []
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
                blob = bytearray(pack_size)
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

            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    payload = data.getvalue()
                    if payload[:1] == TAG_JSON and len(payload) <= opts.inline_value_bytes:
                        value = json.loads(payload[1:])
                        results.append(
                            WriteResult(
                                index=item.index,
                                size_in_bytes=0,
                                storage_data={"codec": "json", "value": value},
                            )
                        )
                        continue
                    codec = "json" if payload[:1] == TAG_JSON else "torch"
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
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=sd0))
                    continue
                if codec is None and n >= max(opts.pack_threshold_bytes, 1):
                    pieces = [view[o : o + opts.chunk_size_bytes] for o in range(0, n, opts.chunk_size_bytes)]
                    offsets = tuple(item.index.offset or ())
                    futures.append(
                        (
                            item,
                            pool.submit(
                                limited(put_many), pieces, item.index.fqn, offsets, t, whole_tensor(item, t)
                            ),
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
                    results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=sd))
            for item, fut, n in futures:
                parts = fut.result()
                segs = [[h, 0, info[h].get("size", info[h]["length"])] for h, info in parts]
                chunks: dict[str, Any] = {}
                for _, info in parts:
                    for h, d in info.items():  # a chunk new in one piece stays new
                        chunks[h] = {**d, "new": True} if chunks.get(h, {}).get("new") else d
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=n,
                        storage_data={
                            "segments": segs,
                            "chunks": chunks,
                            "split": opts.chunk_size_bytes,
                        },
                    )
                )
        return results
