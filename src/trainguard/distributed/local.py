"""One process's save through DCP's planner and trainguard's writer, without ``dcp.save``'s per-entry logging:
for a state holding DTensors in a process that does not take part in trainguard's collectives
(``collective=False``). A state of plain tensors saves without DCP at all
(:func:`trainguard.distributed.chunkwrite.save_local`).

``dcp.save`` in one process (``no_dist``) wraps the ``state_dict()`` call of every top-level entry of the state
dict in ``_dcp_method_logger``: per entry and per save it draws a ``uuid4``, reads the clock and builds two
DEBUG log records for a logger that torch sets to DEBUG with a ``NullHandler`` (torch 2.13,
``distributed/checkpoint/state_dict_saver.py::_stateful_to_state_dict``). trainguard hands DCP a flat dict, one
entry per tensor, so that cost grows with the tensor count: 1,200 tensors (a 150-layer model with AdamW) spent
~40% of a small save's time there, Python code that holds the GIL in an async save's persist thread
(benchmarks/RESULTS.md, "dcp.save's per-entry logging").

:func:`save_planned` drives the same extension points in the order ``_save_state_dict`` calls them with
``no_dist=True`` (torch ``distributed/checkpoint/storage.py`` documents the sequence); every rank of a
torch.distributed job still goes through ``dcp.save``, whose collectives it needs.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter


def save_planned(state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner) -> Metadata:
    """Save ``state_dict`` in this process alone, as ``dcp.save(state_dict, storage_writer=writer,
    planner=planner, no_dist=True)`` does, without its logging wrappers.

    Args:
        state_dict: flat name -> tensor or value (:func:`trainguard._statefn.collect` already replaced every
            ``Stateful`` by its ``state_dict()`` and refuses one below the top level, so nothing is left of
            what ``dcp.save``'s ``_stateful_to_state_dict`` does).
        writer: the storage writer (its ``finish`` commits).
        planner: the save planner.

    Returns:
        The checkpoint's DCP metadata.

    Raises:
        Whatever the planner or the writer raises (the writer's ``write_data`` error as it was set on its
        future), unwrapped: ``dcp.save`` would wrap it in a ``CheckpointException``.
    """
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=True)
    # dcp.save passes use_collectives=True (its no_dist collectives do nothing); TrainguardWriter ignores it
    writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    local_plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local_plan])
    plans = writer.prepare_global_plan(plans)
    written = writer.write_data(planner.finish_plan(plans[0]), planner)
    written.wait()  # raises the writer's error
    writer.finish(metadata=metadata, results=[written.value()])
    return metadata
