"""A save that fails (disk full, an I/O error, a bug) commits nothing and leaves earlier checkpoints intact.

Faults are injected through the storage seam (:class:`~trainguard.storage.FaultyStorage` handed to the
manager as its root): a disk that holds N more bytes (``Fault(budget_bytes=N)``), chunk writes that fail from
the N-th on, and a failing write of the manifest (the commit itself). Each fault records its injections, and
every test checks it fired. After the failure: ``save`` raised ``StorageFullError`` (a ``SaveError`` and an
``OSError``) whose message says what to do, no partial directory and no valid new step exist, steps 1 and 2 are
byte-for-byte what they were and verify, and once the disk has room again the same step saves and restores.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from faultlib import (
    assert_state_is,
    blank_state,
    chunk_files,
    commit_save,
    make_state,
    manifest_path,
    mode_id,
    partial_dirs,
    referenced_chunks,
    require,
    save_modes,
)

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.integrity.verify import verify
from trainguard.storage import Fault, FaultyStorage, LocalStorage, Staged

MODES = save_modes()


def full_disk(root: Path, budget: float, **local: Any) -> tuple[FaultyStorage, Fault]:
    """The run root's storage, on a disk that holds ``budget`` more bytes (then ENOSPC), and that fault."""
    fault = Fault("write", budget_bytes=budget)
    return FaultyStorage(LocalStorage(root, **local), fault), fault


def failing_writes(root: Path, match: str, **fault: Any) -> tuple[FaultyStorage, Fault]:
    """The run root's storage where writes of keys matching ``match`` fail as ``fault`` says, and that fault."""
    f = Fault("write", match=match, **fault)
    return FaultyStorage(LocalStorage(root), f), f


def snapshot(root: Path, steps: list[int]) -> dict[str, str]:
    """SHA-256 of the manifest and every chunk file of ``steps``."""
    files = [manifest_path(root, s) for s in steps] + [root / c for c in referenced_chunks(root, steps)]
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    return root, snapshot(root, [1, 2])


def assert_failed_cleanly(root: Path, before: dict[str, str], step: int, valid: list[int]) -> None:
    """Nothing of ``step`` is committed; the checkpoints of ``valid`` are unchanged and verify."""
    assert partial_dirs(root) == [], "a partial directory survived the failed save"
    assert not manifest_path(root, step).exists()
    infos = {i.step: i.status for i in tg.CheckpointManager(root, read_only=True).checkpoints()}
    assert step not in infos, f"the failed step lists as {infos[step]}"
    assert [s for s, st_ in sorted(infos.items()) if st_ == "valid"] == valid
    assert snapshot(root, valid) == before, "an earlier checkpoint changed"
    report = verify(root, valid)
    assert report.ok and report.checked == valid


def assert_recovers(mgr: tg.CheckpointManager, root: Path, step: int) -> None:
    """Once the disk has room again, the same step saves, verifies and restores."""
    commit_save(mgr, step, make_state(step))
    assert verify(root, [step]).ok
    state = blank_state()
    assert mgr.restore_latest(state) == step
    assert_state_is(state, step)


def assert_storage_full(err: BaseException, step: int) -> None:
    assert isinstance(err, tg.StorageFullError)
    assert isinstance(err, tg.SaveError) and isinstance(err, OSError)
    msg = str(err)
    assert "no space left" in msg and "free space" in msg and "keep=" in msg, msg
    assert "earlier checkpoints are intact" in msg
    # sentences are joined with a period (the space hint follows the storage's message)
    assert "intact To" not in msg and "intact No" not in msg and "intact The" not in msg, msg
    assert err.step in (
        step,
        None,
    )  # None at the manifest: see test_storage_full_at_the_manifest_names_the_step


# -- ENOSPC -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def save_bytes(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, int]:
    """(bytes that saving step 3 after steps 1 and 2 writes through the storage, of which the manifest's)."""
    root = tmp_path_factory.mktemp("dry") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    disk, fault = full_disk(root, math.inf)
    with tg.CheckpointManager(disk) as mgr:
        commit_save(mgr, 3, make_state(3))
    require(not disk.injected, "an unlimited disk held every write")
    return fault.written, manifest_path(root, 3).stat().st_size


