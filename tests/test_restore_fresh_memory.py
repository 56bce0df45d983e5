"""A restore into fresh memory (a relaunched job's new tensors) maps each block's pages in one
``madvise(MADV_POPULATE_WRITE)`` before the read fills it, instead of one page fault per 4 KiB page; memory
already there is left alone; a kernel without the advice falls back to the plain read. Bytes are never changed
by it: every restore below is compared bit for bit."""

from __future__ import annotations

import ctypes
import errno
import sys

import pytest
import torch

import trainguard as tg
import trainguard.incremental.chunkstore as chunkstore
from trainguard import _prefault

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise: Linux only")

NUMEL = 12 << 20  # 48 MiB of float32: above glibc's largest mmap threshold (32 MiB), so fresh when allocated


def view_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


def test_a_new_tensor_is_unmapped_until_touched_and_populating_it_keeps_its_bytes():
    fresh = torch.empty(NUMEL)
    assert _prefault.unmapped(view_of(fresh))
    assert _prefault.populate_for_write(view_of(fresh)[: 1 << 20])
    # the populated megabyte is resident now; the rest of the tensor is still fresh (from 4 MiB on: with
    # transparent huge pages "always", the call may have mapped the whole 2 MiB page around that megabyte)
    assert not _prefault.unmapped(view_of(fresh)[: 1 << 20])
    assert _prefault.unmapped(view_of(fresh)[4 << 20 :])
    touched = torch.arange(NUMEL, dtype=torch.float32)
    before = touched.clone()
    assert not _prefault.unmapped(view_of(touched))
    assert _prefault.populate_for_write(view_of(touched))  # allowed on resident memory: changes nothing
    assert torch.equal(touched, before)
    assert not _prefault.unmapped(memoryview(b"x" * 65536))  # read-only: never populated
    assert not _prefault.unmapped(view_of(torch.empty(16)))  # under two pages: not worth a call


@pytest.fixture
def calls(monkeypatch):
    seen: list[int] = []
    real = chunkstore.populate_for_write

    def spy(view: memoryview) -> bool:
        seen.append(len(view))
        return real(view)

    monkeypatch.setattr(chunkstore, "populate_for_write", spy)
    return seen


def saved(tmp_path, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(NUMEL, generator=g) for i in range(n)}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"m": state})
    return state


@pytest.mark.parametrize("verify", [True, False])
def test_a_restore_into_new_tensors_populates_block_by_block_and_is_bit_exact(tmp_path, calls, verify):
    state = saved(tmp_path)
    live = {k: torch.empty(NUMEL) for k in state}
    tg.CheckpointManager(tmp_path, read_only=True, verify_before_load=verify).restore(1, {"m": live})
    assert all(torch.equal(live[k].view(torch.int32), state[k].view(torch.int32)) for k in state)
    # every block of every tensor, each at most one CRC block (the populated range stays in the CPU cache)
    assert sum(calls) == sum(t.numel() * 4 for t in state.values())
    assert max(calls) <= chunkstore.CRC_BLOCK_BYTES


def test_a_restore_into_touched_tensors_does_not_populate(tmp_path, calls):
    state = saved(tmp_path)
    live = {k: torch.zeros(NUMEL) for k in state}
    tg.CheckpointManager(tmp_path, read_only=True).restore(1, {"m": live})
    assert calls == []
    assert all(torch.equal(live[k], state[k]) for k in state)


def test_a_kernel_without_the_advice_turns_it_off_and_the_restore_reads_as_before(tmp_path, monkeypatch):
    state = saved(tmp_path)
    libc = _prefault._open_libc()

    class OldKernel:  # madvise(MADV_POPULATE_WRITE) before Linux 5.14: EINVAL
        calls = 0

        def madvise(self, *args):
            OldKernel.calls += 1
            ctypes.set_errno(errno.EINVAL)
            return -1

        def __getattr__(self, name):
            return getattr(libc, name)

    monkeypatch.setattr(_prefault, "_open_libc", OldKernel)
    monkeypatch.setattr(_prefault, "_libc", None)
    monkeypatch.setattr(_prefault, "_enabled", True)
    live = {k: torch.empty(NUMEL) for k in state}
    tg.CheckpointManager(tmp_path, read_only=True).restore(1, {"m": live})
    assert all(torch.equal(live[k], state[k]) for k in state)
    assert OldKernel.calls == 1 and _prefault._enabled is False  # the probe, then off for the process


