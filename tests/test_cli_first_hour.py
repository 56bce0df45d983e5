"""What a new user met in their first hour with the CLI (issue 11's follow-up): each test failed before its fix.

info on a damaged value chunk, the hints for a suspect step, gc on a folder that is not a run root, gc's
count of referenced chunks, gc's advice while a job runs, status and ls agreeing, ``--json`` on a folder that
is not a run root, option hints that work, and ``mark`` on a step whose manifest is garbage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.cli.main import main
from trainguard.format import MANIFEST_NAME, step_dir_name


def cli(*args: str) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def make_run(root: Path, steps=(1, 2, 3)) -> None:
    with tg.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(
                s,
                {
                    "model": {"w": torch.full((64,), float(s))},
                    "extra": {"lr": 0.1 * s, "note": "x" * 20000 + str(s)},
                },
            )


def value_chunk(root: Path, step: int) -> Path:
    """The chunk holding step's value ``extra`` (over 16 KiB: stored in a chunk, not inline)."""
    m = read_manifest(root, step)
    return root / m.chunks[m.entries["extra"].segments[0].chunk].path


def test_info_on_a_chunk_failing_crc_says_corrupt_and_exits_1(tmp_path):
    make_run(tmp_path)
    p = value_chunk(tmp_path, 3)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    r = cli("info", tmp_path, 3)
    assert r.exit_code == 1, r.output
    assert "corrupt" in r.output.splitlines()[1] and "CRC32C" in r.output  # the header line says it
    r = cli("info", tmp_path, 3, "--json")
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["status"] == "corrupt" and "CRC32C" in doc["problem"]


def test_a_suspect_step_points_to_mark_clear_and_verify_reports_it(tmp_path):
    make_run(tmp_path)
    assert cli("mark", tmp_path, 3, "--suspect", "probe differs").exit_code == 0
    r = cli("info", tmp_path, 3)
    assert r.exit_code == 1 and f"trainguard mark {tmp_path} 3 --clear" in r.stderr
    assert "trainguard verify" not in r.stderr  # re-reading intact bytes does not clear it
    r = cli("verify", tmp_path, "--all")
    assert r.exit_code == 0, r.output  # the bytes are intact: not a verify failure
    assert "step 3: ok (bytes intact) but SUSPECT: probe differs" in r.stdout and "--clear" in r.stdout
    doc = json.loads(cli("verify", tmp_path, "--step", 3, "--json").stdout)
    assert doc["ok"] is True and doc["suspect"] == [{"step": 3, "reason": "probe differs"}]


def test_gc_refuses_a_folder_that_is_not_a_run_root_and_creates_nothing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("gc", empty)
    assert r.exit_code == 1 and "not a run root" in r.stderr
    assert list(empty.iterdir()) == []  # no .lock
    with pytest.raises(tg.ConfigError, match="not a run root"):
        from trainguard.validation.scrub import gc

        gc(empty)
    assert list(empty.iterdir()) == []


def test_gc_counts_the_chunks_of_every_readable_manifest_when_one_is_garbage(tmp_path):
    make_run(tmp_path, steps=(1, 2, 3, 4, 5, 6))
    referenced = set().union(*(read_manifest(tmp_path, s).chunks for s in range(1, 6)))
    (tmp_path / step_dir_name(6) / MANIFEST_NAME).write_bytes(b"garbage")
    r = cli("gc", tmp_path)
    assert r.exit_code == 0, r.output
    assert f"{len(referenced)} referenced chunk(s) kept" in r.stdout and len(referenced) > 0
    assert "step(s) 6 cannot be read" in r.stdout and "no orphan was removed" in r.stdout
    doc = json.loads(cli("gc", tmp_path, "--json").stdout)
    assert doc["referenced"] == len(referenced) and doc["unreadable_manifests"] == [6]


