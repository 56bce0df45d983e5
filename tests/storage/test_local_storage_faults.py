"""LocalStorage under real failures, and the faults FaultyStorage injects (byte budget, transient errnos).

A real failing write comes from ``RLIMIT_FSIZE`` in a child process (a write past the limit fails with EFBIG,
SIGXFSZ ignored), so LocalStorage's own clean-up is exercised without patching it. A failing ``syncfs(2)`` can
only be simulated by replacing the module's libc function (no seam reaches a syscall).
"""

from __future__ import annotations

import ctypes
import errno
import math
from pathlib import Path

import pytest

from tests.conftest import run_with_file_size_limit
from trainguard.errors import StorageFullError, TransientStorageError
from trainguard.storage import Fault, FaultyStorage, LocalStorage
from trainguard.storage import local as local_mod
from trainguard.storage.local import TRANSIENT_ERRNOS, classify_error

CHILD = r"""
import sys
from trainguard.storage import LocalStorage
s = LocalStorage(sys.argv[1])
big = b"x" * (256 << 10)
for call in ("publish", "write_new", "stage"):
    try:
        if call == "publish":
            s.publish("old", big)
        elif call == "write_new":
            s.write_new("new", big)
        else:
            s.make_dir("partial")
            s.stage("chunks/ab/c", big, staging="partial")
    except OSError as e:
        print(call, e.errno)
    else:
        print(call, "ok")
"""


def test_a_write_that_fails_half_way_leaves_no_partial_object_and_the_old_one_intact(tmp_path: Path) -> None:
    (tmp_path / "old").write_bytes(b"committed")
    p = run_with_file_size_limit(CHILD, [str(tmp_path)], 64 << 10)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [
        "publish",
        str(errno.EFBIG),
        "write_new",
        str(errno.EFBIG),
        "stage",
        str(errno.EFBIG),
    ]
    assert (tmp_path / "old").read_bytes() == b"committed"  # publish is atomic: the old object stays
    assert not (tmp_path / "new").exists()  # write_new leaves nothing at the key
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["old"]  # no temporary file left


@pytest.mark.skipif(local_mod._SYNCFS is None, reason="no syncfs(2) on this platform")
def test_a_failed_syncfs_makes_no_staged_object_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def eio(fd: int) -> int:
        ctypes.set_errno(errno.EIO)
        return -1

    s = LocalStorage(tmp_path, durability="batched")  # always syncfs (auto may fsync each file instead)
    s.make_dir("partial")
    staged = [s.stage(f"chunks/ab/{i}", b"data", staging="partial") for i in range(3)]
    monkeypatch.setattr(local_mod, "_SYNCFS", eio)
    with pytest.raises(OSError) as ei:
        s.commit_staged(staged)
    assert ei.value.errno == errno.EIO
    assert not any(s.exists(x.key) for x in staged)
    monkeypatch.undo()
    s.commit_staged(staged)
    assert [s.read(x.key, limit_bytes=10) for x in staged] == [b"data"] * 3


@pytest.mark.parametrize("code", sorted(TRANSIENT_ERRNOS))
def test_transient_errnos_become_transient_storage_errors(code: int) -> None:
    err = classify_error(OSError(code, "x"), "/r/chunks/ab/c")
    assert isinstance(err, TransientStorageError) and isinstance(err, OSError)
    assert err.errno == code and err.filename == "/r/chunks/ab/c"
    assert "retried" in str(err)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.ENOENT])
def test_other_errnos_stay_what_they_were(code: int) -> None:
    e = OSError(code, "x")
    assert classify_error(e, "p") is e
    assert isinstance(classify_error(OSError(errno.ENOSPC, "x"), "p"), StorageFullError)


def test_an_injected_transient_error_is_classified_like_the_backend_does(tmp_path: Path) -> None:
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("read", match="k", errno=errno.ETIMEDOUT))
    disk.publish("k", b"v")
    with pytest.raises(TransientStorageError) as ei:
        disk.read("k", limit_bytes=10)
    assert ei.value.errno == errno.ETIMEDOUT
    assert disk.read("k", limit_bytes=10) == b"v"  # times=1: the retry succeeds
    assert disk.injected == [("read", "k", f"errno {errno.ETIMEDOUT}")]


def test_a_byte_budget_holds_that_many_bytes_then_the_disk_is_full(tmp_path: Path) -> None:
    budget = Fault("write", match="chunks/*", budget_bytes=10)
    disk = FaultyStorage(LocalStorage(tmp_path), budget)
    disk.make_dir("chunks")
    disk.write_new("chunks/a", b"123456")
    disk.publish("manifest", b"x" * 100)  # not matched: not counted
    with pytest.raises(StorageFullError) as ei:
        disk.write_new("chunks/b", [memoryview(b"1234"), memoryview(b"5")])  # 6 + 5 > 10
    assert ei.value.errno == errno.ENOSPC and isinstance(ei.value.__cause__, OSError)
    assert not (tmp_path / "chunks" / "b").exists()
    disk.write_new("chunks/c", b"1234")  # exactly fits
    assert budget.written == 10
    budget.budget_bytes = math.inf  # space freed
    disk.write_new("chunks/b", b"12345")
    assert budget.written == 15 and [i[1] for i in disk.injected] == ["chunks/b"]


def test_a_call_probe_sees_the_store_when_the_nth_write_starts(tmp_path: Path) -> None:
    seen: list[list[str]] = []
    disk = FaultyStorage(
        LocalStorage(tmp_path),
        Fault("write", nth=2, call=lambda key: seen.append(sorted(p.name for p in tmp_path.iterdir()))),
    )
    disk.write_new("a", b"1")
    disk.write_new("b", b"2")
    disk.write_new("c", b"3")
    assert seen == [["a"]]
    with pytest.raises(ValueError, match="budget_bytes"):
        Fault("read", budget_bytes=1)
