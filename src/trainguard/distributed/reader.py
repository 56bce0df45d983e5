"""``TrainguardReader``: a DCP ``StorageReader`` over a parsed :class:`~trainguard.format.Manifest`.

DCP's ``Metadata`` is rebuilt from our JSON manifest; DCP's pickled ``.metadata`` never exists. DCP's read
items are read by :class:`~trainguard.distributed.chunkread.ShardReader` (each chunk checked as it is read).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..format import Manifest
from ..incremental.chunkstore import ChunkStore
from .chunkread import ShardReader
from .manifest import manifest_to_metadata


class TrainguardReader(ShardReader, StorageReader):
    """StorageReader for one restore of one checkpoint (the reading itself: :class:`ShardReader`).

    Args:
        store: the run's chunk store.
        manifest: the parsed, validated manifest of the checkpoint.

    Attributes:
        bytes_read: bytes read from chunks by this rank.
    """

    def __init__(self, store: ChunkStore, manifest: Manifest, *, threads: int = 4) -> None:
        StorageReader.__init__(self)
        ShardReader.__init__(self, store, manifest, threads=threads)

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
            for item in plan.items:
                self._read_item(item, planner, deferred)
            self.flush()
            for item, dest in deferred:
                planner.commit_tensor(item, dest)
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP collects it per rank
            fut.set_exception(e)  # type: ignore[arg-type]
        finally:
            self.clear()
        return fut

    def _read_item(
        self, item: ReadItem, planner: LoadPlanner, deferred: list[tuple[ReadItem, torch.Tensor]]
    ) -> None:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(self.value_payload(fqn)))
            return
        dest = planner.resolve_tensor(item).detach()
        offsets = tuple(item.storage_index.offset or ())
        if self.read_tensor(fqn, offsets, tuple(item.storage_offsets), tuple(item.lengths), dest):
            deferred.append((item, dest))
        else:
            planner.commit_tensor(item, dest)
