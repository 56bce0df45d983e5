"""A save that fails (disk full, an I/O error, a bug) commits nothing and leaves earlier checkpoints intact.

Faults are injected at three depths: the ``os.write`` calls of the storage module (a "disk" that takes N more
bytes, with a short write at the limit), its ``write_file`` for chunks (fails from the N-th chunk on) and for
the manifest's temporary file (the commit itself). Each injector counts its injections, and every test checks it
fired. After the failure: ``save`` raised ``StorageFullError`` (a ``SaveError`` and an ``OSError``) whose
message says what to do, no partial directory and no valid new step exist, steps 1 and 2 are byte-for-byte
what they were and verify, and once the disk has room again the same step saves and restores.
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from faultlib import (
    assert_state_is,
    blank_state,
    chunk_files,
    commit_save,
    faulty_local,
    is_chunk_tmp,
    make_state,
    manifest_path,
    mode_id,
    partial_dirs,
    referenced_chunks,
    require,
    save_modes,
)

import trainguard as tg
import trainguard.incremental.chunkstore as chunkstore
import trainguard.storage.local as local
from trainguard.cli.main import main as cli
from trainguard.integrity.verify import verify
from trainguard.storage import Fault

MODES = save_modes()


class DiskFull:
    """Stands in for the ``os`` module of trainguard.storage.local: ``write`` accepts ``budget`` more bytes
    (the last call that crosses it is a short write), then fails with ``err``; everything else is ``os``."""

    def __init__(self, budget: float, err: int = errno.ENOSPC) -> None:
        self.budget = budget
        self.err = err
        self.written = 0
        self.injected = 0
        self._lock = threading.Lock()  # chunk writer threads share the disk

    def write(self, fd: int, data: Any) -> int:
        with self._lock:
            room = self.budget - self.written
            if room <= 0:
                self.injected += 1
                raise OSError(self.err, os.strerror(self.err))
            view = memoryview(data)
            n = os.write(fd, view[: int(min(room, len(view)))])
            self.written += n
            return n

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class FailingWriteFile:
    """Replaces ``trainguard.storage.local.write_file`` (chunks and manifests are written through it): the
    ``n``-th call for a path that ``select`` picks raises ``exc`` when ``fail(n)``."""

    def __init__(self, select: Any, fail: Any, exc: BaseException) -> None:
        self.real = local.write_file
        self.select = select
        self.fail = fail
        self.exc = exc
        self.calls = 0
        self.injections: list[str] = []  # the paths whose write failed
        self.enabled = True
        self._lock = threading.Lock()

    @property
    def injected(self) -> int:
        return len(self.injections)

    def __call__(self, path: Path, buf: Any, *, fsync: bool = True) -> None:
        if self.select(Path(path)):
            with self._lock:
                self.calls += 1
                n = self.calls
            if self.enabled and self.fail(n):
                self.injections.append(str(path))
                raise self.exc
        self.real(path, buf, fsync=fsync)


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
    """(bytes that saving step 3 after steps 1 and 2 writes through storage.local, of which the manifest's)."""
    root = tmp_path_factory.mktemp("dry") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    disk = DiskFull(math.inf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(local, "os", disk)
        with tg.CheckpointManager(root) as mgr:
            commit_save(mgr, 3, make_state(3))
    return disk.written, manifest_path(root, 3).stat().st_size


# Where the disk fills up, in bytes written by the save (total, manifest) -> budget.
FILL_POINTS = {
    "at-the-first-write": lambda total, man: 0,
    "in-the-first-chunk": lambda total, man: 100_000,
    "half-way": lambda total, man: total // 2,
    "in-the-last-chunk": lambda total, man: total - man - 1000,
    "in-the-manifest": lambda total, man: total - man // 2,
}


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("where", list(FILL_POINTS))
def test_a_disk_that_fills_up_during_a_save_commits_nothing_and_recovers(
    run, monkeypatch, save_bytes, mode, where
):
    root, before = run
    budget = FILL_POINTS[where](*save_bytes)
    disk = DiskFull(budget)
    monkeypatch.setattr(local, "os", disk)
    with tg.CheckpointManager(root, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert disk.injected >= 1 and disk.written <= budget
        assert_storage_full(ei.value, 3)
        assert_failed_cleanly(root, before, 3, [1, 2])
        disk.budget = math.inf  # space was freed
        assert_recovers(mgr, root, 3)


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
@pytest.mark.parametrize("from_call", [1, 2, 3])
def test_a_chunk_write_failing_for_lack_of_space_raises_storage_full(run, monkeypatch, mode, code, from_call):
    root, before = run
    inject = FailingWriteFile(is_chunk_tmp, lambda n: n >= from_call, OSError(code, os.strerror(code)))
    monkeypatch.setattr(local, "write_file", inject)
    with tg.CheckpointManager(root, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert inject.injected >= 1
        assert_storage_full(ei.value, 3)
        assert_failed_cleanly(root, before, 3, [1, 2])
        inject.enabled = False
        assert_recovers(mgr, root, 3)


def _manifest_tmp(p: Path) -> bool:
    return p.name.startswith(".manifest.json.tmp")


def _always(n: int) -> bool:
    return True


@pytest.mark.parametrize("mode", MODES, ids=mode_id)
def test_no_space_for_the_manifest_commits_nothing_and_recovers(run, monkeypatch, mode):
    root, before = run
    inject = FailingWriteFile(_manifest_tmp, _always, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(local, "write_file", inject)
    with tg.CheckpointManager(root, **mode) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert inject.injected == 1
        assert_storage_full(ei.value, 3)
        assert "manifest.json" in str(ei.value)
        assert_failed_cleanly(root, before, 3, [1, 2])
        assert not list(root.rglob(".manifest.json.tmp*")), "the manifest's temporary file was left behind"
        inject.enabled = False
        assert_recovers(mgr, root, 3)


def test_no_space_for_the_manifest_leaves_no_step_directory(run, monkeypatch):
    root, _ = run
    inject = FailingWriteFile(_manifest_tmp, _always, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(local, "write_file", inject)
    with tg.CheckpointManager(root) as mgr:
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, 3, make_state(3))
    assert inject.injected == 1
    for args in (["verify", str(root), "--all"], ["verify", str(root)]):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, (args, result.output)
    assert not (root / "step-000000003").exists()


# -- other failures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=mode_id)
@pytest.mark.parametrize("where", ["chunk-put", "chunk-write-EIO", "publish"])
def test_any_other_failure_in_a_save_raises_save_error_and_commits_nothing(run, monkeypatch, mode, where):
    root, before = run
    fired: list[Any] = []
    if where == "chunk-put":  # a bug inside write_data, on the second chunk
        real_put = chunkstore.ChunkStore.put

        def put(self: Any, buf: Any, tmp_dir: Path, **kw: Any) -> Any:
            fired.append(len(buf))
            if len(fired) == 2:
                raise RuntimeError("injected failure in write_data")
            return real_put(self, buf, tmp_dir, **kw)

        monkeypatch.setattr(chunkstore.ChunkStore, "put", put)
        cause: type[BaseException] = RuntimeError
    elif where == "chunk-write-EIO":  # an I/O error that is not a full disk
        inject = FailingWriteFile(is_chunk_tmp, _always, OSError(errno.EIO, "injected I/O error"))
        monkeypatch.setattr(local, "write_file", inject)
        fired = inject.injections
        cause = OSError
    else:  # a failure in the commit itself: publishing the manifest raises
        disk = faulty_local(
            monkeypatch,
            Fault("write", match="*/manifest.json", exc=RuntimeError("injected failure in the commit")),
        )
        fired = disk.injected
        cause = RuntimeError
    with tg.CheckpointManager(root, **mode) as mgr:
        with pytest.raises(tg.SaveError) as ei:
            commit_save(mgr, 3, make_state(3))
        assert fired, "the fault never fired"
        err = ei.value
        assert not isinstance(err, tg.StorageFullError)
        assert err.step == 3
        assert isinstance(err.rank_errors.get(0), cause), err.rank_errors
        assert "injected" in str(err) and "nothing was committed" in str(err), str(err)
        assert_failed_cleanly(root, before, 3, [1, 2])
        monkeypatch.undo()
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
def test_retention_keeps_the_newest_valid_checkpoint_when_the_newest_save_fails(
    tmp_path, monkeypatch, steps, keep
):
    root = tmp_path / "root"
    *good, failing = steps
    with tg.CheckpointManager(root, keep=keep) as mgr:
        for s in good:
            commit_save(mgr, s, make_state(s))
        kept = sorted(good)[-keep:]
        assert [i.step for i in mgr.checkpoints()] == kept
        before = snapshot(root, kept)
        disk = DiskFull(1_000_000)
        monkeypatch.setattr(local, "os", disk)
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, failing, make_state(failing))
        assert disk.injected >= 1
        monkeypatch.undo()
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
@pytest.mark.parametrize("durability", ["per_file", "batched"])
def test_a_failed_save_leaves_no_orphan_chunks(run, monkeypatch, save_bytes, durability):
    root, before = run
    total, manifest = save_bytes
    renamed: list[str] = []

    class RecordingDisk(DiskFull):  # also records the chunks renamed into chunks/
        def replace(self, src: Any, dst: Any) -> None:
            os.replace(src, dst)
            if Path(dst).parent.parent.name == "chunks":
                renamed.append(str(dst))

    disk = RecordingDisk(total - manifest - 1000)  # every chunk but the last one makes it
    monkeypatch.setattr(local, "os", disk)
    with tg.CheckpointManager(root, durability=durability) as mgr:
        with pytest.raises(tg.StorageFullError):
            commit_save(mgr, 3, make_state(3))
    require(disk.injected >= 1, "the disk filled up")
    if durability == "per_file":
        require(renamed, "the failed save had renamed a chunk into chunks/")
    else:  # batched: chunks become visible only once all of them are written and flushed
        assert renamed == []
    monkeypatch.undo()
    with tg.CheckpointManager(root):  # a restarted job does not collect them either
        pass
    orphans = chunk_files(root) - referenced_chunks(root, [1, 2])
    assert not orphans, f"{len(orphans)} orphan chunk(s) left: {sorted(orphans)}"


def test_storage_full_error_carries_errno_enospc(run, monkeypatch):
    root, _ = run
    monkeypatch.setattr(local, "os", DiskFull(0))
    with tg.CheckpointManager(root) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
    assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
    assert ei.value.errno == errno.ENOSPC


def test_storage_full_at_the_manifest_names_the_step(run, monkeypatch):
    root, _ = run
    inject = FailingWriteFile(_manifest_tmp, _always, OSError(errno.ENOSPC, "No space left on device"))
    monkeypatch.setattr(local, "write_file", inject)
    with tg.CheckpointManager(root) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 3, make_state(3))
    require(inject.injected == 1, "the manifest write failed")
    assert ei.value.step == 3
