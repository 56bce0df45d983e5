"""Transient storage errors (``TransientStorageError``: a timeout, a stale handle, EAGAIN) while restoring.

Injected through the storage seam: ``FaultyStorage(LocalStorage(root), Fault("read", errno=errno.ETIMEDOUT))``
(FaultyStorage classifies the errno as LocalStorage does). A read of committed data that fails transiently is
retried with a backoff (``trainguard.storage.retry``): one that succeeds on retry costs nothing (the newest
checkpoint restores, nothing is skipped or marked); one that persists is reported and the restore falls back
to an older checkpoint without condemning the newer one, which restores once the storage is healthy again.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from faultlib import assert_state_is, blank_state, chunks_only_in, commit_save, make_state, require

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, LocalStorage
from trainguard.storage.retry import READ_ATTEMPTS

MANIFEST_3 = "step-000000003/manifest.json"


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("transient") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2, 3):
            commit_save(mgr, s, make_state(s))
    return root


def chunk_of_step_3(root: Path) -> str:
    """A chunk only step 3 references."""
    only = chunks_only_in(root, 3, [1, 2])
    require(only, "step 3 has chunks of its own")
    return next(iter(only.values()))["path"]


def targets(root: Path) -> dict[str, str]:
    return {"manifest": MANIFEST_3, "chunk": chunk_of_step_3(root)}


def no_marks(root: Path) -> bool:
    return not list(root.glob("step-*/corrupt.json")) and not list(root.glob("chunks/*/*.corrupt-*"))


@pytest.mark.parametrize("what", ["manifest", "chunk"])
def test_a_transient_read_error_that_a_retry_gets_past_costs_nothing(saved_root, what):
    key = targets(saved_root)[what]
    # fails every attempt but the last one: the reader's retries must get past it
    fault = Fault("read", match=key, times=READ_ATTEMPTS - 1, errno=errno.ETIMEDOUT)
    disk = FaultyStorage(LocalStorage(saved_root), fault)
    state = blank_state()
    with tg.CheckpointManager(disk, read_only=True) as mgr:
        assert mgr.restore_latest(state) == 3
    require(len(disk.injected) == READ_ATTEMPTS - 1, f"the first {READ_ATTEMPTS - 1} reads of {key} failed")
    assert fault.seen >= READ_ATTEMPTS  # retried until it read
    assert_state_is(state, 3)
    assert no_marks(saved_root)


@pytest.mark.parametrize("what", ["manifest", "chunk"])
def test_a_persistent_transient_error_is_reported_and_the_restore_falls_back(saved_root, caplog, what):
    key = targets(saved_root)[what]
    fault = Fault("read", match=key, times=None, errno=errno.ETIMEDOUT)
    disk = FaultyStorage(LocalStorage(saved_root), fault)
    state = blank_state()
    with tg.CheckpointManager(disk) as mgr:
        assert mgr.restore_latest(state) == 2
    require(len(disk.injected) >= READ_ATTEMPTS, f"every read of {key} failed")
    assert_state_is(state, 2)
    skipped = read_events(saved_root, event="restore_skipped")
    assert [e["step"] for e in skipped][-1:] == [3]
    assert "cannot be read" in skipped[-1]["problem"] and "cannot be read" in caplog.text
    assert no_marks(saved_root), "a checkpoint was condemned for a storage timeout"
    fault.enabled = False  # the storage is healthy again: nothing was lost
    state = blank_state()
    with tg.CheckpointManager(disk, read_only=True) as mgr:
        assert mgr.restore_latest(state) == 3
    assert_state_is(state, 3)
