"""Checkpoints are never condemned or lost while good bytes exist (issue 16), and every view agrees with the
last full read (issue 18).

- A save never deduplicates against stored bytes it has not verified since they were written or since the
  process started: a damaged shared chunk is written anew (which repairs every checkpoint sharing it).
- Only a confirmed mismatch (read twice) condemns a chunk; an I/O error is retried, reported and never recorded
  as corruption; a passing full verify clears a stale marker.
- ``ls``, ``info``, ``latest_step`` and ``restore_latest`` agree with what ``verify`` found; a checkpoint whose
  bytes no full check has read lists as ``unverified``.
- ``chunks/`` may be a symlink onto another place or filesystem.
- A full disk has a way out: retention at open, orphan collection at open, a message naming a step that works.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
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
    flip_bit,
    make_state,
    manifest_path,
    owners_of,
    read_manifest_json,
    referenced_chunks,
    require,
)

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.errors import ConfigError
from trainguard.integrity.verify import verify
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, LocalStorage

STEPS = (1, 2, 3)


def frozen_chunk(root: Path, step: int = 1) -> dict[str, Any]:
    """The record of the chunk that holds ``model.frozen`` (shared by every checkpoint)."""
    for h, rec in read_manifest_json(root, step)["chunks"].items():
        if owners_of(root, step, h) == ["model.frozen"]:
            return rec
    raise AssertionError("no chunk holds model.frozen alone")


def ls_json(root: Path) -> dict[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    return {row["step"]: row for row in json.loads(result.output)}


def verify_json(root: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(cli, ["verify", str(root), *args, "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(result.output)


def statuses(root: Path) -> list[str]:
    return [row["status"] for _, row in sorted(ls_json(root).items())]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in STEPS:
            commit_save(mgr, s, make_state(s))
    return root


# -- a damaged shared chunk -------------------------------------------------------------------------------
@pytest.mark.parametrize("process", ["same-manager", "new-manager"])
def test_a_flipped_bit_in_a_chunk_every_checkpoint_shares_is_repaired_by_the_next_save(
    tmp_path, caplog, process
):
    """The frozen embedding's chunk is damaged after step 1; saves 2 and 3 must not reference the damaged copy
    (the issue's input: all three kept checkpoints were unrestorable)."""
    root = tmp_path / "root"
    mgr = tg.CheckpointManager(root, keep=3)
    commit_save(mgr, 1, make_state(1))
    rec = frozen_chunk(root)
    flip_bit(root / rec["path"], 1000, 3)
    if process == "new-manager":
        mgr.close()
        mgr = tg.CheckpointManager(root, keep=3)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        for s in (2, 3):
            commit_save(mgr, s, make_state(s))
    mgr.close()
    assert rec["path"] in caplog.text and "anew" in caplog.text, caplog.text
    report = verify(root)
    assert report.ok, report.corrupt  # the rewrite repaired step 1 too: it shares the chunk
    assert statuses(root) == ["valid"] * 3
    for s in STEPS:
        state = blank_state()
        tg.CheckpointManager(root, read_only=True).restore(s, state)
        assert_state_is(state, s)


def test_a_chunk_verified_once_is_not_read_again_by_later_saves(tmp_path):
    """Verify once and remember: a process re-reads an existing chunk before its first dedup only."""
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, make_state(1))
    reads = Fault("read", match=frozen_chunk(root)["path"], times=None)  # no effect: counts the reads
    with tg.CheckpointManager(FaultyStorage(LocalStorage(root), reads)) as mgr:
        for s in (2, 3, 4):
            commit_save(mgr, s, make_state(s))
    assert reads.seen == 1


def test_a_chunk_changed_after_this_process_verified_it_is_checked_again(tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, make_state(1))
        commit_save(mgr, 2, make_state(2))  # remembered as verified
        flip_bit(root / frozen_chunk(root)["path"], 0, 0)
        commit_save(mgr, 3, make_state(3))
    assert verify(root).ok