# Where the disk fills up, in bytes written by the save (total, manifest) -> (budget, the write that fails).
FILL_POINTS = {
    "at-the-first-write": (lambda total, man: 0, "chunks/*"),
    "in-the-first-chunk": (lambda total, man: 100_000, "chunks/*"),
    "half-way": (lambda total, man: total // 2, "chunks/*"),
    "in-the-last-chunk": (lambda total, man: total - man - 1000, "chunks/*"),
    "in-the-manifest": (lambda total, man: total - man // 2, "*/manifest.json"),
}


def failed_key(disk: FaultyStorage) -> str:
    """The key of the first write that the fault failed."""
    require(disk.injected, "the fault fired")
    return disk.injected[0][1]


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("where", list(FILL_POINTS))
def test_a_disk_that_fills_up_during_a_save_commits_nothing_and_recovers(run, save_bytes, mode, where):
    root, before = run
    at, failing = FILL_POINTS[where]
    budget = at(*save_bytes)
    disk, fault = full_disk(root, budget)
    with tg.CheckpointManager(disk, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        require(fnmatch.fnmatchcase(failed_key(disk), failing), f"the disk filled up at a write of {failing}")
        assert fault.written <= budget
        assert_storage_full(ei.value, 3)
        assert_failed_cleanly(root, before, 3, [1, 2])
        fault.budget_bytes = math.inf  # space was freed
        assert_recovers(mgr, root, 3)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("from_call", [1, 2, 3])
def test_a_chunk_write_failing_for_lack_of_space_raises_storage_full(run, mode, code, from_call):
    root, before = run
    disk, fault = failing_writes(root, "chunks/*", nth=from_call, times=None, errno=code)
    with tg.CheckpointManager(disk, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert disk.injected
        assert_storage_full(ei.value, 3)
        assert_failed_cleanly(root, before, 3, [1, 2])
        fault.enabled = False
        assert_recovers(mgr, root, 3)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_no_space_for_the_manifest_commits_nothing_and_recovers(run, mode):
    root, before = run
    disk, fault = failing_writes(root, "*/manifest.json", errno=errno.ENOSPC)
    with tg.CheckpointManager(disk, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert len(disk.injected) == 1
        assert_storage_full(ei.value, 3)
        assert "manifest.json" in str(ei.value)
        assert_failed_cleanly(root, before, 3, [1, 2])
        assert not list(root.rglob(".manifest.json.tmp*")), "the manifest's temporary file was left behind"
        fault.enabled = False
        assert_recovers(mgr, root, 3)


def test_no_space_for_the_manifest_leaves_no_step_directory(run):
    root, _ = run
    disk, _fault = failing_writes(root, "*/manifest.json", errno=errno.ENOSPC)
    with tg.CheckpointManager(disk) as mgr:
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, 3, make_state(3))
    assert len(disk.injected) == 1
    for args in (["verify", str(root), "--all"], ["verify", str(root)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
    assert not (root / "step-000000003").exists()


# -- other failures ---------------------------------------------------------------------------------------
OTHER_FAILURES = {  # where -> (the fault, the exception the rank raised)
    # a bug below the chunk writer (a backend raising something that is no OSError), at the second chunk
    "chunk-bug": (
        dict(match="chunks/*", nth=2, exc=RuntimeError("injected failure in write_data")),
        RuntimeError,
    ),
    "chunk-write-EIO": (dict(match="chunks/*", times=None, errno=errno.EIO), OSError),  # not a full disk
    # a failure in the commit itself: publishing the manifest raises
    "publish": (
        dict(match="*/manifest.json", exc=RuntimeError("injected failure in the commit")),
        RuntimeError,
    ),
}


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("where", list(OTHER_FAILURES))
def test_any_other_failure_in_a_save_raises_save_error_and_commits_nothing(run, mode, where):
    root, before = run
    fault, cause = OTHER_FAILURES[where]
    disk, f = failing_writes(root, **fault)
    with tg.CheckpointManager(disk, **mode) as mgr:
        with pytest.raises(tg.SaveError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert disk.injected, "the fault never fired"
        err = ei.value
        assert not isinstance(err, tg.StorageFullError)
        assert not isinstance(err.rank_errors.get(0), tg.StorageFullError)
        assert err.step == 3
        assert isinstance(err.rank_errors.get(0), cause), err.rank_errors
        assert "nothing was committed" in str(err), str(err)
        assert "injected" in str(err) or "Input/output error" in str(err), str(err)
        assert_failed_cleanly(root, before, 3, [1, 2])
        f.enabled = False
        assert_recovers(mgr, root, 3)


# -- retention --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "steps,keep",
    [
        ((1, 2, 3), 1),
        ((9, 10, 100), 2),  # as text: "10" < "100" < "9"
        ((999_999_999, 1_000_000_000, 1_000_000_001), 1),  # "step-1000000000" < "step-999999999" as text
    ],
)
def test_retention_keeps_the_newest_valid_checkpoint_when_the_newest_save_fails(tmp_path, steps, keep):
    root = tmp_path / "root"
    root.mkdir()
    *good, failing = steps
    disk, fault = full_disk(root, math.inf)
    with tg.CheckpointManager(disk, keep=keep) as mgr:
        for s in good:
            commit_save(mgr, s, make_state(s))
        kept = sorted(good)[-keep:]
        assert [i.step for i in mgr.checkpoints()] == kept
        before = snapshot(root, kept)
        fault.budget_bytes = fault.written + 1_000_000  # the disk holds 1 MB more
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, failing, make_state(failing))
        assert disk.injected
        fault.budget_bytes = math.inf
        assert_failed_cleanly(root, before, failing, kept)
        assert [(i.step, i.status) for i in mgr.checkpoints()] == [(s, "valid") for s in kept]
        state = blank_state()
        assert mgr.restore_latest(state) == max(good)
        assert_state_is(state, max(good))
    if steps[0] == 999_999_999:  # the premise: these step directories sort the other way as text
        names = sorted(p.name for p in tmp_path.glob("root/step-*"))
        assert names == ["step-1000000000"]
        assert sorted(["step-999999999", "step-1000000000"])[0] == "step-1000000000"


# -- known bugs -------------------------------------------------------------------------------------------
class RecordingDisk(FaultyStorage):
    """Also records the chunks made visible under ``chunks/`` (a staged object with no token is already at its
    key: per-file durability renamed it into place; batched ones become visible in ``commit_staged``)."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.visible: list[str] = []

    def stage(self, key: str, data: Any, *, staging: str) -> Staged:
        staged = super().stage(key, data, staging=staging)
        if staged.token is None and key.startswith("chunks/"):
            self.visible.append(key)
        return staged

    def commit_staged(self, staged: list[Staged]) -> None:
        super().commit_staged(staged)
        self.visible += [s.key for s in staged if s.token is not None and s.key.startswith("chunks/")]


@pytest.mark.parametrize("durability", ["per_file", "batched"])
def test_a_failed_save_leaves_no_orphan_chunks(run, save_bytes, durability):
    root, before = run
    total, manifest = save_bytes
    fault = Fault("write", budget_bytes=total - manifest - 1000)  # every chunk but the last one makes it
    disk = RecordingDisk(LocalStorage(root, durability=durability), fault)
    with tg.CheckpointManager(disk) as mgr:
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, 3, make_state(3))
    require(disk.injected, "the disk filled up")
    if durability == "per_file":
        require(disk.visible, "the failed save had renamed a chunk into chunks/")
    else:  # batched: chunks become visible only once all of them are written and flushed
        assert disk.visible == []
    with tg.CheckpointManager(root):  # a restarted job does not collect them either
        pass
    orphans = chunk_files(root) - referenced_chunks(root, [1, 2])
    assert not orphans, f"{len(orphans)} orphan chunk(s) left: {sorted(orphans)}"


def test_storage_full_error_carries_errno_enospc(run):
    root, _ = run
    disk, _fault = full_disk(root, 0)
    with tg.CheckpointManager(disk) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    assert ei.value.errno == errno.ENOSPC


def test_storage_full_at_the_manifest_names_the_step(run):
    root, _ = run
    disk, _fault = failing_writes(root, "*/manifest.json", errno=errno.ENOSPC)
    with tg.CheckpointManager(disk) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
    require(len(disk.injected) == 1, "the manifest write failed")
    assert ei.value.step == 3
