"""Retention's cache (retention/refs.py): a save's retention work does not grow with the checkpoints in the root
(counted in storage calls through FaultyStorage, not timed), and the cache never makes retention delete a chunk
that a checkpoint still references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.integrity.verify import verify
from trainguard.retention import KeepEvery, KeepLatest
from trainguard.retention.refs import ManifestCache
from trainguard.storage import FaultyStorage, LocalStorage


def state_at(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(step)), "frozen": torch.ones(1024)}


def reads_of_one_save(disk: FaultyStorage, mgr: tg.CheckpointManager, step: int) -> int:
    before = disk.calls["read"]
    mgr.save(step, state_at(step))
    return disk.calls["read"] - before


@pytest.mark.parametrize("keep", [None, KeepEvery(1)], ids=["keep-all", "keep-every-1"])
def test_the_reads_of_a_save_do_not_grow_with_the_checkpoints_in_the_root(
    tmp_path: Path, keep: object
) -> None:
    disk = FaultyStorage(LocalStorage(tmp_path / "root", fsync=False))
    with tg.CheckpointManager(disk, keep=keep, async_save=False, fsync=False) as mgr:
        for s in range(1, 4):
            mgr.save(s, state_at(s))
        few = reads_of_one_save(disk, mgr, 4)
        for s in range(5, 25):
            mgr.save(s, state_at(s))
        many = reads_of_one_save(disk, mgr, 25)
    assert many == few, f"a save read {few} objects with 4 checkpoints and {many} with 25"


def test_retention_with_the_cache_keeps_every_chunk_a_kept_checkpoint_references(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with tg.CheckpointManager(root, keep=KeepLatest(2), async_save=False, fsync=False) as mgr:
        for s in range(1, 8):
            mgr.save(s, state_at(s))
        assert [c.step for c in mgr.checkpoints() if c.status == "valid"] == [6, 7]
    assert verify(root).ok
    for s in (6, 7):
        state = {"w": torch.zeros(1024), "frozen": torch.zeros(1024)}
        tg.CheckpointManager(root, read_only=True).restore(s, state)
        assert torch.equal(state["w"], state_at(s)["w"]) and torch.equal(state["frozen"], torch.ones(1024))


def test_the_cache_counts_references_per_chunk() -> None:
    cache = ManifestCache()
    cache.add(1, {"a", "b"}, run_id="r")
    cache.add(2, {"b", "c"}, run_id="r")
    assert dict(cache.referenced()) == {"a": 1, "b": 2, "c": 1}
    cache.drop(1)
    assert dict(cache.referenced()) == {"b": 1, "c": 1} and "a" not in cache.referenced()
    cache.add(2, {"d"})  # a step committed again replaces what was known of it
    assert dict(cache.referenced()) == {"d": 1} and cache.steps() == {2}
