"""The Storage protocol: one conformance suite for every backend (LocalStorage, and FaultyStorage wrapping it
with no fault), plus the faults FaultyStorage injects."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.errors import StorageFullError, UnsafeFileError
from trainguard.storage import Fault, FaultyStorage, LocalStorage, Storage


@pytest.fixture(params=["local", "faulty-local"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    root = tmp_path / "root"
    root.mkdir()
    local = LocalStorage(root)
    return local if request.param == "local" else FaultyStorage(local)


def test_each_backend_satisfies_the_protocol(storage: Storage) -> None:
    assert isinstance(storage, Storage)


@pytest.mark.parametrize("durability", ["batched", "per_file"])
def test_staged_objects_become_visible_only_at_the_commit(tmp_path: Path, durability: str) -> None:
    s = LocalStorage(tmp_path, durability=durability)
    s.make_dir("step-1.partial-x")
    staged = s.stage(
        "chunks/ab/obj", [memoryview(b"hello "), memoryview(b"world")], staging="step-1.partial-x"
    )
    assert s.exists("chunks/ab/obj") == (durability == "per_file")
    s.commit_staged([staged])
    assert s.read("chunks/ab/obj", limit_bytes=100) == b"hello world"
    info = s.stat("chunks/ab/obj")
    assert info is not None and info.is_file and info.size == 11


def test_write_read_list_delete_round_trip(storage: Storage) -> None:
    storage.make_dir("d")
    storage.write_new("d/a", b"0123456789")
    with pytest.raises(FileExistsError):
        storage.write_new("d/a", b"x")
    storage.publish("d/m.json", b"{}")
    storage.publish("d/m.json", b'{"v": 2}')  # replaces atomically
    assert storage.read("d/m.json", limit_bytes=100) == b'{"v": 2}'
    out = bytearray(4)
    assert storage.read_range("d/a", 3, memoryview(out)) == 4 and bytes(out) == b"3456"
    assert storage.read_range("d/a", 8, memoryview(out)) == 2  # short at the end
    f, info = storage.open_read("d/a")
    with f:
        assert f.read() == b"0123456789" and info.size == 10
    assert sorted(e.name for e in storage.list("d")) == ["a", "m.json"]
    assert [e.is_dir for e in storage.list("")] == [True]
    assert storage.list("missing") == [] and storage.stat("missing") is None
    assert storage.move("d/a", "d/b") and not storage.move("d/a", "d/c")
    assert storage.delete("d/b") and not storage.delete("d/b")
    storage.delete_prefix("d")
    assert not storage.exists("d")


def test_a_read_is_bounded_and_never_follows_a_symlink(storage: Storage, tmp_path: Path) -> None:
    storage.write_new("big", b"x" * 100)
    with pytest.raises(UnsafeFileError, match="more than the 10 bytes"):
        storage.read("big", limit_bytes=10)
    (tmp_path / "root" / "link").symlink_to(tmp_path / "root" / "big")
    with pytest.raises(UnsafeFileError, match="symlink"):
        storage.read("link", limit_bytes=1000)
    info = storage.stat("link")
    assert info is not None and info.kind == "symlink"


def test_the_nth_write_fails_with_its_errno_and_enospc_is_storage_full(tmp_path: Path) -> None:
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("write", match="x*", nth=2, errno=errno.ENOSPC))
    disk.write_new("x1", b"a")
    with pytest.raises(StorageFullError) as ei:
        disk.write_new("x2", b"b")
    assert ei.value.errno == errno.ENOSPC and not (tmp_path / "x2").exists()
    disk.write_new("x3", b"c")  # times=1: only the second
    assert disk.injected == [("write", "x2", f"errno {errno.ENOSPC}")]


def test_a_truncated_write_and_a_flipped_read_are_what_they_say(tmp_path: Path) -> None:
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("write", truncate_to=3), Fault("read", flip_byte=1))
    disk.write_new("o", b"abcdef")
    assert (tmp_path / "o").read_bytes() == b"abc"
    assert disk.read("o", limit_bytes=10) == b"acc"  # b ^ 1 == c
    assert disk.read("o", limit_bytes=10) == b"abc"  # the fault fired once


def test_a_stalled_write_waits_for_its_event(tmp_path: Path) -> None:
    go = threading.Event()
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("write", stall=go))
    t = threading.Thread(target=disk.write_new, args=("o", b"data"))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not (tmp_path / "o").exists()
    go.set()
    t.join()
    assert (tmp_path / "o").read_bytes() == b"data"


def test_a_manager_saves_through_a_faulty_storage_and_a_failed_manifest_commits_nothing(
    tmp_path: Path,
) -> None:
    import torch

    disk = FaultyStorage(LocalStorage(tmp_path / "root"))
    state = {"w": torch.arange(10.0)}
    with tg.CheckpointManager(disk, async_save=False) as mgr:
        mgr.save(1, state)
        disk.add(Fault("write", match="*/manifest.json", errno=errno.EIO))
        with pytest.raises(tg.SaveError, match="Input/output error"):
            mgr.save(2, state)
        assert [(c.step, c.status) for c in mgr.checkpoints()] == [(1, "valid")]
    assert disk.calls["write"] >= 3 and disk.injected[-1][1] == "step-000000002/manifest.json"