# -- only a confirmed mismatch condemns ---------------------------------------------------------------------
def test_chunks_unreadable_for_a_while_are_never_marked_corrupt(saved, monkeypatch):
    """The issue's input: permissions broke every chunk read during a restore; after they were fixed the
    checkpoints still listed corrupt and restore_latest raised NoValidCheckpointError."""
    disk = faulty_local(monkeypatch, Fault("read", match="chunks/*", times=None, errno=errno.EACCES))
    injected = disk.injected
    with tg.CheckpointManager(saved) as mgr:
        with pytest.raises(tg.NoValidCheckpointError) as ei:
            mgr.restore_latest(blank_state())
    require(injected, "the reads failed")
    msg = str(ei.value)
    assert "could not be read" in msg and "NOT marked corrupt" in msg and "new run root" in msg, msg
    assert "do not start a new run root" in msg
    assert not list(saved.glob("step-*/corrupt.json"))
    assert list(Path(saved).glob("chunks/*/*.corrupt-*")) == []  # nothing quarantined
    assert statuses(saved) == ["unverified"] * 3  # not corrupt, and not "valid" after a failed read
    code, report = verify_json(saved, "--all")
    assert code == 1 and "cannot be read" in report["corrupt"][0]["problem"]
    disk.clear()  # permissions fixed
    state = blank_state()
    with tg.CheckpointManager(saved) as mgr:
        assert mgr.restore_latest(state) == 3
    assert_state_is(state, 3)
    code, report = verify_json(saved, "--all")
    assert code == 0 and report["ok"]
    assert statuses(saved) == ["valid"] * 3


def test_an_io_error_that_goes_away_on_retry_loses_nothing(saved):
    # the first read fails with EIO; the storage has recovered when the reader retries after its backoff
    disk = FaultyStorage(
        LocalStorage(saved), Fault("read", match=frozen_chunk(saved)["path"], errno=errno.EIO)
    )
    state = blank_state()
    with tg.CheckpointManager(disk) as mgr:
        assert mgr.restore_latest(state) == 3
    require(len(disk.injected) == 1, "one read failed")
    assert_state_is(state, 3)
    assert read_events(saved, event="restore_skipped") == []


def test_a_mismatch_that_a_second_read_does_not_confirm_condemns_nothing(saved, monkeypatch):
    """A writing restore that reads a shared chunk wrong once: no marker, no quarantine, no fallback."""
    rec = frozen_chunk(saved)
    disk = faulty_local(monkeypatch, Fault("read", match=rec["path"], flip_byte=0))
    state = blank_state()
    with tg.CheckpointManager(saved) as mgr:
        assert mgr.restore_latest(state) == 3
    require(len(disk.injected) == 1, "one read returned flipped bytes")
    assert_state_is(state, 3)
    assert (saved / rec["path"]).exists(), "the shared chunk was quarantined on one bad read"
    assert not list(saved.glob("step-*/corrupt.json"))
    disk.add(Fault("read", match=rec["path"], flip_byte=0))
    assert verify(saved).ok  # verify confirms too
    assert statuses(saved) == ["valid"] * 3


def quarantine_step3_big(saved):
    """Flip a bit of step 3's ``model.big`` chunk; a restore falls back to step 2 and quarantines the chunk.
    Returns the chunk's manifest record."""
    rec = next(
        r
        for h, r in read_manifest_json(saved, 3)["chunks"].items()
        if owners_of(saved, 3, h) == ["model.big"]
    )
    flip_bit(saved / rec["path"], 5, 1)
    with tg.CheckpointManager(saved) as mgr:
        assert mgr.restore_latest(blank_state()) == 2
    return rec


def test_a_confirmed_mismatch_still_condemns_and_quarantines(saved):
    rec = quarantine_step3_big(saved)
    assert (saved / "step-000000003" / "corrupt.json").exists()
    assert not (saved / rec["path"]).exists() and list((saved / rec["path"]).parent.glob("*.corrupt-*"))
    assert statuses(saved) == ["valid", "valid", "corrupt"]


def test_a_full_verify_that_passes_clears_a_stale_corrupt_marker(saved):
    marker = saved / "step-000000003" / "corrupt.json"
    marker.write_text(json.dumps({"problem": "chunk x cannot be read (Permission denied)", "chunk": None}))
    assert statuses(saved)[2] == "corrupt"
    with tg.CheckpointManager(saved, read_only=True) as ro:
        assert ro.latest_step() == 2
    code, report = verify_json(saved, "--all")
    assert code == 0 and report["ok"]
    assert not marker.exists()
    assert statuses(saved) == ["valid"] * 3
    state = blank_state()
    with tg.CheckpointManager(saved) as mgr:
        assert mgr.restore_latest(state) == 3
    assert_state_is(state, 3)