def test_gc_while_a_job_holds_the_root_says_to_stop_or_wait(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        r = cli("gc", tmp_path)
    assert r.exit_code == 1
    assert "stop the job, or wait until it ends" in r.stderr and "read_only" not in r.stderr


def test_gc_dry_run_works_beside_a_writer_deletes_nothing_and_says_the_plan_may_change(tmp_path):
    """Tester finding: a dry run was refused like a real gc although it deletes nothing."""
    orphan = tmp_path / "chunks" / "ab" / ("ab" + "0" * 30)
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        orphan.parent.mkdir(parents=True, exist_ok=True)
        orphan.write_bytes(b"x" * 10)
        r = cli("gc", tmp_path, "--dry-run", "--orphans-older-than", "0s")
        assert r.exit_code == 0, r.output
        assert "a job holds" in r.stdout and "may change" in r.stdout
        assert f"would remove orphan chunks/ab/{orphan.name}" in r.stdout
        doc = json.loads(cli("gc", tmp_path, "--dry-run", "--orphans-older-than", "0s", "--json").stdout)
        assert doc["writer_active"] is True and doc["orphans"] == [f"chunks/ab/{orphan.name}"]
        assert orphan.exists()  # a dry run deletes nothing
        assert cli("gc", tmp_path, "--orphans-older-than", "0s").exit_code == 1  # a real gc is still refused
        assert orphan.exists()
        mgr.save(2, {"w": torch.ones(3)}).wait()  # the writer's lock was left alone
    doc = json.loads(cli("gc", tmp_path, "--dry-run", "--orphans-older-than", "0s", "--json").stdout)
    assert doc["writer_active"] is False


def test_status_uses_the_same_statuses_and_counts_as_ls(tmp_path):
    make_run(tmp_path, steps=(1, 2, 3, 4))
    (tmp_path / step_dir_name(4) / "verified.json").unlink()  # no full read recorded: unverified
    rows = json.loads(cli("ls", tmp_path, "--json").stdout)
    by_status: dict[str, int] = {}
    for row in rows:
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
    assert by_status == {"valid": 3, "unverified": 1}
    doc = json.loads(cli("status", tmp_path, "--json").stdout)
    assert doc["checkpoints"] == by_status
    assert doc["newest_valid"]["step"] == 4 and doc["newest_valid"]["status"] == "unverified"
    text = cli("status", tmp_path).stdout
    assert "3 valid, 1 unverified" in text and "step 4 (unverified)" in text
    assert "newest valid checkpoint" not in text


@pytest.mark.parametrize("command", ["ls", "info", "verify", "status", "gc"])
def test_json_on_a_folder_that_is_not_a_run_root_is_an_error_object_and_exit_1(tmp_path, command):
    folder = tmp_path / "not-a-root"
    folder.mkdir()
    r = cli(command, folder, "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert isinstance(doc, dict) and "not a run root" in doc["error"]
    r = cli(command, folder)
    assert r.exit_code == 1 and "not a run root" in r.stderr and r.stdout == ""
    assert list(folder.iterdir()) == []


def test_option_hints_name_values_that_are_accepted(tmp_path):
    make_run(tmp_path, steps=(1,))
    r = cli("verify", tmp_path, "--max-bandwidth", "0")
    assert r.exit_code == 2 and "must be > 0" in r.stderr and "no unit" not in r.stderr
    r = cli("gc", tmp_path, "--quarantine-older-than", "7")
    assert r.exit_code == 2 and "7d" in r.stderr
    assert cli("gc", tmp_path, "--quarantine-older-than", "7d").exit_code == 0


def test_mark_refuses_a_step_whose_manifest_is_garbage(tmp_path):
    make_run(tmp_path)
    (tmp_path / step_dir_name(3) / MANIFEST_NAME).write_bytes(b"garbage")
    r = cli("mark", tmp_path, 3, "--suspect", "x")
    assert r.exit_code == 1 and "corrupt, not marked" in r.stderr
    assert not (tmp_path / step_dir_name(3) / "suspect.json").exists()
