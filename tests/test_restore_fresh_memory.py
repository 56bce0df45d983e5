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
        with pytest.raises(tg.StateMismatchError, match=r"\(m\.w\): that memory is not writable") as e:
            mgr.restore_latest({"m": {"w": ro}})
        assert "step 2" in str(e.value) and "fix access to the storage" not in str(e.value)
        assert [c.step for c in mgr.checkpoints() if c.usable] == [1, 2]
    assert not any(root.glob("step-*/corrupt.json"))