# -- every view agrees with the last full read (issue 18) ---------------------------------------------------
def test_after_verify_finds_a_corrupt_chunk_every_view_agrees(saved):
    """The issue's input: verify said CORRUPT (exit 1), ls still said valid, info exited 0 on it and a
    read-only latest_step() returned it while restore_latest fell back."""
    rec = next(
        r
        for h, r in read_manifest_json(saved, 3)["chunks"].items()
        if owners_of(saved, 3, h) == ["model.big"]
    )
    flip_bit(saved / rec["path"], 77, 2)
    result = CliRunner().invoke(cli, ["verify", str(saved)])
    assert result.exit_code == 1 and "CORRUPT" in result.output
    rows = ls_json(saved)
    assert rows[3]["status"] == "corrupt" and rec["path"] in rows[3]["problem"]
    info = CliRunner().invoke(cli, ["info", str(saved), "--json"])
    assert info.exit_code == 0 and json.loads(info.stdout)["step"] == 2  # the newest usable one
    assert json.loads(info.stdout)["status"] == "valid"
    info3 = CliRunner().invoke(cli, ["info", str(saved), "3", "--json"])
    assert info3.exit_code == 1 and json.loads(info3.stdout)["status"] == "corrupt"
    ro = tg.CheckpointManager(saved, read_only=True)
    state = blank_state()
    assert ro.latest_step() == ro.restore_latest(state) == 2
    assert_state_is(state, 2)


def test_a_read_only_restore_that_falls_back_makes_latest_step_agree(saved):
    """Without any verify: the read-only manager's latest_step() returned the step its own restore_latest had
    just found corrupt and skipped."""
    rec = next(
        r
        for h, r in read_manifest_json(saved, 3)["chunks"].items()
        if owners_of(saved, 3, h) == ["model.big"]
    )
    flip_bit(saved / rec["path"], 123, 4)
    ro = tg.CheckpointManager(saved, read_only=True)
    assert ro.latest_step() == 3  # nothing has read the bytes since the save: the last full read passed
    state = blank_state()
    assert ro.restore_latest(state) == 2
    assert_state_is(state, 2)
    assert ro.latest_step() == 2 and statuses(saved) == ["valid", "valid", "corrupt"]
    assert (saved / rec["path"]).exists(), "a read-only manager moved a chunk"


def test_a_chunk_whose_metadata_cannot_be_read_lists_as_unverified_not_corrupt(saved, monkeypatch):
    rec = frozen_chunk(saved)
    disk = faulty_local(monkeypatch, Fault("stat", match=rec["path"], times=None, errno=errno.EACCES))
    denied = disk.injected
    rows = ls_json(saved)
    require(denied, "the stat failed")
    assert [rows[s]["status"] for s in STEPS] == ["unverified"] * 3
    assert "cannot be read" in rows[3]["problem"] and "not marked corrupt" in rows[3]["problem"]
    state = blank_state()
    assert tg.CheckpointManager(saved, read_only=True).restore_latest(state) == 3  # tried, not skipped
    assert_state_is(state, 3)


def test_verify_of_one_step_condemns_every_step_sharing_its_damaged_chunk(saved):
    rec = frozen_chunk(saved)
    flip_bit(saved / rec["path"], 3, 3)
    code, report = verify_json(saved)  # default: the newest step only
    assert code == 1 and report["checked"] == [3]
    assert statuses(saved) == ["corrupt"] * 3  # steps 1 and 2 reference the same damaged bytes
    ro = tg.CheckpointManager(saved, read_only=True)
    assert ro.latest_step() is None
    with pytest.raises(tg.NoValidCheckpointError):
        ro.restore_latest(blank_state())


def test_a_checkpoint_no_full_read_has_checked_lists_as_unverified(saved):
    for s in STEPS:
        (saved / f"step-00000000{s}" / "verified.json").unlink()  # e.g. written by an older trainguard
    rows = ls_json(saved)
    assert [rows[s]["status"] for s in STEPS] == ["unverified"] * 3
    assert "trainguard verify" in rows[3]["problem"]
    info = CliRunner().invoke(cli, ["info", str(saved), "--json"])
    assert info.exit_code == 0 and json.loads(info.stdout)["status"] == "unverified"  # shown, not a failure
    ro = tg.CheckpointManager(saved, read_only=True)
    assert ro.latest_step() == 3
    state = blank_state()
    assert ro.restore_latest(state) == 3  # restore reads and checks every byte it loads
    assert_state_is(state, 3)
    assert verify_json(saved, "--step", "2")[0] == 0
    assert statuses(saved) == ["unverified", "valid", "unverified"]


