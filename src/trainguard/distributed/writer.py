"""``TrainguardWriter``: DCP's ``StorageWriter`` over :class:`~trainguard.distributed.chunkwrite.ChunkWriter`,
for saves through ``dcp.save`` (every rank of a torch.distributed job, or one process holding DTensors without
trainguard's collectives). Each rank stores its items as content-addressed chunks; the manifest is published
by the ``commit`` callback in ``finish``, on the coordinator only, after all ranks wrote.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .chunkwrite import ChunkWriter, ItemResult, ItemSpec, tensor_bytes
from .manifest import layout_from_metadata

__all__ = ["TrainguardWriter", "tensor_bytes"]


def item_spec(item: WriteItem) -> ItemSpec:
    """Our description of DCP's write item (its index is kept as the key of the result)."""
    offset = tuple(item.index.offset or ())
    if item.type == WriteItemType.BYTE_IO:
        return ItemSpec(item.index.fqn, offset, value=True, key=item.index)
    td = item.tensor_data
    # a shard's fqn names the whole tensor: its check_finite scan runs elsewhere
    whole = td is not None and tuple(td.chunk.sizes) == tuple(td.size) and not any(offset)
    return ItemSpec(item.index.fqn, offset, whole=whole, key=item.index)


class TrainguardWriter(ChunkWriter, StorageWriter):
    """StorageWriter for one save (arguments: :class:`~trainguard.distributed.chunkwrite.ChunkWriter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ChunkWriter.__init__(self, *args, **kwargs)
        self.global_paths: dict[str, Any] = {}
        self.rank = 0
        self.is_coordinator = True

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

        def items() -> Any:
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):  # a value, encoded by TrainguardSavePlanner
                    yield item_spec(item), data.getvalue()
                else:
                    yield item_spec(item), data

        try:
            results = self.write(items())
        except Exception as e:  # noqa: BLE001 - DCP collects it per rank
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's Future stubs type the value, not errors
            return fut
        fut.set_result(
            [
                WriteResult(index=r.spec.key, size_in_bytes=r.size_in_bytes, storage_data=r.storage_data)
                for r in results
            ]
        )
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        ours = [
            [
                ItemResult(
                    ItemSpec(wr.index.fqn, tuple(wr.index.offset or ())), wr.size_in_bytes, wr.storage_data
                )
                for wr in rank_results
            ]
            for rank_results in results
        ]
        self.commit(layout_from_metadata(metadata), ours, self.global_paths or self.paths)
