"""A save call that reports an earlier background save's failure never drops its own save.

The loop of docs/validation.md catches the error and trains on; before the fix, the call that raised an earlier
save's error (a NaN weight, a full disk) returned before staging its own save, so a final ``force=True`` save
was silently lost. Now the call stages and submits its save first, then raises the earlier error with
``pending_save`` set to its own save's handle.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.storage import Fault, FaultyStorage, LocalStorage

TOTAL = 4


def weights(step: int, *, nan: bool = False) -> dict[str, Any]:
    t = torch.full((4096,), float(step))
    if nan:
        t[7] = float("nan")
    return {"model": {"w": t}}


def train(mgr: tg.CheckpointManager, total: int, bad_step: int | None, error: type[Exception]) -> list[Any]:
    """docs/validation.md's loop: ``maybe_save(force=step == total)`` under ``except error``; each background
    save is let finish before the next step (as a long step would), so the next call is the one that reports
    it. Returns the errors caught."""
    caught = []
    for step in range(1, total + 1):
        try:
            pending = mgr.maybe_save(step, weights(step, nan=step == bad_step), force=step == total)
        except error as e:
            caught.append(e)
            pending = e.pending_save
        if pending is not None:
            assert pending.wait_done(60), f"the save of step {step} did not finish"
    return caught


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_nan_step_reported_by_the_final_forced_save_does_not_drop_it(tmp_path, async_save):
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), async_save=async_save) as mgr:
        caught = train(mgr, TOTAL, bad_step=3, error=tg.NonFiniteStateError)
    assert [e.step for e in caught] == [3]
    if async_save:  # reported by step 4's call, which staged its own save first and says so
        assert caught[0].pending_save is not None and caught[0].pending_save.step == 4
        assert "save of step 4" in str(caught[0]) and "staged" in str(caught[0])
    with tg.CheckpointManager(tmp_path, read_only=True) as ro:
        assert [i.step for i in ro.checkpoints() if i.status == "valid"] == [1, 2, 4]
        state = {"model": {"w": torch.zeros(4096)}}
        ro.restore(4, state)
    assert torch.equal(state["model"]["w"], torch.full((4096,), 4.0))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_full_disk_reported_by_the_final_forced_save_does_not_drop_it(tmp_path, async_save):
    fault = Fault("write", match="step-000000002/manifest.json", errno=errno.ENOSPC)
    disk = FaultyStorage(LocalStorage(tmp_path), fault)
    with tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(1), async_save=async_save) as mgr:
        caught = train(mgr, 3, bad_step=None, error=tg.StorageFullError)
    assert fault.seen >= 1, "the fault fired"
    assert [e.step for e in caught] == [2]
    assert (caught[0].pending_save is not None) == async_save
    with tg.CheckpointManager(tmp_path, read_only=True) as ro:
        assert [i.step for i in ro.checkpoints() if i.status == "valid"] == [1, 3]


def test_an_earlier_failure_with_no_save_due_is_still_raised_once(tmp_path):
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(2)) as mgr:
        mgr.maybe_save(2, weights(2, nan=True)).wait_done(60)
        with pytest.raises(tg.NonFiniteStateError) as e:
            mgr.maybe_save(3, weights(3))  # not a save step: nothing started
        assert e.value.pending_save is None and e.value.step == 2
        assert mgr.maybe_save(4, weights(4)).wait().step == 4  # raised once: not again
    assert [i.step for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()] == [4]


def test_close_names_every_unseen_failure(tmp_path, caplog):
    gate = threading.Event()  # both saves are staged before either fails
    disk = FaultyStorage(LocalStorage(tmp_path))
    mgr = tg.CheckpointManager(disk, staging_buffers=2)
    disk.add(Fault("write", times=None, stall=gate, exc=OSError(errno.EIO, "injected I/O error")))
    first = mgr.save(1, weights(1))
    second = mgr.save(2, weights(2))
    gate.set()
    assert first.wait_done(60) and second.wait_done(60)
    with caplog.at_level(logging.ERROR, logger="trainguard"), pytest.raises(tg.SaveError) as e:
        mgr.close()
    assert e.value.step == 1 and "steps [2] failed too" in str(e.value)
    assert any("save of step 2 failed too" in r.getMessage() for r in caplog.records)


PREEMPTED_CHILD = r"""
import os, signal, sys, torch, trainguard as tg
mgr = tg.CheckpointManager(sys.argv[1], save_policy=tg.EveryNSteps(100), save_on_preemption=True)
bad = torch.ones(64); bad[3] = float("nan")
mgr.save(1, {"model": {"w": bad}}).wait_done(60)   # fails in the background; nobody has seen it
os.kill(os.getpid(), signal.SIGTERM)               # the preemption notice
mgr.maybe_save(2, {"model": {"w": torch.full((64,), 2.0)}})   # saves step 2, closes and exits 75
sys.exit(3)
"""


def test_a_preemption_save_after_an_unseen_failure_still_saves_and_exits(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PREEMPTED_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 75, out.stderr  # EXIT_PREEMPTED
    assert "saving step 2 before exiting" in out.stderr  # the earlier failure is logged, not lost
    with tg.CheckpointManager(tmp_path, read_only=True) as ro:
        assert [i.step for i in ro.checkpoints() if i.status == "valid"] == [2]


def test_every_background_save_error_names_the_step_that_failed(tmp_path):
    """Tester finding: on a full disk, ``maybe_save(4)`` raised step 2's StorageFullError whose text named only
    step 4 (the reporting call), and ``close()`` raised step 3's naming only the other failures. Each message
    now names its own step, and separately the call that reported it."""
    faults = [Fault("write", match=f"step-00000000{s}/manifest.json", errno=errno.ENOSPC) for s in (2, 3)]
    disk = FaultyStorage(LocalStorage(tmp_path), *faults)
    mgr = tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(1))
    for step in (1, 2):
        assert mgr.maybe_save(step, weights(step)).wait_done(60)
    with pytest.raises(tg.StorageFullError) as ei:
        mgr.maybe_save(3, weights(3))
    assert ei.value.step == 2
    assert "saving step 2 failed: no space left" in str(ei.value)
    assert "[reported by the save of step 3" in str(ei.value)
    assert ei.value.pending_save.wait_done(60)
    with pytest.raises(tg.StorageFullError) as ei:
        mgr.close()
    assert ei.value.step == 3
    assert str(ei.value).startswith("saving step 3 failed: no space left")
    assert all(f.seen >= 1 for f in faults), "both faults fired"
    with tg.CheckpointManager(tmp_path, read_only=True) as ro:
        assert [i.step for i in ro.checkpoints() if i.status == "valid"] == [1]


def test_a_message_that_names_its_step_is_not_prefixed_again():
    from trainguard._text import naming_step

    assert naming_step("saving step 12 failed: boom", 12) == "saving step 12 failed: boom"
    assert naming_step("no space left writing step-000000012/x", 12).startswith("saving step 12 failed: no")
    assert naming_step("step 120 is odd", 12) == "saving step 12 failed: step 120 is odd"