# -- chunks/ placed elsewhere -------------------------------------------------------------------------------
@pytest.fixture(params=["same-filesystem", "other-filesystem"])
def moved_chunks(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    if request.param == "same-filesystem":
        base = tmp_path / "bulk"
    else:
        shm = Path("/dev/shm")
        if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("no second filesystem (/dev/shm) on this machine")
        base = shm / f"trainguard-test-{os.getpid()}-{tmp_path.name}"
        request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    (base / "chunks").mkdir(parents=True)
    root = tmp_path / "root"
    root.mkdir()
    (root / "chunks").symlink_to(base / "chunks", target_is_directory=True)
    return root


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_chunks_directory_moved_to_another_place_saves_restores_and_retains(moved_chunks, async_save):
    """The issue's input: with chunks/ a symlink to another disk every save reported success and every
    checkpoint then listed as corrupt ("resolves outside the run root")."""
    root = moved_chunks
    with tg.CheckpointManager(root, keep=2, async_save=async_save) as mgr:
        for s in STEPS:
            commit_save(mgr, s, make_state(s))
        assert [i.status for i in mgr.checkpoints()] == ["valid", "valid"]
        state = blank_state()
        assert mgr.restore_latest(state) == 3
        assert_state_is(state, 3)
    assert (root / "chunks").is_symlink()
    assert verify(root).ok and statuses(root) == ["valid", "valid"]
    assert chunk_files(root) == referenced_chunks(root, [2, 3]), "retention did not free step 1's chunks"
    assert not list((root / "chunks").glob(".step-*")), "a temporary directory was left in chunks/"


@pytest.mark.parametrize("what", ["chunk-directory-outside", "dangling-chunks-link"])
def test_a_layout_whose_chunks_restore_would_refuse_is_refused_at_the_first_save(tmp_path, what):
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "chunk-directory-outside":
        (root / "chunks").mkdir(parents=True)
        (root / "chunks" / "ab").symlink_to(outside, target_is_directory=True)
    else:
        root.mkdir()
        (root / "chunks").symlink_to(tmp_path / "missing", target_is_directory=True)
    with tg.CheckpointManager(root) as mgr, pytest.raises(ConfigError, match="chunks"):
        mgr.save(1, make_state(1))
    assert not manifest_path(root, 1).exists()


# -- a full disk has a way out ------------------------------------------------------------------------------
def test_reopening_with_a_stricter_keep_frees_space_before_the_first_save_writes(saved):
    before = chunk_files(saved)
    kept = referenced_chunks(saved, [3])
    seen: list[set[str]] = []
    # what is on disk when the save writes its first chunk
    watch = Fault("write", staging="*.partial-*", call=lambda key: seen.append(chunk_files(saved)))
    with tg.CheckpointManager(FaultyStorage(LocalStorage(saved), watch), keep=1) as mgr:
        state = blank_state()
        assert mgr.restore_latest(state) == 3
        assert_state_is(state, 3)
        commit_save(mgr, 4, make_state(4))
    assert seen and seen[0] == kept and len(before) > len(kept)
    assert [i.step for i in tg.CheckpointManager(saved, read_only=True).checkpoints()] == [4]


def test_retention_at_open_deletes_nothing_when_the_checkpoint_it_keeps_is_damaged(saved):
    rec = next(
        r
        for h, r in read_manifest_json(saved, 3)["chunks"].items()
        if owners_of(saved, 3, h) == ["model.big"]
    )
    flip_bit(saved / rec["path"], 9, 0)
    with tg.CheckpointManager(saved, keep=1, async_save=False) as mgr:
        commit_save(mgr, 4, make_state(4))  # continues the root's run without restoring (implicit resume)
    assert [e["step"] for e in read_events(saved, event="retention_deferred")] == [3]
    assert not read_events(saved, event="retention_delete") or all(
        e["t"] > read_events(saved, event="retention_deferred")[0]["t"]
        for e in read_events(saved, event="retention_delete")
    )  # nothing was deleted before step 4 committed


def test_step_directories_deleted_by_hand_free_their_chunks_at_the_next_open(saved):
    for s in (1, 2):
        shutil.rmtree(saved / f"step-00000000{s}")
    assert chunk_files(saved) != referenced_chunks(saved, [3])
    with tg.CheckpointManager(saved):
        pass
    assert chunk_files(saved) == referenced_chunks(saved, [3])
    assert verify(saved).ok


def test_storage_full_names_the_step_that_keep_1_keeps_and_what_it_frees(saved):
    full = Fault("write", staging="*.partial-*", times=None, errno=errno.ENOSPC)  # no room for a new chunk
    with tg.CheckpointManager(FaultyStorage(LocalStorage(saved), full)) as mgr:
        with pytest.raises(tg.StorageFullError) as ei:
            commit_save(mgr, 4, make_state(4))
    msg = str(ei.value)
    assert "keep=1" in msg and "keeps step 3" in msg and "deletes steps [1, 2]" in msg, msg
    freed = int(msg.split("freeing ")[1].split(" bytes")[0])
    assert freed == sum(
        os.path.getsize(saved / c) for c in referenced_chunks(saved, [1, 2]) - referenced_chunks(saved, [3])
    )
    row = ls_json(saved)[4]  # the failed step is listed, with its error
    assert row["status"] == "incomplete" and "failed" in row["problem"] and "no space" in row["problem"]
    with tg.CheckpointManager(saved, keep=1) as mgr:  # what the message says works
        commit_save(mgr, 4, make_state(4))
        assert [i.step for i in mgr.checkpoints()] == [4]
    assert manifest_path(saved, 4).exists()


def test_a_quarantined_chunk_is_reported_as_found_corrupt_and_moved_aside_not_missing(saved):
    """Tester report 5, finding 4: after a restore quarantined a bit-flipped chunk, ls, ls --json, status and
    the next launch's NoValidCheckpointError said "chunk ... is missing"; they name the CRC32C mismatch and
    where the bytes went."""
    recs = {}
    for s in STEPS:
        recs[s] = next(
            r
            for h, r in read_manifest_json(saved, s)["chunks"].items()
            if owners_of(saved, s, h) == ["model.big"]
        )
        flip_bit(saved / recs[s]["path"], 5, 1)
    with tg.CheckpointManager(saved) as mgr, pytest.raises(tg.NoValidCheckpointError):
        mgr.restore_latest(blank_state())
    marker = json.loads((saved / "step-000000003" / "corrupt.json").read_text())
    [moved] = list((saved / recs[3]["path"]).parent.glob(Path(recs[3]["path"]).name + ".corrupt-*"))
    assert marker["moved_to"] == recs[3]["path"] + moved.name[len(Path(recs[3]["path"]).name) :]
    rows = ls_json(saved)
    for s in STEPS:
        problem = rows[s]["problem"]
        assert rows[s]["status"] == "corrupt" and "is missing" not in problem, problem
        assert "found corrupt by a restore and moved aside" in problem and "CRC32C" in problem, problem
    assert str(moved) in rows[3]["problem"]
    out = CliRunner().invoke(cli, ["ls", str(saved)]).output
    assert "moved aside" in out and "is missing" not in out, out
    assert "is missing" not in CliRunner().invoke(cli, ["status", str(saved)]).output
    out = CliRunner().invoke(cli, ["verify", str(saved), "--all"]).output
    assert f"moved aside (quarantined) to {moved}" in out and "is missing" not in out, out
    with tg.CheckpointManager(saved) as mgr, pytest.raises(tg.NoValidCheckpointError) as ei:
        mgr.restore_latest(blank_state())
    assert "moved aside" in str(ei.value) and "is missing" not in str(ei.value), str(ei.value)


def test_after_gc_removed_the_quarantined_copy_ls_still_names_the_recorded_mismatch(saved):
    rec = quarantine_step3_big(saved)
    for copy in (saved / rec["path"]).parent.glob("*.corrupt-*"):
        copy.unlink()  # what gc --quarantine-older-than does
    problem = ls_json(saved)[3]["problem"]
    assert problem.startswith(f"chunk {rec['path']} is missing; recorded in step-000000003/corrupt.json: "), (
        problem
    )
    assert "CRC32C" in problem
