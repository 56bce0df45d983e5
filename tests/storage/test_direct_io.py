"""Chunk files written around the page cache (``direct_io``, ``O_DIRECT``): exact bytes at every size around the
alignment and bounce-buffer boundaries, O_DIRECT really set on the descriptor while the bytes are written, the
fall-back to the page cache where the filesystem refuses direct I/O (when it is set, or at a write), a real
failing write (``RLIMIT_FSIZE``) leaving nothing behind, and a manager's save and restore with it on and off.
Aligned memory (staging buffers, packed chunks) is written from itself, without the bounce copy, and falls
back to it where the kernel refuses that memory (EFAULT, a real device-mapped mapping where the kernel offers
one).

A filesystem that refuses ``O_DIRECT`` cannot be mounted in a test, so that refusal is simulated by making
``fcntl`` or one ``write`` fail with EINVAL, exactly as the kernel reports it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainguard
from tests.conftest import run_with_file_size_limit
from trainguard.integrity.verify import verify
from trainguard.storage import LocalStorage
from trainguard.storage import local as local_mod
from trainguard.storage.local import (
    DIRECT_IO_ALIGN,
    DIRECT_IO_BLOCK_BYTES,
    DIRECT_IO_MIN_BYTES,
    direct_io_supported,
    write_file,
)

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")

B = DIRECT_IO_BLOCK_BYTES
SIZES = [0, 1, DIRECT_IO_ALIGN - 1, DIRECT_IO_ALIGN, DIRECT_IO_ALIGN + 1, B - 1, B, B + 1, 2 * B + 12345]


@pytest.fixture
def direct_fs(tmp_path: Path) -> Path:
    """``tmp_path``, when its filesystem takes ``O_DIRECT`` (tests that check it was set skip otherwise: an
    overlay or FUSE mount may refuse it, and the fall-back has its own tests)."""
    if not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    return tmp_path


def _flags_while_writing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the file status flags of every descriptor ``local``'s ``os.write`` is called with (from
    /proc/self/fdinfo, as the kernel holds them at that moment)."""
    seen: list[int] = []
    real = os.write

    def write(fd: int, data: Any) -> int:
        seen.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        return real(fd, data)

    monkeypatch.setattr(local_mod.os, "write", write)
    return seen


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_write_holds_exactly_the_bytes_given(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    parts = [memoryview(data[: size // 3]), data[size // 3 : size // 2], bytearray(data[size // 2 :])]
    p = tmp_path / "f"
    write_file(p, parts, direct=True)
    assert p.stat().st_size == size  # the padded last block was cut back
    assert p.read_bytes() == data


def test_a_direct_write_sets_o_direct_on_every_write_and_takes_any_buffer_format(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = direct_fs
    t = torch.randn(3 * B // 4 + 5)  # float32: a memoryview of format "f"
    seen = _flags_while_writing(monkeypatch)
    write_file(tmp_path / "f", memoryview(t.numpy()), direct=True)
    assert seen and all(f & os.O_DIRECT for f in seen)
    assert (tmp_path / "f").read_bytes() == t.numpy().tobytes()
    seen.clear()
    write_file(tmp_path / "g", memoryview(t.numpy()))  # the default: through the page cache
    assert seen and not any(f & os.O_DIRECT for f in seen)


def test_without_direct_io_on_the_filesystem_the_file_is_written_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fcntl.fcntl

    def refuse(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what ext4 data=journal or a FUSE mount says
        return real(fd, cmd, arg)

    monkeypatch.setattr(local_mod.fcntl, "fcntl", refuse)
    seen = _flags_while_writing(monkeypatch)
    data = os.urandom(B + 100)
    write_file(tmp_path / "f", [data], direct=True)
    assert seen and not any(f & os.O_DIRECT for f in seen)
    assert (tmp_path / "f").read_bytes() == data


def test_a_write_refused_with_einval_is_done_again_through_the_page_cache(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp_path = direct_fs
    real = os.write
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        calls.append(flags)
        if flags & os.O_DIRECT and len(calls) == 2:  # the second block: e.g. a device wanting 64 KiB
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(local_mod.os, "write", write)
    data = os.urandom(2 * B + 777)
    write_file(tmp_path / "f", [data], direct=True)
    assert [bool(f & os.O_DIRECT) for f in calls] == [True, True, False, False]  # refused one, then buffered
    assert (tmp_path / "f").stat().st_size == len(data)  # no padding: the tail was written as it is
    assert (tmp_path / "f").read_bytes() == data


def test_another_write_error_is_raised_not_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eio(fd: int, data: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local_mod.os, "write", eio)
    with pytest.raises(OSError) as ei:
        write_file(tmp_path / "f", [b"x" * (B + 1)], direct=True)
    assert ei.value.errno == errno.EIO


def test_stage_writes_large_objects_direct_and_small_ones_and_everything_when_off_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, bool]] = []
    real = local_mod.write_file

    def spy(path: Path, data: Any, *, fsync: bool = True, direct: bool = False) -> None:
        calls.append((Path(path).name.split(".")[0], direct))
        real(path, data, fsync=fsync, direct=direct)

    monkeypatch.setattr(local_mod, "write_file", spy)
    for direct_io in (True, False):
        s = LocalStorage(tmp_path / str(direct_io), direct_io=direct_io)
        s.make_dir("partial")
        big, small = os.urandom(DIRECT_IO_MIN_BYTES), os.urandom(DIRECT_IO_MIN_BYTES - 1)
        staged = [
            s.stage("chunks/ab/big", big, staging="partial"),
            s.stage("chunks/ab/small", [memoryview(small)], staging="partial"),
        ]
        s.commit_staged(staged)
        assert s.read("chunks/ab/big", limit_bytes=len(big)) == big
        assert s.read("chunks/ab/small", limit_bytes=len(small)) == small
    assert calls == [("big", True), ("small", False), ("big", False), ("small", False)]


CHILD = r"""
import sys
from trainguard.storage import LocalStorage
s = LocalStorage(sys.argv[1])
s.make_dir("partial")
try:
    s.stage("chunks/ab/c", b"x" * (3 << 20), staging="partial")
except OSError as e:
    print("stage", e.errno)
else:
    print("stage ok")
"""


def test_a_direct_write_that_fails_half_way_leaves_no_partial_file(tmp_path: Path) -> None:
    p = run_with_file_size_limit(CHILD, [str(tmp_path)], 1 << 20)  # EFBIG past 1 MiB
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["stage", str(errno.EFBIG)]
    assert [q for q in tmp_path.rglob("*") if q.is_file()] == []


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_manager_saves_and_restores_bit_exact_with_direct_io_on_and_off(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch, direct_io: bool
) -> None:
    tmp_path = direct_fs
    seen = _flags_while_writing(monkeypatch)
    torch.manual_seed(0)
    state = {
        "w": torch.randn(1 << 20),  # 4 MiB: direct when on
        "h": torch.randn(1000, 333).to(torch.bfloat16),  # an odd length
        "b": torch.randn(7),  # small: packed, through the page cache
    }
    with trainguard.CheckpointManager(tmp_path, direct_io=direct_io) as m:
        m.save(1, {"model": state})
        m.wait()
    assert any(f & os.O_DIRECT for f in seen) is direct_io
    got = {k: torch.zeros_like(v) for k, v in state.items()}
    assert trainguard.CheckpointManager(tmp_path, read_only=True).restore(1, {"model": got}) == 1
    for k, v in state.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
    assert verify(tmp_path).ok


def test_bounce_buffers_are_reused_by_later_threads_and_are_private_to_a_forked_child(tmp_path: Path) -> None:
    import threading

    pool = local_mod._BOUNCE
    pool.release(pool.acquire())  # at least one kept
    kept = len(pool._free)
    for i in range(3):  # a save's writer threads are new threads every save
        th = threading.Thread(
            target=write_file, args=(tmp_path / f"f{i}", b"y" * (B + 1)), kwargs={"direct": True}
        )
        th.start()
        th.join()
    assert len(pool._free) == kept  # taken and given back: no new buffer per thread
    view, arr = pool.acquire()
    try:
        arr[:4] = 1
        pid = os.fork()
        if pid == 0:  # the child: its own copy of the memory and an empty pool
            code = 0 if pool._free == [] else 3
            arr[:4] = 0x55
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert bytes(view[:4]) == b"\x01" * 4  # the child's write did not reach the parent's buffer
    finally:
        pool.release((view, arr))


CHILD_EXACT = r"""
import sys
from pathlib import Path
from trainguard.storage.local import write_file
n = int(sys.argv[2])
write_file(Path(sys.argv[1]) / "f", b"z" * n, direct=True)
print("ok")
"""


def test_a_file_that_fits_its_size_limit_exactly_is_written_also_when_the_padding_would_not_fit(
    tmp_path: Path,
) -> None:
    n = 3 * (1 << 20) + 100  # the padded last block would pass the limit: the kernel cuts that write short
    p = run_with_file_size_limit(CHILD_EXACT, [str(tmp_path), str(n)], n)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], p.stderr[-2000:]
    assert (tmp_path / "f").read_bytes() == b"z" * n


@pytest.mark.parametrize("bad", ["no", "yes", 1, None])
def test_a_direct_io_that_is_not_a_bool_is_refused_not_guessed(tmp_path: Path, bad: Any) -> None:
    from trainguard.errors import ConfigError

    with pytest.raises(ValueError, match="direct_io must be True or False"):
        LocalStorage(tmp_path, direct_io=bad)
    with pytest.raises(ConfigError, match="direct_io must be True or False"):
        trainguard.CheckpointManager(tmp_path / "root", direct_io=bad)
    assert not (tmp_path / "root").exists()  # refused before anything was created


# -- memory that is aligned already (staging buffers, packed chunks) is written without the bounce copy ------
def _count_bounce(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record every bounce buffer taken from the pool (one per direct write that had bytes to copy)."""
    taken: list[int] = []
    pool = local_mod._BOUNCE
    real = pool.acquire

    def acquire() -> tuple[memoryview, Any]:
        taken.append(1)
        return real()

    monkeypatch.setattr(pool, "acquire", acquire)
    return taken


def _aligned_random(size: int) -> Any:
    """``size`` random bytes in memory from ``aligned_empty`` (the no-copy path's source)."""
    src = local_mod.aligned_empty(size)
    src[:] = np.frombuffer(os.urandom(size), dtype=np.uint8)
    return src


@pytest.mark.parametrize("size", [1, DIRECT_IO_ALIGN, B, 2 * B + 12345])
def test_aligned_empty_starts_on_the_alignment_and_holds_size_bytes(size: int) -> None:
    a = local_mod.aligned_empty(size)
    assert a.ctypes.data % DIRECT_IO_ALIGN == 0
    assert a.nbytes == size and a.flags.c_contiguous and a.flags.writeable


@pytest.mark.parametrize("size", [DIRECT_IO_ALIGN, B, 3 * B, 2 * B + 5 * DIRECT_IO_ALIGN])
def test_aligned_memory_is_written_as_it_is_with_o_direct_and_no_bounce_buffer(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    src = _aligned_random(size)
    taken = _count_bounce(monkeypatch)
    seen = _flags_while_writing(monkeypatch)
    write_file(direct_fs / "f", memoryview(src), direct=True)
    assert taken == []  # no copy: the kernel read the buffer itself
    assert seen and all(f & os.O_DIRECT for f in seen)
    assert len(seen) == -(-size // B)  # DIRECT_IO_BLOCK_BYTES per write, as through the bounce buffer
    assert (direct_fs / "f").read_bytes() == src.tobytes()


@pytest.mark.parametrize("tail", [1, DIRECT_IO_ALIGN - 1])
def test_aligned_memory_with_a_partial_last_block_copies_only_that_block(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch, tail: int
) -> None:
    size = B + 3 * DIRECT_IO_ALIGN + tail
    src = _aligned_random(size)
    copied: list[int] = []
    real_copyto = np.copyto

    def copyto(dst: Any, s: Any) -> None:
        copied.append(len(s))
        real_copyto(dst, s)

    monkeypatch.setattr(np, "copyto", copyto)
    taken = _count_bounce(monkeypatch)
    # an unaligned buffer after it goes through the bounce buffer too, in order
    more = os.urandom(5000)
    write_file(direct_fs / "f", [memoryview(src), more], direct=True)
    assert taken == [1] and copied == [tail, len(more)]
    assert (direct_fs / "f").stat().st_size == size + len(more)
    assert (direct_fs / "f").read_bytes() == src.tobytes() + more


def test_aligned_memory_refused_with_einval_half_way_is_finished_through_the_page_cache(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 3 * B + 100
    src = _aligned_random(size)
    real = os.write
    calls: list[int] = []

    def write(fd: int, data: Any) -> int:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        calls.append(flags)
        if flags & os.O_DIRECT and len(calls) == 2:
            raise OSError(errno.EINVAL, "Invalid argument")
        if flags & os.O_DIRECT and len(data) > DIRECT_IO_ALIGN:  # and a short write of whole blocks first
            return real(fd, memoryview(data)[:DIRECT_IO_ALIGN])
        return real(fd, data)

    monkeypatch.setattr(local_mod.os, "write", write)
    write_file(direct_fs / "f", memoryview(src), direct=True)
    assert [bool(f & os.O_DIRECT) for f in calls[:3]] == [True, True, False]
    assert not any(f & os.O_DIRECT for f in calls[2:])
    assert (direct_fs / "f").stat().st_size == size
    assert (direct_fs / "f").read_bytes() == src.tobytes()


def test_an_async_save_writes_its_staging_buffers_and_a_sync_save_its_packs_without_a_bounce_copy(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    big = {"w": torch.randn(1 << 20), "v": torch.randn(3, 1 << 19).to(torch.bfloat16)}  # 4 and 3 MiB
    small = {f"b{i}": torch.randn(1 << 16) for i in range(16)}  # 16 x 256 KiB: one 4 MiB pack
    taken = _count_bounce(monkeypatch)
    with trainguard.CheckpointManager(direct_fs / "async", direct_io=True, keep=None) as m:
        m.save(1, {"model": big})
        m.wait()
        for buf in m._stager.sets[0].buffers.values():  # noqa: SLF001 - the buffers written
            assert buf.data_ptr() % DIRECT_IO_ALIGN == 0
    with trainguard.CheckpointManager(direct_fs / "sync", direct_io=True, async_save=False) as m:
        m.save(1, {"model": small})
    assert taken == []
    for root, state in (("async", big), ("sync", small)):
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        assert trainguard.CheckpointManager(direct_fs / root, read_only=True).restore(1, {"model": got}) == 1
        for k, v in state.items():
            assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        assert verify(direct_fs / root).ok


@pytest.mark.parametrize("after_blocks", [0, 1])
def test_aligned_memory_the_kernel_refuses_for_direct_io_is_copied_from_there_on(
    direct_fs: Path, monkeypatch: pytest.MonkeyPatch, after_blocks: int
) -> None:
    size = 3 * B + 100
    src = _aligned_random(size)
    lo, hi = src.ctypes.data, src.ctypes.data + size
    real = os.write
    own_writes: list[int] = []

    def write(fd: int, data: Any) -> int:
        addr = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8).ctypes.data
        if lo <= addr < hi:  # straight from the source's memory, as from device-mapped host memory
            own_writes.append(len(data))
            if len(own_writes) > after_blocks:
                raise OSError(errno.EFAULT, "Bad address")
        return real(fd, data)

    monkeypatch.setattr(local_mod.os, "write", write)
    taken = _count_bounce(monkeypatch)
    seen = _flags_while_writing(monkeypatch)  # wraps the refusing write: every call, O_DIRECT kept on
    write_file(direct_fs / "f", memoryview(src), direct=True)
    assert len(own_writes) == after_blocks + 1 and taken == [1]
    assert all(f & os.O_DIRECT for f in seen)
    assert (direct_fs / "f").stat().st_size == size
    assert (direct_fs / "f").read_bytes() == src.tobytes()


def _device_mapped_bytes(nbytes: int) -> Any:
    """``nbytes`` of page-aligned, readable memory the kernel cannot pin for direct I/O: the data pages of a
    perf ring buffer (a ``VM_PFNMAP`` mapping, as accelerator host memory such as ``aclrtMallocHost`` or a
    u-dma-buf is); skips where ``perf_event_open`` is unavailable."""
    import ctypes
    import mmap
    import platform
    import struct

    if platform.machine() != "x86_64" or not sys.platform.startswith("linux"):
        pytest.skip("perf_event_open's syscall number is known here for x86_64 Linux only")
    libc = ctypes.CDLL(None, use_errno=True)
    attr = bytearray(128)
    struct.pack_into("IIQ", attr, 0, 1, 128, 9)  # PERF_TYPE_SOFTWARE, its size, PERF_COUNT_SW_DUMMY
    struct.pack_into("Q", attr, 40, 1 | 1 << 5 | 1 << 6)  # disabled, exclude kernel and hypervisor
    fd = libc.syscall(298, (ctypes.c_char * 128).from_buffer(attr), 0, -1, -1, 0)
    if fd < 0:
        pytest.skip(f"perf_event_open refused here (errno {ctypes.get_errno()})")
    pages = nbytes // mmap.PAGESIZE
    try:
        m = mmap.mmap(fd, (1 + pages) * mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    except OSError as e:  # over perf_event_mlock_kb without CAP_IPC_LOCK: EPERM
        pytest.skip(f"a {nbytes} B perf ring buffer cannot be mapped here ({e})")
    finally:
        os.close(fd)
    return memoryview(m)[mmap.PAGESIZE :]


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_save_of_a_tensor_over_device_mapped_memory_succeeds(direct_fs: Path) -> None:
    mem = _device_mapped_bytes(2 << 20)
    t = torch.frombuffer(mem, dtype=torch.uint8)  # read-only, aligned: taken for the no-copy path
    assert t.data_ptr() % DIRECT_IO_ALIGN == 0
    with pytest.raises(OSError) as ei:  # what the kernel says to a direct write from it
        fd = os.open(direct_fs / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            os.write(fd, mem[: 1 << 20])
        finally:
            os.close(fd)
    assert ei.value.errno == errno.EFAULT
    with trainguard.CheckpointManager(direct_fs / "root", async_save=False) as m:
        m.save(1, {"model": {"buf": t}})
    got = {"buf": torch.ones_like(t)}
    assert trainguard.CheckpointManager(direct_fs / "root", read_only=True).restore(1, {"model": got}) == 1
    assert torch.equal(got["buf"], t)
    assert verify(direct_fs / "root").ok
