"""DCP extension points onto trainguard's format: planners, StorageWriter and StorageReader.

Call sequence (torch ``distributed/checkpoint/storage.py``), every rank unless noted:

Save: ``TrainguardSavePlanner.set_up_planner`` -> ``TrainguardWriter.set_up_storage_writer`` ->
``prepare_local_plan`` -> (coordinator) ``prepare_global_plan`` -> ``write_data`` (each rank writes and fsyncs
its own chunks) -> (coordinator, only after every rank's ``write_data`` succeeded) ``finish``, which publishes
the manifest: the commit. One process with plain tensors saves without DCP
(:func:`trainguard.distributed.chunkwrite.save_local`: the same items, chunks and manifest); one holding DTensors
without trainguard's collectives has :func:`trainguard.distributed.local.save_planned` make these calls in
this order itself instead of ``dcp.save`` (whose logging of every entry costs more than the planning).

Load: ``TrainguardReader.read_metadata`` (from our JSON manifest, never DCP's pickled ``.metadata``) ->
``TrainguardLoadPlanner.set_up_planner`` -> ``read_data`` (each chunk's CRC32C checked as it is read; values
decoded by :mod:`trainguard.state.values`, never ``weights_only=False``).

The names below are imported on first use: each of them imports DCP, which a single-process restore never needs
(see :mod:`trainguard._lazy`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TrainguardLoadPlanner": ".planner",
    "TrainguardSavePlanner": ".planner",
    "TrainguardReader": ".reader",
    "TrainguardWriter": ".writer",
}

__all__ = ["TrainguardLoadPlanner", "TrainguardReader", "TrainguardSavePlanner", "TrainguardWriter"]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
