"""The save and restore paths run on explicit dependencies (a RootContext, a Validation, a SavePath), with no
CheckpointManager: what the manager wires together works on its own (issue 9)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard import _restore
from trainguard._context import RootContext
from trainguard._save import SavePath
from trainguard.catalog import scan
from trainguard.distributed.context import DistContext
from trainguard.distributed.options import WriterOptions
from trainguard.errors import NonFiniteStateError
from trainguard.format.run import RunInfo, new_run_id
from trainguard.incremental.auto import CompressionChooser
from trainguard.incremental.chunkstore import ChunkStore
from trainguard.incremental.delta import IncrementalState
from trainguard.policies import EveryNSteps
from trainguard.retention import as_retention
from trainguard.storage.local import LocalStorage
from trainguard.validation.attach import Validation


def wire(root: Path, events: list[tuple[str, dict[str, Any]]], *, keep: int | None = None) -> SavePath:
    def event(name: str, **fields: Any) -> None:
        events.append((name, fields))

    storage = LocalStorage(root)
    dist = DistContext(collective=False)
    ctx = RootContext(
        root=root,
        storage=storage,
        store=ChunkStore(storage),
        dist=dist,
        options=WriterOptions(threads=1),
        retention=as_retention(keep),
        run=RunInfo(new_run_id()),
        event=event,
        compression=CompressionChooser("off", threads=1),
        incremental=IncrementalState(delta=False, max_chain=10),
    )
    ctx.validation = Validation(root=root, dist=dist, event=event, saves=ctx.saves, check_finite="error")
    return SavePath(
        ctx,
        ctx.validation,
        EveryNSteps(1),
        async_save=False,
        staging_buffers=1,
        save_timeout_s=None,
        read_only=False,
    )


def test_save_retention_and_restore_without_a_manager(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    path = wire(tmp_path, events, keep=2)
    for step in (1, 2, 3):
        pending = path.save(
            step, {"w": torch.arange(6.0) * step}, metrics=None, metadata=None, overwrite=False, block=True
        )
        assert pending.wait().step == step
    assert [i.step for i in scan(tmp_path) if i.usable] == [2, 3]  # keep=2 applied by the persist path
    assert [f["step"] for n, f in events if n == "retention_delete"] == [1]
    state = {"w": torch.zeros(6)}
    assert _restore.restore_newest(path.ctx, state) == 3
    assert torch.equal(state["w"], torch.arange(6.0) * 3)
    assert path.ctx.last_restore.bytes > 0
    assert [f["step"] for n, f in events if n == "restore"] == [3]


def test_the_validation_given_to_the_context_rejects_a_non_finite_save(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    path = wire(tmp_path, events)
    with pytest.raises(NonFiniteStateError):
        path.save(
            5,
            {"w": torch.tensor([1.0, float("nan")])},
            metrics=None,
            metadata=None,
            overwrite=False,
            block=True,
        )
    assert [n for n, _ in events if n == "save_rejected"] == ["save_rejected"]
    assert scan(tmp_path) == []  # nothing committed
