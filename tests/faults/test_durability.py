"""Durability modes of the chunk store: batched (one ``syncfs`` per rank per save) and per file.

Whatever the mode, a chunk appears under ``chunks/`` only once complete and flushed, a failed flush commits
nothing and leaves earlier checkpoints intact, and the next save succeeds. The failed flush is injected through
the storage seam (``Fault("flush")``); that LocalStorage renames nothing when ``syncfs(2)`` itself fails is
checked on LocalStorage in tests/storage/test_local_storage_faults.py. Counting ``syncfs`` calls and running
without it (a platform that lacks it) replace the module's ``_SYNCFS``: no storage seam reaches a syscall.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
from faultlib import (
    assert_state_is,
    blank_state,
    chunk_files,
    commit_save,
    make_state,
    manifest_path,
    referenced_chunks,
    require,
)

import trainguard as tg
import trainguard.storage.local as chunkstore  # the syncfs(2) wrapper lives with LocalStorage
from trainguard.integrity.verify import verify
from trainguard.storage import Fault, FaultyStorage, LocalStorage


@pytest.mark.parametrize("durability", ["batched", "per_file"])
@pytest.mark.parametrize("have_syncfs", [True, False], ids=["syncfs", "no-syncfs"])
def test_every_mode_round_trips_and_verifies(tmp_path, monkeypatch, durability, have_syncfs):
    calls: list[str] = []
    real = chunkstore._SYNCFS
    if have_syncfs and real is None:
        pytest.skip("no syncfs(2) on this platform")

    def counting_syncfs(fd: int) -> int:
        calls.append("syncfs")
        return real(fd)

    monkeypatch.setattr(chunkstore, "_SYNCFS", counting_syncfs if have_syncfs else None)
    root = tmp_path / "root"
    with tg.CheckpointManager(root, durability=durability, async_save=False) as mgr:
        commit_save(mgr, 1, make_state(1))
        commit_save(mgr, 2, make_state(2))
    state = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 2
    assert_state_is(state, 2)
    assert verify(root).ok
    assert chunk_files(root) == referenced_chunks(root, [1, 2])
    # batched with syncfs: two per save (the data, then the renames); otherwise none
    assert len(calls) == (4 if durability == "batched" and have_syncfs else 0)


@pytest.mark.parametrize("durability", ["batched", "per_file"])
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_failed_flush_commits_nothing_and_the_next_save_succeeds(tmp_path, async_save, durability):
    root = tmp_path / "root"
    root.mkdir()
    disk = FaultyStorage(LocalStorage(root, durability=durability))
    with tg.CheckpointManager(disk, async_save=async_save) as mgr:
        commit_save(mgr, 1, make_state(1))
        before = chunk_files(root)
        flush = disk.add(Fault("flush", match="chunks/*", times=None, errno=errno.EIO))  # the save's barrier
        with pytest.raises(tg.errors.SaveError) as info:
            commit_save(mgr, 2, make_state(2))
        require(disk.injected, "the flush failed")
        assert "Input/output error" in str(info.value) or "EIO" in repr(info.value.rank_errors)
        if durability == "batched":  # per_file chunks are in place once written; batched ones only after it
            assert chunk_files(root) == before, "a chunk of the failed save became visible under chunks/"
        assert [c.step for c in mgr.checkpoints() if c.status == "valid"] == [1]
        assert not manifest_path(root, 2).exists()
        flush.enabled = False
        commit_save(mgr, 2, make_state(2))  # nothing stale from the failed save is replayed
    state: dict[str, Any] = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 2
    assert_state_is(state, 2)
    assert verify(root).ok
    assert chunk_files(root) == referenced_chunks(root, [1, 2]), "the failed save left orphan chunks"


def test_an_unknown_durability_mode_is_a_config_error(tmp_path):
    with pytest.raises(tg.errors.ConfigError, match="durability must be one of"):
        tg.CheckpointManager(tmp_path / "root", durability="fast")
