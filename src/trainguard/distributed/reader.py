"""``TrainguardReader``: a DCP ``StorageReader`` over a parsed :class:`~trainguard.format.Manifest`.

DCP's ``Metadata`` is rebuilt from our JSON manifest; DCP's pickled ``.metadata`` never exists. Each chunk is
checked (length, CRC32C) as it is read. When a read covers a whole saved shard whose chunks are the shard's
own, the bytes go straight into the destination tensor's memory (no intermediate buffer); otherwise (resharding,
packed chunks, dtype or device conversion) the shard is read, checked, narrowed and copied.
"""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CorruptCheckpointError
from ..format import ChunkRecord, Manifest, Segment, ShardRecord, TensorEntry, ValueEntry
from ..incremental.chunkstore import ChunkStore
from ..incremental.delta import read_decoded
from ..state.dtypes import dtype_from_name
from ..state.values import TAG_JSON, TAG_TORCH


def manifest_to_metadata(m: Manifest) -> Metadata:
    """DCP ``Metadata`` equivalent of our manifest (what DCP's planners need to plan a load)."""
    sdm: dict[str, Any] = {}
    for fqn, e in m.entries.items():
        if isinstance(e, TensorEntry):
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(e.dtype)),
                size=torch.Size(e.shape),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=torch.Size(s.sizes))
                    for s in e.shards
                ],
            )
        else:
            sdm[fqn] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=sdm)


