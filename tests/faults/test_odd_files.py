"""Odd files under a run root: symlinks, named pipes, directories and /dev/zero where trainguard expects a
regular file, odd roots, odd event lines and misnamed step folders.

Every file trainguard opens under a root is opened without following a symlink and without blocking, only
regular files are read, and each read is bounded. Operations that would hang or allocate without bound on a
regression run in a subprocess with a time limit and ``RLIMIT_AS`` (``faultlib.run_limited``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from faultlib import assert_state_is, blank_state, commit_save, make_state, manifest_path, run_limited

import trainguard as tg
from trainguard.errors import ConfigError, UnsafeFileError
from trainguard.recovery.events import read_events

RESTORE = """
import json, sys
sys.path.insert(0, {tests!r})
from faultlib import blank_state
import trainguard as tg
with tg.CheckpointManager({root!r}, read_only=True) as mgr:
    state = blank_state()
    step = mgr.restore_latest(state)
    print(json.dumps({{"restored": step, "status": {{i.step: i.status for i in mgr.checkpoints()}}}}))
"""
TESTS = str(Path(__file__).parent)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("odd") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    return root


@pytest.fixture
def root(base: Path, tmp_path: Path) -> Path:
    r = tmp_path / "root"
    shutil.copytree(base, r, ignore=shutil.ignore_patterns(".lock"))
    return r


def ls_json(root: Path) -> list[dict]:
    rc, out, err = run_limited(["-m", "trainguard", "ls", str(root), "--json"])
    assert rc == 0, out + err
    return json.loads(out)


def restore_latest(root: Path) -> dict:
    rc, out, err = run_limited(["-c", RESTORE.format(tests=TESTS, root=str(root))])
    assert rc == 0, out + err
    return json.loads(out.strip().splitlines()[-1])


# -- what an odd file can be ------------------------------------------------------------------------------
def make_fifo(p: Path, outside: Path) -> None:
    os.mkfifo(p)


def make_dev_zero(p: Path, outside: Path) -> None:
    p.symlink_to("/dev/zero")


def make_symlink_to_file(p: Path, outside: Path) -> None:
    outside.write_text('{"problem": "from outside"}')
    p.symlink_to(outside)


def make_directory(p: Path, outside: Path) -> None:
    p.mkdir()


ODD: dict[str, Callable[[Path, Path], None]] = {
    "named-pipe": make_fifo,
    "symlink-to-dev-zero": make_dev_zero,
    "symlink-to-a-file": make_symlink_to_file,
    "directory": make_directory,
}


def _replace(p: Path, kind: str, tmp_path: Path) -> None:
    if p.exists() or p.is_symlink():
        p.unlink()
    ODD[kind](p, tmp_path / "outside-file")


# -- the write lock ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(ODD))
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_never_truncated(root, tmp_path, kind):
    victim = tmp_path / "outside-file"
    _replace(root / ".lock", kind, tmp_path)
    before = victim.read_bytes() if victim.exists() else None
    with pytest.raises(UnsafeFileError, match=r"lock file .*\.lock is a"):
        tg.CheckpointManager(root)
    if before is not None:
        assert victim.read_bytes() == before, "the lock's symlink target was modified"


def test_a_lock_symlinked_to_a_2000_byte_file_leaves_it_intact(root, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 2000)
    (root / ".lock").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="symlink"):
        tg.CheckpointManager(root)
    assert victim.read_bytes() == b"x" * 2000


# -- the corrupt marker and the event log -----------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ODD))
def test_an_odd_corrupt_marker_makes_its_step_not_valid_without_hanging_or_reading_it(root, tmp_path, kind):
    _replace(root / "step-000000002" / "corrupt.json", kind, tmp_path)
    rows = {r["step"]: r for r in ls_json(root)}
    assert rows[1]["status"] == "valid"
    assert rows[2]["status"] == "corrupt" and "marker" in rows[2]["problem"], rows[2]
    out = restore_latest(root)
    assert out["restored"] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["named-pipe", "symlink-to-dev-zero", "symlink-to-a-file", "directory"])
def test_an_odd_event_log_file_is_skipped_by_ls_and_read_events(root, tmp_path, kind):
    _replace(root / "events" / "evil-1-abc.jsonl", kind, tmp_path)
    assert {r["step"]: r["status"] for r in ls_json(root)} == {1: "valid", 2: "valid"}
    rc, out, err = run_limited(
        ["-c", f"from trainguard.recovery.events import read_events; print(len(read_events({str(root)!r})))"]
    )
    assert rc == 0 and int(out.split()[-1]) > 0, out + err


def test_an_oversized_event_log_file_is_skipped(root, monkeypatch):
    import trainguard.eventlog as events

    (root / "events" / "big-1-abc.jsonl").write_text(
        json.dumps({"t": 1.0, "event": "save", "step": 99, "block_s": 1.0}) + "\n" + " " * 4096 + "\n"
    )
    monkeypatch.setattr(events, "MAX_EVENT_FILE_BYTES", 1024)
    assert not [e for e in read_events(root, event="save") if e.get("step") == 99]


def test_event_lines_whose_t_is_not_a_number_are_skipped(root):
    (root / "events" / "odd-1-abc.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"t": "abc", "event": "save", "step": 2, "block_s": 9.0},
                {"t": None, "event": "save", "step": 2},
                {"t": True, "event": "save", "step": 2},
                {"event": "save", "step": 2},
                [1, 2],
            )
        )
        + '\n{"t": 1e999, "event": "x"}\n'
    )
    result = CliRunner().invoke(tg_cli(), ["ls", str(root)])
    assert result.exit_code == 0, result.output
    assert all(isinstance(e["t"], float) for e in read_events(root))


def tg_cli():
    from trainguard.cli.main import main

    return main


def test_events_that_is_a_file_gives_a_trainguard_error(root):
    shutil.rmtree(root / "events")
    (root / "events").write_text("not a directory")
    with pytest.raises(UnsafeFileError, match="events .* not a directory"):
        tg.CheckpointManager(root)
    assert (root / "events").read_text() == "not a directory"
    result = CliRunner().invoke(tg_cli(), ["ls", str(root), "--json"])
    assert result.exit_code == 0 and len(json.loads(result.output)) == 2


# -- manifests and chunks ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(ODD))
def test_an_odd_manifest_is_reported_and_its_step_skipped(root, tmp_path, kind):
    _replace(manifest_path(root, 2), kind, tmp_path)
    rows = {r["step"]: r for r in ls_json(root)}
    assert rows[1]["status"] == "valid" and rows[2]["status"] == "corrupt", rows
    assert restore_latest(root)["restored"] == 1
    rc, out, err = run_limited(["-m", "trainguard", "verify", str(root), "--all", "--json"])
    assert rc == 1 and "Traceback" not in out + err, out + err
    assert [c["step"] for c in json.loads(out)["corrupt"]] == [2]
    rc, out, err = run_limited(["-m", "trainguard", "info", str(root), "2"])
    assert rc == 1 and "Traceback" not in out + err, out + err


@pytest.mark.parametrize("errno_", ["EACCES", "EIO"])
def test_an_unreadable_manifest_is_reported_and_its_step_skipped(root, monkeypatch, errno_):
    import errno

    from faultlib import faulty_local

    from trainguard.storage import Fault

    code = getattr(errno, errno_)
    bad = manifest_path(root, 2)
    disk = faulty_local(monkeypatch, Fault("read", match=str(bad.relative_to(root)), times=None, errno=code))
    hits = disk.injected
    result = CliRunner().invoke(tg_cli(), ["ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["step"]: r for r in json.loads(result.output)}
    assert rows[2]["status"] == "corrupt" and "cannot be read" in rows[2]["problem"], rows[2]
    for args in (["verify", str(root), "--step", "2"], ["info", str(root), "2"]):
        result = CliRunner().invoke(tg_cli(), args)
        assert result.exit_code == 1 and "cannot be read" in result.output, result.output
    with tg.CheckpointManager(root, read_only=True) as mgr:
        state = blank_state()
        assert mgr.restore_latest(state) == 1
    assert_state_is(state, 1)
    assert hits


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["named-pipe", "symlink-to-dev-zero", "directory"])
def test_an_odd_chunk_is_reported_by_ls_verify_and_restore(root, tmp_path, kind):
    body = json.loads(manifest_path(root, 2).read_bytes())
    h = body["entries"]["model.big"]["shards"][0]["segments"][0][0]
    _replace(root / body["chunks"][h]["path"], kind, tmp_path)
    assert {r["step"]: r["status"] for r in ls_json(root)} == {1: "valid", 2: "corrupt"}
    rc, out, err = run_limited(["-m", "trainguard", "verify", str(root), "--step", "2", "--json"])
    assert rc == 1, out + err
    problem = json.loads(out)["corrupt"][0]
    if kind == "symlink-to-dev-zero":  # the manifest path check resolves it first: outside the run root
        assert "outside the run root" in problem["problem"], problem
    else:
        assert problem["chunk"] == body["chunks"][h]["path"], problem
    assert restore_latest(root)["restored"] == 1


@pytest.mark.timeout(120)
def test_a_zero_length_chunk_that_is_a_named_pipe_does_not_hang_verify(root):
    from faultlib import sign
    from xxhash import xxh3_128_hexdigest

    body = json.loads(manifest_path(root, 2).read_bytes())
    h = xxh3_128_hexdigest(b"")
    rel = f"chunks/{h[:2]}/{h}"
    body["chunks"][h] = {"path": rel, "length": 0, "crc32c": 0, "codec": "raw"}
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / rel)
    manifest_path(root, 2).write_bytes(sign(body))
    rc, out, err = run_limited(["-m", "trainguard", "verify", str(root), "--step", "2", "--json"])
    assert rc == 1, out + err
    report = json.loads(out)
    assert report["corrupt"][0]["chunk"] == rel and "named pipe" in report["corrupt"][0]["problem"]


# -- odd roots --------------------------------------------------------------------------------------------
def test_a_root_that_is_a_file_or_a_dangling_symlink_gives_a_config_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for r, word in ((f, "is a file"), (dangling, "symlink")):
        for ro in (False, True):
            with pytest.raises(ConfigError, match=word):
                tg.CheckpointManager(r, read_only=ro)
        result = CliRunner().invoke(tg_cli(), ["ls", str(r)])
        assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit)
    assert f.read_text() == "x" and not (tmp_path / "nowhere").exists()


@pytest.fixture
def read_only_root(base: Path, tmpfs) -> Path:
    """A copy of the base root on a tmpfs remounted read-only (needs mount privileges)."""
    mnt = tmpfs("ro", "64m")
    shutil.copytree(base, mnt / "root", ignore=shutil.ignore_patterns(".lock"))
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    return mnt / "root"


def test_a_writer_on_a_read_only_filesystem_gets_a_config_error_and_readers_still_restore(read_only_root):
    with pytest.raises(ConfigError, match="read-only filesystem.*read_only=True"):
        tg.CheckpointManager(read_only_root)
    with pytest.raises(ConfigError, match="read-only filesystem"):
        tg.CheckpointManager(read_only_root / "new-run")
    with tg.CheckpointManager(read_only_root, read_only=True) as mgr:
        state = blank_state()
        assert mgr.restore_latest(state) == 2
    assert_state_is(state, 2)


def test_a_misnamed_step_folder_is_not_a_checkpoint(root):
    shutil.copytree(root / "step-000000002", root / "step-0000000007")
    shutil.copytree(root / "step-000000002", root / "step-7")
    result = CliRunner().invoke(tg_cli(), ["ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in json.loads(result.output)] == [1, 2]
    with tg.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore_latest(blank_state()) == 2


def test_trainguard_run_with_an_odd_root_is_a_usage_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "events").write_text("not a directory")
    for r, words in ((f, "is a file"), (tmp_path / "root", "event log")):
        result = CliRunner().invoke(tg_cli(), ["run", "--root", str(r), "--", "true"])
        assert result.exit_code == 2 and words in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert f.read_text() == "x" and (tmp_path / "root" / "events").read_text() == "not a directory"
