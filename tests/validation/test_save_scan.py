"""The check_finite scan in the writer threads (one process): a tensor with chunks of its own is scanned once
its chunks are stored, and not again while its chunks (content hashes) and dtype stay those it had when it was
last found finite; a NaN appearing in it is still found and the save rejected, with nothing committed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.validation import finite

BIG = 1 << 19  # float32 elements: 2 MiB, over the 1 MiB pack threshold (chunks of its own)


def chunk_files(root: Path) -> set[str]:
    d = root / "chunks"
    return {f for _, _, files in os.walk(d) for f in files if not f.startswith(".")}


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_an_unchanged_tensor_is_not_scanned_again_and_a_new_nan_is_still_rejected(
    tmp_path, monkeypatch, async_save
):
    scanned: list[int] = []
    real = finite.count_nonfinite

    def counting(t: torch.Tensor) -> int:
        scanned.append(t.numel())
        return real(t)

    monkeypatch.setattr(finite, "count_nonfinite", counting)
    big = torch.randn(BIG)
    state = {"big": big, "bias": torch.zeros(4)}
    with tg.CheckpointManager(tmp_path, fsync=False, async_save=async_save) as mgr:
        mgr.save(1, state)
        mgr.wait()
        assert BIG in scanned  # the first save scans it
        scanned.clear()
        mgr.save(2, state)  # unchanged: the big tensor's chunks are those it was found finite with
        mgr.wait()
        assert BIG not in scanned and 4 in scanned  # the small (packed) one is scanned before each commit
        scanned.clear()
        big[BIG // 2] = float("nan")  # a changed chunk: scanned again, and rejected
        before = chunk_files(tmp_path)
        with pytest.raises(tg.errors.NonFiniteStateError) as info:
            mgr.save(3, state)
            mgr.wait()
        assert info.value.tensors == {"big": 1}
        assert BIG in scanned
        assert chunk_files(tmp_path) == before, "the rejected save left its chunks behind"
        assert [c.step for c in mgr.checkpoints()] == [1, 2]
        big[BIG // 2] = 1.0  # finite again (a new content): scanned and saved
        scanned.clear()
        mgr.save(4, state)
        mgr.wait()
        assert BIG in scanned
    names = [e["event"] for e in read_events(tmp_path)]
    assert names.count("save_rejected") == 1 and "save_failed" not in names
    out = {"big": torch.zeros(BIG), "bias": torch.ones(4)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(out) == 4
    assert torch.equal(out["big"], big) and torch.equal(out["bias"], torch.zeros(4))


def test_a_dtype_change_with_equal_bytes_is_scanned_again():
    memory: dict[str, tuple[str, tuple[str, ...]]] = {}
    bits = torch.full((8,), 0x7FC00000, dtype=torch.int32)  # NaN's bits as integers: finite
    s = finite.SaveScan(memory, None)
    s.tensor("x", bits, ("h",))
    assert s.known == {"x": 0} and s.skipped == 0
    s = finite.SaveScan(memory, None)
    s.tensor("x", bits.view(torch.float32), ("h",))  # the same chunk, now float32: 8 NaNs
    assert s.known == {"x": 8} and s.skipped == 0 and "x" not in memory
    s = finite.SaveScan(memory, ["model"])
    s.tensor("x", bits, ("h",))  # out of scope: not scanned, not recorded
    assert s.known == {}
