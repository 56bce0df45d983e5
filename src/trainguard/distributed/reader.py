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

from ..errors import CorruptCheckpointError
from ..format import Manifest
from ..incremental.chunkstore import ChunkStore
from ..state.values import bool_bytes_valid, invalid_bools_problem
from .chunkread import ShardReader
from .manifest import manifest_to_metadata


class TrainguardReader(ShardReader, StorageReader):
    """StorageReader for one restore of one checkpoint (the reading itself: :class:`ShardReader`).

    Args:
        store: the run's chunk store.
        manifest: the parsed, validated manifest of the checkpoint.
        check_bools: refuse a bool tensor holding a byte other than 0 or 1 as it is read
            (:func:`checked_bools`); False for a caller that checks the loaded state itself (a restore checks
            on every rank together, so that all of them fall back).

    Attributes:
        bytes_read: bytes read from chunks by this rank.
    """

    def __init__(
        self,
        store: ChunkStore,
        manifest: Manifest,
        *,
        threads: int = 4,
        scan_finite: bool = False,
        check_bools: bool = True,
    ) -> None:
        StorageReader.__init__(self)
        ShardReader.__init__(self, store, manifest, threads=threads, scan_finite=scan_finite)
        self.check_bools = check_bools

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
        """Read this rank's items: the reads that go straight into destination memory (whole shards with
        chunks of their own) run in :meth:`flush`'s threads while this thread reads the rest (values, packed
        chunks, resharded parts), so both kinds of I/O overlap."""
        fut: Future[None] = Future()  # torch.futures.Future
        try:
            deferred: list[tuple[ReadItem, torch.Tensor]] = []
            rest: list[tuple[ReadItem, torch.Tensor | None]] = []  # None: a value (BYTE_IO)
            for item in plan.items:  # first the direct reads: queued, no I/O yet
                if item.type == LoadItemType.BYTE_IO:
                    rest.append((item, None))
                    continue
                dest = planner.resolve_tensor(item).detach()
                region = _region(item)
                if not self.queues_directly(*region, dest):
                    rest.append((item, dest))
                    continue
                queued = self.read_tensor(*region, dest)
                assert queued
                deferred.append((item, dest))
            with self.flushing():  # the queued reads in threads while this thread reads the rest
                for item, maybe in rest:
                    self._read_item(item, maybe, planner, deferred)
            for item, done in deferred:
                planner.commit_tensor(item, self._checked(item, done))
            fut.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP collects it per rank
            fut.set_exception(e)  # type: ignore[arg-type]
        finally:
            self.clear()
        return fut

    def _checked(self, item: ReadItem, dest: torch.Tensor) -> torch.Tensor:
        return checked_bools(item, dest, self.manifest.step) if self.check_bools else dest

    def _read_item(
        self,
        item: ReadItem,
        dest: torch.Tensor | None,
        planner: LoadPlanner,
        deferred: list[tuple[ReadItem, torch.Tensor]],
    ) -> None:
        """Read one item the first pass of :meth:`read_data` left: a value (``dest`` None) or a tensor read
        here (packed, resharded, converted); a tensor whose read was only queued goes to ``deferred``."""
        if dest is None:
            planner.load_bytes(item, io.BytesIO(self.value_payload(item.storage_index.fqn)))
            return
        if self.read_tensor(*_region(item), dest):
            deferred.append((item, dest))
        else:
            planner.commit_tensor(item, self._checked(item, dest))


def checked_bools(item: ReadItem, dest: torch.Tensor, step: int) -> torch.Tensor:
    """``dest``, once its bytes are known to be 0 or 1 if it is a bool tensor (a bool chunk's bytes are copied
    as they are stored: a forged or mistaken manifest could call a float chunk bool).

    Raises:
        CorruptCheckpointError: a byte other than 0 or 1, naming the tensor; what DCP's ``load`` (an export,
            a user's own ``dcp.load`` with this reader) raises instead of handing such a tensor over.
    """
    if not bool_bytes_valid(dest):
        problem = invalid_bools_problem([item.storage_index.fqn])
        raise CorruptCheckpointError(f"step {step}: {problem}", step=step)
    return dest


def _region(item: ReadItem) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(fqn, shard_offsets, storage_offsets, lengths)`` of a tensor item: the arguments
    :meth:`ShardReader.read_tensor` and :meth:`ShardReader.queues_directly` take before ``dest``."""
    return (
        item.storage_index.fqn,
        tuple(item.storage_index.offset or ()),
        tuple(item.storage_offsets),
        tuple(item.lengths),
    )