class TrainguardReader(StorageReader):
    """StorageReader for one restore of one checkpoint.

    Args:
        store: the run's chunk store.
        manifest: the parsed, validated manifest of the checkpoint.

    Attributes:
        bytes_read: bytes read from chunks by this rank.
    """

    def __init__(self, store: ChunkStore, manifest: Manifest, *, threads: int = 4) -> None:
        super().__init__()
        self.threads = threads
        self.store = store
        self.manifest = manifest
        self.owners = manifest.chunk_owners()
        self.bytes_read = 0
        self._chunk_cache: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return manifest_to_metadata(self.manifest)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fut: Future[None] = Future()  # torch.futures.Future
        try:
            deferred: list[tuple[ReadItem, torch.Tensor]] = []
            jobs: list[tuple[ChunkRecord, memoryview]] = []
            for item in plan.items:
                self._read_item(item, planner, deferred, jobs)
            self._read_chunks_into(jobs)
            for item, dest in deferred:
                planner.commit_tensor(item, dest)
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP collects it per rank
            fut.set_exception(e)  # type: ignore[arg-type]
        finally:
            self._chunk_cache.clear()
        return fut

    # -- helpers ------------------------------------------------------------------------------------------
    def _chunk(self, h: str) -> bytearray:
        buf = self._chunk_cache.get(h)
        if buf is None:
            rec = self.manifest.chunks[h]
            if rec.encoded:
                buf = bytearray(rec.decoded_size)
                self._decode(rec, memoryview(buf))
            else:
                buf = self.store.read(rec, step=self.manifest.step, owners=self.owners.get(h))
                self.bytes_read += rec.length
            self._chunk_cache[h] = buf
        return buf

    def _segments_bytes(self, segs: tuple[Segment, ...]) -> bytearray:
        out = bytearray(sum(s.length for s in segs))
        off = 0
        for s in segs:
            chunk = self._chunk(s.chunk)
            out[off : off + s.length] = memoryview(chunk)[s.offset : s.offset + s.length]
            off += s.length
            if s.length == len(chunk):
                self._chunk_cache.pop(s.chunk, None)  # a tensor's own chunk is not needed again
        return out

    def _decode(self, rec: ChunkRecord, out: memoryview) -> None:
        """Decode an encoded chunk (and its chain of delta bases, each CRC32C-checked) into ``out``."""
        read_decoded(
            self.store,
            self.manifest.chunks,
            rec,
            out,
            step=self.manifest.step,
            owners=self.owners.get(rec.hash),
        )
        base, n = rec, rec.length
        while base.base is not None:
            base = self.manifest.chunks[base.base]
            n += base.length
        with self._lock:
            self.bytes_read += n

    def _read_chunks_into(self, jobs: list[tuple[ChunkRecord, memoryview]]) -> None:
        """Read whole chunks straight into destination memory, CRC32C-checked, from ``threads`` threads (largest
        first): one stream at a time leaves the disk idle between files."""
        jobs = sorted(jobs, key=lambda j: -j[0].length)
        step = self.manifest.step

        def one(job: tuple[ChunkRecord, memoryview]) -> None:
            rec, view = job
            if rec.encoded:
                self._decode(rec, view)
            else:
                self.store.readinto(rec, view, step=step, owners=self.owners.get(rec.hash))

        if len(jobs) <= 1 or self.threads <= 1:
            for job in jobs:
                one(job)
        else:
            with ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="trainguard-read") as pool:
                for f in [pool.submit(one, j) for j in jobs]:
                    f.result()
        self.bytes_read += sum(rec.length for rec, _ in jobs if not rec.encoded)

    def _read_item(
        self,
        item: ReadItem,
        planner: LoadPlanner,
        deferred: list[tuple[ReadItem, torch.Tensor]],
        jobs: list[tuple[ChunkRecord, memoryview]],
    ) -> None:
        fqn = item.storage_index.fqn
        entry = self.manifest.entries.get(fqn)
        if entry is None:
            raise CorruptCheckpointError(
                f"checkpoint of step {self.manifest.step} has no entry {fqn!r}", step=self.manifest.step
            )
        if item.type == LoadItemType.BYTE_IO:
            if not isinstance(entry, ValueEntry):
                raise CorruptCheckpointError(f"{fqn!r} is a tensor in the checkpoint, expected a value")
            if entry.segments is None:
                import json

                payload = TAG_JSON + json.dumps(entry.value).encode()
            else:
                tag = TAG_JSON if entry.codec == "json" else TAG_TORCH
                payload = tag + bytes(self._segments_bytes(entry.segments))
            planner.load_bytes(item, io.BytesIO(payload))
            return
        if not isinstance(entry, TensorEntry):
            raise CorruptCheckpointError(f"{fqn!r} is a value in the checkpoint, expected a tensor")
        shard = self._find_shard(entry, tuple(item.storage_index.offset or ()))
        dtype = dtype_from_name(entry.dtype)
        expected = shard.nbytes
        numel = 1
        for s in shard.sizes:
            numel *= s
        if expected != numel * dtype.itemsize:
            raise CorruptCheckpointError(
                f"{fqn!r}: shard holds {expected} bytes but {tuple(shard.sizes)} x {entry.dtype} needs "
                f"{numel * dtype.itemsize}",
                step=self.manifest.step,
            )
        dest = planner.resolve_tensor(item).detach()
        whole = all(o == 0 for o in item.storage_offsets) and tuple(item.lengths) == tuple(shard.sizes)
        if (
            whole
            and dest.device.type == "cpu"
            and dest.dtype == dtype
            and dest.is_contiguous()
            and all(
                s.offset == 0 and s.length == self.manifest.chunks[s.chunk].decoded_size
                for s in shard.segments
            )
        ):
            raw = memoryview(dest.reshape(-1).view(torch.uint8).numpy()) if numel else memoryview(b"")  # type: ignore[arg-type]
            off = 0
            for seg in shard.segments:
                jobs.append((self.manifest.chunks[seg.chunk], raw[off : off + seg.length]))
                off += seg.length
            deferred.append((item, dest))
            return
        else:
            data = self._segments_bytes(shard.segments)
            src = (
                torch.frombuffer(data, dtype=torch.uint8).view(dtype)
                if numel
                else torch.empty(0, dtype=dtype)
            ).reshape(shard.sizes)
            for dim, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=False)):
                src = src.narrow(dim, o, n)
            dest.copy_(src)
        planner.commit_tensor(item, dest)

    @staticmethod
    def _find_shard(entry: TensorEntry, offsets: tuple[int, ...]) -> ShardRecord:
        for sh in entry.shards:
            if tuple(sh.offsets) == offsets or (not offsets and not any(sh.offsets)):
                return sh
        raise CorruptCheckpointError(f"{entry.fqn!r}: no saved shard at offsets {offsets}")