def test_a_range_the_kernel_refuses_leaves_the_feature_on_for_the_next(monkeypatch):
    """EINVAL on one destination (read-only or I/O memory) says nothing about the kernel: the feature stays on."""
    libc = _prefault._load()
    refused: list[int] = []

    class RefusesOnce:
        def madvise(self, *args):
            if not refused:
                refused.append(1)
                ctypes.set_errno(errno.EINVAL)
                return -1
            return libc.madvise(*args)

        def __getattr__(self, name):
            return getattr(libc, name)

    monkeypatch.setattr(_prefault, "_libc", RefusesOnce())
    assert not _prefault.populate_for_write(view_of(torch.empty(NUMEL)))
    assert _prefault._enabled is True
    fresh = torch.empty(NUMEL)
    assert _prefault.populate_for_write(view_of(fresh)) and not _prefault.unmapped(view_of(fresh))


def test_the_memory_maps_snapshot_knows_read_only_mappings():
    import mmap

    import numpy as np

    ro = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    ro_addr = np.frombuffer(ro, dtype=np.uint8).__array_interface__["data"][0]
    rw = torch.empty(NUMEL)
    maps = _prefault.MemoryMaps()
    assert maps.read_only(ro_addr, 1 << 16) and maps.read_only(ro_addr + 100, 1)
    assert maps.read_only(ro_addr + (1 << 16) - 1, 10)  # runs past its end: still overlaps it
    assert not maps.read_only(rw.data_ptr(), rw.nbytes)
    empty = _prefault.MemoryMaps.__new__(_prefault.MemoryMaps)
    empty.starts, empty.ends, empty.write = [], [], []  # no /proc/self/maps: nothing is reported
    assert not empty.read_only(ro_addr, 1)
    ro.close()


SMALL_AND_LARGE = """
import sys, warnings, numpy as np, torch, trainguard as tg
warnings.simplefilter("ignore")
root, f, compression = sys.argv[1], sys.argv[2], sys.argv[3]
with tg.CheckpointManager(root, async_save=False, compression=compression) as mgr:
    mgr.save(1, {"m": {"small": torch.randn(1000), "large": torch.randn(1 << 20)}})
np.zeros(1 << 20, dtype=np.float32).tofile(f)
live = {"small": torch.from_numpy(np.memmap(f, dtype="float32", mode="r", shape=(1000,))),
        "large": torch.zeros(1 << 20)}
try:
    tg.CheckpointManager(root, read_only=True).restore(1, {"m": live})
    print("loaded")
except tg.StateMismatchError as e:
    print("refused", "m.small: the live tensor is on read-only memory" in str(e), "Nothing was loaded" in str(e),
          bool((live["large"] == 0).all()))
"""


@pytest.mark.parametrize("compression", ["off", "zstd"])
def test_a_read_only_destination_is_refused_before_anything_is_written(tmp_path, compression):
    """A small tensor (packed with others, copied in memory) or a compressed one over a read-only mapping
    crashed the process (SIGSEGV in the copy); it is refused before the first byte is written, naming it."""
    import subprocess

    script = tmp_path / "ro.py"
    script.write_text(SMALL_AND_LARGE)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "r"), str(tmp_path / "f"), compression],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["refused", "True", "True", "True"], r.stdout + r.stderr[-2000:]


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_a_read_only_destination_is_named_as_such_and_no_checkpoint_is_skipped(tmp_path):
    """A tensor over a read-only mapping cannot be restored into: the read fails with EFAULT. That is the
    destination's fault, not the storage's: a clear StateMismatchError at once, no retries, no fallback to an
    older checkpoint (each would fail the same way), no checkpoint marked."""
    import numpy as np

    root = tmp_path / "r"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"m": {"w": torch.randn(NUMEL)}})
    (tmp_path / "f").write_bytes(bytes(NUMEL * 4))
    ro = torch.from_numpy(np.memmap(tmp_path / "f", dtype="float32", mode="r", shape=(NUMEL,)))
    with tg.CheckpointManager(root) as mgr:
        with pytest.raises(tg.StateMismatchError, match=r"m\.w: the live tensor is on read-only memory") as e:
            mgr.restore_latest({"m": {"w": ro}})
        assert "step 2" in str(e.value) and "fix access to the storage" not in str(e.value)
        assert [c.step for c in mgr.checkpoints() if c.usable] == [1, 2]
    assert not any(root.glob("step-*/corrupt.json"))


