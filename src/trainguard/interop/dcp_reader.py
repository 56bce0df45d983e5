"""``dcp_reader``: a DCP ``StorageReader`` over a trainguard checkpoint, for code that loads with plain
``torch.distributed.checkpoint.load`` and its default planner::

    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=tg.dcp_reader("ckpts/run1"))      # newest valid step
    model.load_state_dict(state["model"])

Tensors are read (and resharded to the caller's world size) by trainguard's own reader, every chunk CRC32C
checked. DCP's default planner unpickles non-tensor values with ``torch.load(weights_only=False)``; this
reader never hands it a stored payload: it decodes each value itself (JSON or ``weights_only=True``) and
passes the planner a fresh ``torch.save`` of the decoded plain value, so nothing from the checkpoint runs.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..distributed.reader import TrainguardReader
from ..state.values import decode_value
from .select import open_checkpoint


class _SafeValues:
    """The caller's planner, with every value decoded safely before it reaches ``load_bytes``."""

    def __init__(self, planner: LoadPlanner) -> None:
        self._planner = planner

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        decoded = decode_value(value.getvalue(), read_item.dest_index.fqn)
        buf = io.BytesIO()
        torch.save(decoded, buf)  # plain values only (decode_value built them): safe for any torch.load
        buf.seek(0)
        self._planner.load_bytes(read_item, buf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class TrainguardDCPReader(TrainguardReader):
    """The ``StorageReader`` :func:`dcp_reader` returns: works with DCP's ``DefaultLoadPlanner`` (or any
    planner); the checkpoint's step is ``step``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step = self.manifest.step

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, _SafeValues(planner))  # type: ignore[arg-type]


def dcp_reader(root: str | os.PathLike[str], step: int | None = None) -> TrainguardDCPReader:
    """A DCP ``StorageReader`` for the checkpoint of ``step`` under ``root``, for plain ``dcp.load``.

    Usage: ``dcp.load(state, storage_reader=tg.dcp_reader(root, step))``. ``state`` is keyed as the state
    given to ``CheckpointManager.save`` (``{"model": model.state_dict()}`` for a state saved as
    ``{"model": model}``); DCP reshards to the current world size. Under torch.distributed, pass the same
    ``step`` on every rank (the newest valid step could change between ranks' calls while a job saves).

    Args:
        root: the run root.
        step: the checkpoint's step; default the newest valid one.

    Returns:
        A ``torch.distributed.checkpoint.StorageReader`` (one per ``dcp.load``).

    Raises:
        CheckpointNotFoundError: no committed checkpoint of ``step``.
        NoValidCheckpointError: ``step`` not given and no checkpoint under ``root`` is valid.
        CorruptCheckpointError: the checkpoint of ``step`` is not valid. A chunk that fails its CRC32C
            during the load makes ``dcp.load`` raise (DCP's ``CheckpointException`` wrapping it).
    """
    store, m = open_checkpoint(root, step)
    return TrainguardDCPReader(store, m)
