"""A completely full disk: the manager still opens (so ``keep=1`` can free space), a save raises
StorageFullError, and nothing at close or exit claims a save failed when none was attempted.

The disk is a real tmpfs filled to the last byte (mounting needs root: skipped elsewhere). Before the fix the
constructor died with a raw ``OSError: [Errno 28]`` from the event log's ``manager_start`` line.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainguard as tg
from trainguard.eventlog import EventLog, read_events

N = 1 << 16  # float32 elements per step: 256 KiB


@pytest.fixture
def tiny(tmpfs) -> Path:
    """A 4 MiB tmpfs (needs mount privileges)."""
    return tmpfs("tiny", "4m")


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem has not one byte left."""
    with open(path, "wb", buffering=0) as f:
        for block in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def state(step: int) -> dict:
    return {"model": {"w": torch.full((N,), float(step))}}


def test_a_full_disk_opens_raises_storage_full_on_save_and_keep_1_frees_space(tiny, caplog):
    root = tiny / "run"
    with tg.CheckpointManager(root, async_save=False, compression="off") as mgr:
        for step in (1, 2, 3):
            mgr.save(step, state(step))
    fill(tiny / "filler")

    with caplog.at_level(logging.WARNING, logger="trainguard"):
        mgr = tg.CheckpointManager(root, async_save=False, compression="off")  # opens on the full disk
        with pytest.raises(tg.StorageFullError, match="reopen the manager with keep=1") as e:
            mgr.save(4, state(4))
        assert e.value.step == 4
        mgr.close()  # nothing pending: no error
        mgr = tg.CheckpointManager(root, compression="off")  # async: wait() reports it
        with pytest.raises(tg.StorageFullError):
            mgr.save(4, state(4)).wait()
        mgr.close()
    warned = [r.getMessage() for r in caplog.records if "event log" in r.getMessage()]
    # once per manager's log, however many of its events were dropped
    assert len(warned) == 2 and all("disk is full" in w for w in warned)

    with tg.CheckpointManager(root, keep=1, async_save=False, compression="off") as mgr:
        mgr.save(4, state(4))  # keep=1 deletes steps 1 and 2 before writing, step 3 once 4 committed
    with tg.CheckpointManager(root, read_only=True) as ro:
        assert [i.step for i in ro.checkpoints() if i.status == "valid"] == [4]
        got = {"model": {"w": torch.zeros(N)}}
        ro.restore(4, got)
    assert torch.equal(got["model"]["w"], state(4)["model"]["w"])
    assert any(e["step"] == 4 for e in read_events(root, event="save"))  # the log resumed once there was room


def test_events_a_full_disk_refuses_are_dropped_and_the_log_resumes_when_there_is_room(tiny):
    fill(tiny / "filler")
    log = EventLog(tiny, "manager")  # no room for a line: not an error
    log.write("first")
    assert log.dropped >= 1
    (tiny / "filler").unlink()
    log.write("second")
    log.close()
    assert [e["event"] for e in read_events(tiny)] == ["second"]


EXIT_CHILD = r"""
import sys, torch, trainguard as tg
mgr = tg.CheckpointManager(sys.argv[1], async_save=True)
print("opened", flush=True)
"""


def test_exiting_after_opening_on_a_full_disk_reports_no_failed_save(tiny):
    root = tiny / "run"
    tg.CheckpointManager(root).close()
    fill(tiny / "filler")
    out = subprocess.run(
        [sys.executable, "-c", EXIT_CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "opened" in out.stdout
    assert "save failed" not in out.stderr and "Traceback" not in out.stderr