TWO_RANKS = """
import os, sys, warnings, numpy as np, torch, torch.distributed as dist, torch.multiprocessing as mp
import trainguard as tg
warnings.simplefilter("ignore")

def body(rank, root, pg, out):
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + pg)
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"m": {"w": torch.randn(1 << 20), "b": torch.randn(10)}})
    f = os.path.join(out, f"ro{rank}")
    np.zeros(10, dtype=np.float32).tofile(f)
    b = torch.from_numpy(np.memmap(f, dtype="float32", mode="r", shape=(10,))) if rank == 1 else torch.zeros(10)
    try:
        with tg.CheckpointManager(root) as mgr:
            mgr.restore_latest({"m": {"w": torch.zeros(1 << 20), "b": b}})
        result = "loaded"
    except tg.StateMismatchError as e:
        result = "refused " + ("read-only memory" if "read-only memory" in str(e) else "another rank")
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as fh:  # one file per rank: no shared pipe
        fh.write(result)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization (a gloo thread may abort it: tests/distributed/worker.py)

if __name__ == "__main__":
    mp.spawn(body, args=tuple(sys.argv[1:4]), nprocs=2)
"""


@pytest.mark.timeout(200)
def test_under_torch_distributed_one_rank_s_read_only_destination_stops_every_rank(tmp_path):
    """Only rank 1's tensor is on read-only memory: rank 1 names it, rank 0 stops too (a rank that went on
    alone would wait forever in the load's collectives), nothing is marked."""
    import subprocess

    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    root = tmp_path / "root"
    r = subprocess.run(
        [sys.executable, str(script), str(root), str(tmp_path / "pg"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    results = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert results == ["refused another rank", "refused read-only memory"], r.stderr[-3000:]
    assert not any(root.glob("step-*/corrupt.json"))


def test_the_same_target_problem_on_every_rank_is_not_reported_as_a_failed_save():
    from torch.distributed.checkpoint.api import CheckpointException

    from trainguard._persist import unwrap

    both = CheckpointException(
        "load", {0: tg.StateMismatchError("rank 0's"), 1: tg.StateMismatchError("rank 1's")}
    )
    assert isinstance(unwrap(both, 2), tg.StateMismatchError) and str(unwrap(both, 2)) == "rank 0's"
    mixed = CheckpointException("load", {0: tg.StateMismatchError("a"), 1: OSError("b")})
    assert isinstance(unwrap(mixed, 2), tg.SaveError)  # different problems: every rank's is listed


def test_efault_blames_the_caller_s_memory_only_on_a_read_into_it(tmp_path, monkeypatch):
    """EFAULT on ``readinto`` (the caller's destination) is a StateMismatchError; on ``verify``'s read into
    trainguard's own buffer it can only come from the storage (e.g. a FUSE daemon): an unreadable chunk."""
    saved(tmp_path, n=1)
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    try:
        from trainguard.catalog import read_manifest

        store = mgr.store
        rec = next(iter(read_manifest(tmp_path, 1).chunks.values()))
        real_open = store.storage.open_read

        class Faulty:  # the chunk's file, whose reads into a buffer fail with EFAULT
            def __init__(self, f):
                self.f = f

            def readinto(self, _view):
                raise OSError(errno.EFAULT, "Bad address")

            def read(self, *a):
                return self.f.read(*a)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        def faulty_open(*a, **k):
            f, info = real_open(*a, **k)
            return Faulty(f), info

        monkeypatch.setattr(store.storage, "open_read", faulty_open)
        with pytest.raises(tg.StateMismatchError, match="could not be read into its destination"):
            store.readinto(rec, memoryview(bytearray(rec.length)))
        with pytest.raises(tg.CorruptCheckpointError, match="cannot be read"):
            store.verify(rec)
    finally:
        mgr.close()


# -- one read into memory never written: no verify pass for those chunks -------------------------------------


def test_never_written_is_true_only_for_untouched_anonymous_private_memory(tmp_path):
    import mmap

    import numpy as np

    maps = lambda: _prefault.MemoryMaps()  # noqa: E731 - a snapshot after each allocation
    fresh = torch.empty(NUMEL)
    assert _prefault.never_written(view_of(fresh), maps())
    one_page = torch.empty(NUMEL)
    one_page[NUMEL // 2] = 1.0  # one page in the middle written: the whole range is checked, not its start
    assert not _prefault.never_written(view_of(one_page), maps())
    assert not _prefault.never_written(view_of(torch.zeros(NUMEL)), maps())
    shared = torch.empty(NUMEL).share_memory_()  # shared memory: another process may have written it
    assert not _prefault.never_written(view_of(shared), maps())
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\x01" * (8 << 20))
    cow = np.memmap(f, dtype=np.uint8, mode="c")  # a private file mapping: absent pages hold the file's bytes
    assert not _prefault.never_written(memoryview(cow), maps())
    anon = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert _prefault.never_written(memoryview(anon), maps())
    assert not _prefault.never_written(memoryview(anon)[:100], maps())  # no whole page
    empty = _prefault.MemoryMaps.__new__(_prefault.MemoryMaps)
    empty.starts, empty.ends, empty.write, empty.anonymous = [], [], [], []  # no /proc/self/maps
    assert not _prefault.never_written(view_of(fresh), empty)
    del cow
    anon.close()


@pytest.fixture
def no_swap(monkeypatch):
    """The skip needs a machine without swap (a swapped-out page is absent too); CI runners may have swap, and
    the memory these tests allocate is not swapped out meanwhile."""
    import trainguard.distributed.chunkread as chunkread

    monkeypatch.setattr(chunkread, "swap_configured", lambda: False)


def saved_two(tmp_path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    state = {"new": torch.randn(NUMEL, generator=g), "old": torch.randn(NUMEL, generator=g)}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"m": state})
        mgr.save(2, {"m": {k: v + 1 for k, v in state.items()}})
    return state


def corrupt(root, step: int, fqn: str, where: int | None = None) -> None:
    from trainguard.catalog import read_manifest

    m = read_manifest(root, step)
    p = root / m.chunks[m.entries[fqn].shards[0].segments[0].chunk].path
    b = bytearray(p.read_bytes())
    b[len(b) // 2 if where is None else where] ^= 0xFF
    p.write_bytes(bytes(b))


def test_a_restore_into_new_tensors_reads_each_chunk_once_and_checks_it_as_it_loads(tmp_path, no_swap):
    state = saved_two(tmp_path)
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    live = {k: torch.empty(NUMEL) for k in state}
    mgr.restore(1, {"m": live})
    assert all(torch.equal(live[k].view(torch.int32), state[k].view(torch.int32)) for k in state)
    assert mgr.last_restore.verify_bytes == 0  # no pass before the load
    mgr.restore(1, {"m": live})  # the same tensors, written now: the pass is back
    assert mgr.last_restore.verify_bytes == 2 * NUMEL * 4
    mixed = {"new": torch.empty(NUMEL), "old": torch.zeros(NUMEL)}
    mgr.restore(1, {"m": mixed})
    assert mgr.last_restore.verify_bytes == NUMEL * 4  # only the chunk going into written memory
    assert all(torch.equal(mixed[k], state[k]) for k in state)


def test_with_swap_every_chunk_is_checked_before_the_load(tmp_path, monkeypatch):
    """A page swapped out is absent too: with swap space, absent memory may hold data, so the pass stays."""
    import trainguard.distributed.chunkread as chunkread

    state = saved_two(tmp_path)
    monkeypatch.setattr(chunkread, "swap_configured", lambda: True)
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    live = {k: torch.empty(NUMEL) for k in state}
    mgr.restore(1, {"m": live})
    assert mgr.last_restore.verify_bytes == 2 * NUMEL * 4
    assert all(torch.equal(live[k], state[k]) for k in state)


def test_a_corrupt_chunk_into_new_memory_is_put_back_and_written_memory_never_touched(tmp_path, no_swap):
    """The chunks going into never-written memory are loaded (and checked) first; a corrupt one stops the
    restore before the written tensor's chunk is copied in, and the never-written memory is put back as it
    was: its pages zero again, and the bytes the caller wrote in its first partial page (beside the
    allocator's header, not looked at by the mincore check) rewritten. So the objects were not modified.
    restore_latest then falls back to the older checkpoint, bit-exact."""
    state = saved_two(tmp_path)
    corrupt(tmp_path, 2, "m.new", where=-5)  # near the end: the read has filled the tensor by then
    written = torch.full((NUMEL,), 7.0)
    new = torch.empty(NUMEL)
    head = -new.data_ptr() % _prefault.PAGE // 4  # elements in the first, partial page
    assert head > 0, "torch's allocator puts data after a header: the first page is partial"
    new[:head] = 3.0  # the caller's bytes, in a page that mincore finds resident (the header's page)
    assert _prefault.never_written(view_of(new), _prefault.MemoryMaps())
    with pytest.raises(tg.CorruptCheckpointError, match="not modified") as ei:
        tg.CheckpointManager(tmp_path, read_only=True).restore(2, {"m": {"new": new, "old": written}})
    assert ei.value.state_modified is False
    assert bool((written == 7.0).all())  # not one byte of the corrupt checkpoint in the written tensor
    assert bool((new[:head] == 3.0).all()) and bool((new[head:] == 0).all())  # as it was
    mgr = tg.CheckpointManager(tmp_path)
    live = {"new": torch.empty(NUMEL), "old": torch.empty(NUMEL)}
    assert mgr.restore_latest({"m": live}) == 1
    assert all(torch.equal(live[k].view(torch.int32), state[k].view(torch.int32)) for k in state)


def test_when_the_kernel_keeps_the_failed_read_s_bytes_the_error_says_which_tensors(
    tmp_path, no_swap, monkeypatch
):
    import trainguard.distributed.chunkread as chunkread

    saved_two(tmp_path)
    corrupt(tmp_path, 2, "m.new")
    monkeypatch.setattr(chunkread, "put_back", lambda view, kept: False)
    written = torch.full((NUMEL,), 7.0)
    with pytest.raises(tg.CorruptCheckpointError, match="only tensors allocated and never written") as ei:
        tg.CheckpointManager(tmp_path, read_only=True).restore(
            2, {"m": {"new": torch.empty(NUMEL), "old": written}}
        )
    assert ei.value.state_modified is True
    assert bool((written == 7.0).all())


def test_a_fallback_to_a_step_without_some_entries_works_after_a_never_written_failure(tmp_path, no_swap):
    """The newest step's chunk into trainguard's own new tensors (a restore into an empty container) fails:
    nothing reached the caller, so an older step that lacks an entry is restored, not refused."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(NUMEL, generator=g), torch.randn(NUMEL, generator=g)
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"m": {"a": a}})
        mgr.save(2, {"m": {"a": a + 1, "b": b}})
    corrupt(tmp_path, 2, "m.a")
    target: dict = {"m": {}}
    assert tg.CheckpointManager(tmp_path).restore_latest(target) == 1
    assert sorted(target["m"]) == ["a"] and torch.equal(target["m"]["a"], a)


def test_a_chunk_counts_as_never_written_only_when_every_destination_is(tmp_path, no_swap):
    """Two entries with the same bytes share one chunk: one goes into new memory, one into a written tensor.
    The chunk is checked before the load (the written tensor's values are protected), never loaded first."""
    t = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"m": {"a": t, "b": t.clone()}})
    corrupt(tmp_path, 1, "m.a")
    written = torch.full((NUMEL,), 7.0)
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(tg.CorruptCheckpointError) as ei:
        mgr.restore(1, {"m": {"a": torch.empty(NUMEL), "b": written}})
    assert ei.value.state_modified is False
    assert bool((written == 7.0).all())


def test_locked_memory_is_never_counted_as_never_written():
    """Locked memory (mlock with MLOCK_ONFAULT, mlockall(MCL_FUTURE | MCL_ONFAULT)) is absent until touched but
    refuses the drop that putting it back needs: it goes through the check before the load instead."""
    import mmap

    libc = _prefault._load()
    if libc is None or not hasattr(libc, "mlock2"):
        pytest.skip("no mlock2 here")
    size = 16 * _prefault.PAGE  # within the smallest usual RLIMIT_MEMLOCK (64 KiB)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(region)
    assert _prefault.never_written(view, _prefault.MemoryMaps())
    addr = _prefault.address(view)
    if libc.mlock2(ctypes.c_void_p(addr), ctypes.c_size_t(size), 1) != 0:  # MLOCK_ONFAULT
        pytest.skip(f"mlock2 refused here (errno {ctypes.get_errno()})")
    try:
        assert _prefault.never_written(view, _prefault.MemoryMaps()) is False
    finally:
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        view.release()
        region.close()


@pytest.mark.parametrize(
    ("total", "mine", "swap"),
    [(0, 0, False), (4096, 0, True), (0, 12, True), (None, 0, True), (0, None, True)],
)
def test_swap_counts_when_the_machine_has_it_or_the_process_uses_it(monkeypatch, total, mine, swap):
    """A container's /proc/meminfo can be rewritten to show no swap (LXCFS) on a host that swaps: the process's
    own VmSwap counts too; what cannot be read counts as swap."""
    values = {b"SwapTotal:": total, b"VmSwap:": mine}
    monkeypatch.setattr(_prefault, "_field_kib", lambda path, name: values[name])
    assert _prefault.swap_configured() is swap


def test_after_a_failed_read_the_reads_not_begun_are_skipped_and_none_runs_on(tmp_path, monkeypatch):
    """One failing chunk stops the load: reads not begun are skipped, and when the error is raised no reading
    thread is left writing into a destination."""
    import threading
    import time

    import trainguard.distributed.chunkread as chunkread
    from trainguard.catalog import read_manifest

    g = torch.Generator().manual_seed(4)
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"m": {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(24)}})
    m = read_manifest(tmp_path, 1)
    store = tg.CheckpointManager(tmp_path, read_only=True).ctx.store
    reader = chunkread.ShardReader(store, m, threads=2)
    dests = {f: torch.empty(1 << 18) for f in m.entries if f.startswith("m.t")}
    for f, d in dests.items():
        assert reader.read_tensor(f, (0,), (0,), (1 << 18,), d)
    real = store.readinto
    ended: list[float] = []
    first = threading.Event()

    def slow(rec, out, **kw):
        if not first.is_set():
            first.set()
            raise tg.CorruptCheckpointError("injected", step=1)
        time.sleep(0.05)
        try:
            return real(rec, out, **kw)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(store, "readinto", slow)
    with pytest.raises(tg.CorruptCheckpointError, match="injected"):
        reader.flush()
    raised = time.monotonic()
    time.sleep(0.3)
    assert len(ended) < 23, "every other read ran after the failure"
    assert all(t <= raised for t in ended), "a read ended after the error was raised"


def test_the_optimizer_state_a_restore_creates_is_read_once(tmp_path, no_swap):
    """A relaunch with an initialized model and a new optimizer: the model's weights are checked before the
    load (resident: real values), AdamW's two moments, which the restore allocates itself, are read once."""
    torch.manual_seed(5)
    model = torch.nn.Linear(4096, NUMEL // 4096, bias=False)  # one 48 MiB weight
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4096)).sum().backward()
    opt.step()
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    model2 = torch.nn.Linear(4096, NUMEL // 4096, bias=False)
    opt2 = torch.optim.AdamW(model2.parameters())
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    assert mgr.restore_latest({"model": model2, "optim": opt2}) == 1
    assert NUMEL * 4 <= mgr.last_restore.verify_bytes < 2 * NUMEL * 4  # the weight, not the moments
    assert mgr.last_restore.bytes >= 3 * NUMEL * 4
    assert torch.equal(model2.weight, model.weight)
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opt2.state[model2.weight][k], opt.state[model.weight][k])
