"""Restore from a tier reads the chunks into memory and loads them before the hot root is written
(the hot root's disk is off the restore's critical path), then repairs the hot root in the background."""

from __future__ import annotations

from pathlib import Path

import torch

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.tiers import attach

from .helpers import CHUNK, make_state, same, save_on_shared_tier, train, weights


def _saved_on_tier(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], int]:
    shared, state = save_on_shared_tier(tmp_path, 3)
    chunk_bytes = sum(p.stat().st_size for p in (shared / "chunks").rglob("*") if p.is_file())
    return shared, weights(state), chunk_bytes


def test_restore_from_a_tier_loads_from_memory_before_the_hot_root_is_written(
    tmp_path: Path, monkeypatch
) -> None:
    shared, expected, chunk_bytes = _saved_on_tier(tmp_path)
    hot = tmp_path / "node2"
    fresh = make_state(seed=11)
    seen: list[tuple[bool, int]] = []
    real = attach.write_hot

    def write_hot(h, got, event, fsync=True):  # the background write: the load has finished by now
        hot_chunks = [p for p in (h / "chunks").rglob("*") if p.is_file()] if (h / "chunks").exists() else []
        seen.append((same(expected, weights(fresh)), len(hot_chunks)))
        return real(h, got, event, fsync)

    monkeypatch.setattr(attach, "write_hot", write_hot)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 3
    assert same(expected, weights(fresh))
    assert seen == [(True, 0)]  # loaded bit-exact while the hot root held no chunk yet
    (ev,) = read_events(hot, event="tier_restore")
    assert ev["step"] == 3 and ev["bytes"] > chunk_bytes - 1 and ev["chunks"] > 1
    assert len(list(read_events(hot, event="tier_repair"))) == ev["chunks"]
    # the hot root was repaired behind the restore: a manager without tiers restores from it alone
    alone = make_state(seed=12)
    with tg.CheckpointManager(hot, read_only=True) as ro:
        assert [(i.step, i.status) for i in ro.checkpoints()] == [(3, "valid")]
        assert ro.restore_latest(alone) == 3
    assert same(expected, weights(alone))


def test_restore_of_a_step_with_a_corrupt_hot_chunk_reads_it_into_memory_and_repairs_it(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    hot = tmp_path / "hot"
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
    chunk = sorted(p for p in (hot / "chunks").rglob("*") if p.is_file())[0]
    good = chunk.read_bytes()
    chunk.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
    fresh = make_state(seed=3)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore(1, fresh) == 1
        save_state = make_state(seed=4)
        mgr.save(2, save_state).wait()  # a save after the restore: retention waits for the hot write
    assert same(weights(state), weights(fresh))
    assert chunk.read_bytes() == good
    assert [e["chunk"] for e in read_events(hot, event="tier_repair")] == [str(chunk.relative_to(hot))]
