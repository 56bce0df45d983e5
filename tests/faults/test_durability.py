"""Durability modes of the chunk store: batched (one ``syncfs`` per rank per save), per file, and auto (the
default: batched unless the node holds more dirty data than the save's own chunks, then an fsync per file).

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


@pytest.mark.parametrize("durability", ["batched", "per_file", "auto"])
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
    monkeypatch.setattr(chunkstore, "dirty_bytes", lambda: 0)  # auto: a node without other writers
    root = tmp_path / "root"
    with tg.CheckpointManager(root, durability=durability, async_save=False) as mgr:
        commit_save(mgr, 1, make_state(1))
        commit_save(mgr, 2, make_state(2))
    state = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 2
    assert_state_is(state, 2)
    assert verify(root).ok
    assert chunk_files(root) == referenced_chunks(root, [1, 2])
    # batched (and auto on a quiet node) with syncfs: two per save (the data, then the renames); else none
    assert len(calls) == (4 if durability != "per_file" and have_syncfs else 0)


@pytest.mark.parametrize("foreign_dirty", [False, True], ids=["quiet-node", "other-writers"])
def test_auto_flushes_with_syncfs_only_when_no_other_dirty_data_waits(tmp_path, monkeypatch, foreign_dirty):
    if chunkstore._SYNCFS is None:
        pytest.skip("no syncfs(2) on this platform")
    real_syncfs, real_fsync_all = chunkstore._SYNCFS, chunkstore._fsync_all
    calls: list[str] = []
    fsynced: list[str] = []

    def counting_syncfs(fd: int) -> int:
        calls.append("syncfs")
        return real_syncfs(fd)

    def counting_fsync_all(paths: list[Any], threads: int = 4) -> None:
        fsynced.extend(str(p) for p in paths)
        real_fsync_all(paths, threads)

    monkeypatch.setattr(chunkstore, "_SYNCFS", counting_syncfs)
    monkeypatch.setattr(chunkstore, "_fsync_all", counting_fsync_all)
    # another job's unflushed gigabytes, or nothing but this save's own chunks
    monkeypatch.setattr(chunkstore, "dirty_bytes", lambda: (8 << 30) if foreign_dirty else 4096)
    root = tmp_path / "root"
    with tg.CheckpointManager(root, async_save=False) as mgr:  # durability="auto" is the default
        commit_save(mgr, 1, make_state(1))
    state = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 1
    assert_state_is(state, 1)
    assert verify(root).ok
    n_chunks = len(chunk_files(root))
    if foreign_dirty:  # every chunk fsynced on its own, no syncfs
        assert calls == [] and len(fsynced) == n_chunks and n_chunks > 1
        assert all(p.endswith(".tmp") for p in fsynced)  # before the rename: never visible unflushed
    else:
        assert calls == ["syncfs", "syncfs"] and fsynced == []


def test_auto_a_failed_per_file_fsync_makes_no_chunk_visible(tmp_path, monkeypatch):
    root = tmp_path / "root"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        commit_save(mgr, 1, make_state(1))
        before = chunk_files(root)

        def failing_fsync_all(paths: list[Any], threads: int = 4) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(chunkstore, "dirty_bytes", lambda: 8 << 30)
        monkeypatch.setattr(chunkstore, "_fsync_all", failing_fsync_all)
        with pytest.raises(tg.errors.SaveError, match="Input/output error"):
            commit_save(mgr, 2, make_state(2))
        assert chunk_files(root) == before, "a chunk of the failed save became visible under chunks/"
        assert not manifest_path(root, 2).exists()
        monkeypatch.undo()
        commit_save(mgr, 2, make_state(2))
    assert verify(root).ok
    assert chunk_files(root) == referenced_chunks(root, [1, 2]), "the failed save left orphan chunks"


def test_dirty_bytes_reads_dirty_and_writeback_of_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       24641536 kB\nDirty:              1024 kB\nWriteback:           512 kB\n"
    )
    assert chunkstore.dirty_bytes(meminfo) == 1536 * 1024
    meminfo.write_text("MemTotal:       24641536 kB\n")
    assert chunkstore.dirty_bytes(meminfo) is None
    assert chunkstore.dirty_bytes(tmp_path / "missing") is None


@pytest.mark.parametrize("durability", ["batched", "per_file", "auto"])
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
        if durability != "per_file":  # per_file chunks are in place once written; the others' only after it
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


@pytest.mark.parametrize(
    ("node_writers", "dirty_shares", "syncfs"),
    [(1, 1, True), (1, 4, False), (4, 4, True), (4, 5, False), (2, 4, False)],
)
def test_auto_counts_the_other_ranks_on_the_node_as_the_saves_own(
    tmp_path, monkeypatch, node_writers, dirty_shares, syncfs
):
    """The ranks of one job on a node write their shares of a save at once: with 4 ranks the node holds ~4
    times one rank's files, none of it foreign, and auto keeps syncfs; more than that is another writer's."""
    if chunkstore._SYNCFS is None:
        pytest.skip("no syncfs(2) on this platform")
    storage = LocalStorage(tmp_path, durability="auto")
    storage.node_writers = node_writers
    (tmp_path / "staging").mkdir()
    staged = [
        storage.stage(f"chunks/aa/{i:032x}", memoryview(bytes(4096)), staging="staging") for i in range(2)
    ]
    own = 2 * 4096
    monkeypatch.setattr(chunkstore, "dirty_bytes", lambda: own * dirty_shares)
    assert storage._flush_with_syncfs(staged) is syncfs
    storage.discard_staged(staged)
