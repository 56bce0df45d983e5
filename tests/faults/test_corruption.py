"""Damaged checkpoints are reported by ``trainguard verify`` and skipped by ``restore_latest``.

A run root holds steps 1, 2 and 3 with different values for every tensor except ``model.frozen`` (one chunk
shared by all three). Each test damages something only step 3 references (a bit of a chunk, a truncated or
deleted chunk, a bit or the tail of the manifest) and checks that:

- ``trainguard verify ROOT --all --json`` exits 1 and names step 3, the chunk and the tensors it holds;
- ``restore_latest`` returns step 2 with step 2's exact values, logs a warning and records a
  ``restore_skipped`` event, after which ``checkpoints()`` lists step 3 as corrupt.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from faultlib import (
    assert_state_is,
    blank_state,
    chunks_only_in,
    commit_save,
    flip_bit,
    make_state,
    manifest_path,
    owners_of,
    read_manifest_json,
    sha256_file,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.integrity.verify import verify
from trainguard.recovery.events import read_events

STEPS = (1, 2, 3)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1-3 saved once per module. The property test damages it only temporarily and restores it
    read-only; other tests damage a copy."""
    root = tmp_path_factory.mktemp("pristine") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in STEPS:
            commit_save(mgr, s, make_state(s))
    assert verify(root).ok
    return root


@pytest.fixture
def run(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the pristine root (without its event log: events of this test only)."""
    root = tmp_path / "root"
    shutil.copytree(pristine, root, ignore=shutil.ignore_patterns("events", ".lock"))
    assert verify(root).ok
    return root


def newest_chunk(root: Path, holding: str) -> tuple[str, dict[str, Any]]:
    """(hash, record) of the chunk of step 3 that holds ``holding`` and that steps 1 and 2 do not reference."""
    for h, rec in chunks_only_in(root, 3, [1, 2]).items():
        if holding in owners_of(root, 3, h):
            return h, rec
    raise AssertionError(f"no chunk of step 3 alone holds {holding}")


def verify_cli(root: Path) -> dict[str, Any]:
    """``trainguard verify ROOT --all --json``: must exit 1 (a check failed), never with a traceback."""
    result = CliRunner().invoke(cli, ["verify", str(root), "--all", "--json"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["ok"] is False
    assert report["checked"] == list(STEPS)
    return report


def assert_falls_back(
    root: Path,
    caplog: pytest.LogCaptureFixture,
    chunk: str | None,
    tensors: list[str] | None,
    listed: str = "corrupt",
) -> None:
    """restore_latest skips step 3 for step 2 (values, warning, event), then lists step 3 as ``listed``."""
    with tg.CheckpointManager(root) as mgr:
        state = blank_state()
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            assert mgr.restore_latest(state) == 2
        assert_state_is(state, 2)
        warned = [
            r.getMessage()
            for r in caplog.records
            if r.name == "trainguard" and r.levelno == logging.WARNING and "step 3" in r.getMessage()
        ]
        assert warned, caplog.text
        skipped = read_events(root, event="restore_skipped")
        assert [e["step"] for e in skipped] == [3]
        if chunk is not None:
            assert chunk in warned[0]
            assert skipped[0].get("chunk") == chunk or chunk in skipped[0]["problem"]
        if tensors is not None:
            assert skipped[0]["tensors"] == tensors
        infos = {i.step: i for i in mgr.checkpoints()}
    assert [infos[s].status for s in STEPS] == ["valid", "valid", listed]
    if chunk is not None:
        assert chunk in (infos[3].problem or "")


# -- chunks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("holding", ["model.big", "model.small"], ids=["own-chunk", "packed-chunk"])
@pytest.mark.parametrize("where", ["first", "second", "middle", "last"])
def test_a_flipped_bit_in_a_chunk_is_reported_and_restore_falls_back(run, caplog, holding, where):
    h, rec = newest_chunk(run, holding)
    path = run / rec["path"]
    size = path.stat().st_size
    byte = {"first": 0, "second": 1, "middle": size // 2, "last": size - 1}[where]
    before = path.read_bytes()
    old, new = flip_bit(path, byte, bit=byte % 8)
    after = path.read_bytes()
    assert (
        old != new
        and len(after) == len(before)
        and sum(a != b for a, b in zip(before, after, strict=True)) == 1
    )

    owners = owners_of(run, 3, h)
    assert holding in owners and (holding == "model.big") == (owners == ["model.big"])
    report = verify_cli(run)
    assert [(c["step"], c["chunk"], c["tensors"]) for c in report["corrupt"]] == [(3, rec["path"], owners)]
    assert "CRC32C" in report["corrupt"][0]["problem"]
    assert_falls_back(run, caplog, rec["path"], owners)


@settings(max_examples=15, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_single_bit_flip_in_a_chunk_of_the_newest_step_is_caught(pristine, data):
    chunks = sorted(chunks_only_in(pristine, 3, [1, 2]).values(), key=lambda c: c["path"])
    rec = data.draw(st.sampled_from(chunks), label="chunk")
    byte = data.draw(st.integers(0, rec["length"] - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    path = pristine / rec["path"]
    flip_bit(path, byte, bit)
    try:
        report = verify(pristine)
        assert not report.ok and [(c["step"], c["chunk"]) for c in report.corrupt] == [(3, rec["path"])]
        state = blank_state()
        ro = tg.CheckpointManager(pristine, read_only=True)  # moves no chunk: the root stays reusable
        assert ro.restore_latest(state) == 2
        assert_state_is(state, 2)
        assert [s["step"] for s in ro.last_restore.skipped] == [3]
    finally:
        flip_bit(path, byte, bit)
    assert verify(pristine).ok


@pytest.mark.parametrize("damage", ["truncated", "emptied", "deleted"])
def test_a_truncated_or_deleted_chunk_is_reported_and_restore_falls_back(run, caplog, damage):
    h, rec = newest_chunk(run, "model.emb")
    path = run / rec["path"]
    if damage == "truncated":
        os.truncate(path, rec["length"] - 1)
    elif damage == "emptied":
        os.truncate(path, 0)
    else:
        path.unlink()
    assert not path.exists() or path.stat().st_size < rec["length"]
    report = verify_cli(run)
    assert [(c["step"], c["chunk"], c["tensors"]) for c in report["corrupt"]] == [
        (3, rec["path"], ["model.emb"])
    ]
    assert ("missing" if damage == "deleted" else "length") in report["corrupt"][0]["problem"]
    assert_falls_back(run, caplog, rec["path"], None)


# -- manifests --------------------------------------------------------------------------------------------
def _manifest_positions(root: Path) -> dict[str, int]:
    raw = manifest_path(root, 3).read_bytes()
    crc = str(json.loads(raw)["crc32c"]).encode()
    first_hash = next(iter(read_manifest_json(root, 3)["chunks"]))
    return {
        "first-byte": 0,
        "last-byte": len(raw) - 1,
        "middle": len(raw) // 2,
        "stored-crc": raw.index(b'"crc32c":' + crc) + len(b'"crc32c":'),
        "chunk-hash": raw.index(first_hash.encode()) + 5,
        "step-number": raw.index(b'"step":3') + len(b'"step":'),
    }


@pytest.mark.parametrize(
    "where", ["first-byte", "last-byte", "middle", "stored-crc", "chunk-hash", "step-number"]
)
def test_a_flipped_bit_in_the_manifest_is_reported_and_restore_falls_back(run, caplog, where):
    byte = _manifest_positions(run)[where]
    digest = sha256_file(manifest_path(run, 3))
    flip_bit(manifest_path(run, 3), byte, bit=0)
    assert sha256_file(manifest_path(run, 3)) != digest
    report = verify_cli(run)
    assert [(c["step"], c["chunk"]) for c in report["corrupt"]] == [(3, None)]
    assert "manifest" in report["corrupt"][0]["problem"]
    assert_falls_back(run, caplog, None, None)


@pytest.mark.parametrize("keep", [0, 1, "half", "all-but-one"])
def test_a_truncated_manifest_is_reported_and_restore_falls_back(run, caplog, keep):
    p = manifest_path(run, 3)
    size = p.stat().st_size
    os.truncate(p, {"half": size // 2, "all-but-one": size - 1}.get(keep, keep))  # type: ignore[arg-type]
    assert p.stat().st_size < size
    report = verify_cli(run)
    assert [(c["step"], c["chunk"]) for c in report["corrupt"]] == [(3, None)]
    assert_falls_back(run, caplog, None, None)


def test_the_verify_command_reports_a_flipped_bit_with_exit_code_1(run):
    """The real console entry point, in its own process (JSON on stdout, exit code 1)."""
    h, rec = newest_chunk(run, "model.big")
    flip_bit(run / rec["path"], 12345, 3)
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard", "verify", str(run), "--all", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    assert [(c["step"], c["chunk"], c["tensors"]) for c in report["corrupt"]] == [
        (3, rec["path"], ["model.big"])
    ]


# -- nothing valid ----------------------------------------------------------------------------------------
def test_restore_latest_raises_when_every_checkpoint_is_corrupt(run, caplog):
    shared = set.intersection(*(set(read_manifest_json(run, s)["chunks"]) for s in STEPS))
    [h] = [h for h in shared if owners_of(run, 1, h) == ["model.frozen"]]  # the one chunk all steps share
    rec = read_manifest_json(run, 1)["chunks"][h]
    flip_bit(run / rec["path"], rec["length"] - 1, 7)
    result = CliRunner().invoke(cli, ["verify", str(run), "--all", "--json"])
    assert result.exit_code == 1
    assert sorted(c["step"] for c in json.loads(result.output)["corrupt"]) == list(STEPS)
    with tg.CheckpointManager(run) as mgr:
        with pytest.raises(tg.NoValidCheckpointError) as ei:
            mgr.restore_latest(blank_state())
        assert all(f"step {s}" in str(ei.value) for s in STEPS)
        assert "trainguard verify" in str(ei.value)
        assert sorted(e["step"] for e in read_events(run, event="restore_skipped")) == list(STEPS)
        assert [i.status for i in mgr.checkpoints()] == ["corrupt"] * 3


def test_restore_latest_of_an_empty_root_returns_none(tmp_path):
    with tg.CheckpointManager(tmp_path / "root") as mgr:
        state = blank_state()
        assert mgr.restore_latest(state) is None
        assert state["epoch"] == -1


def test_restore_latest_of_a_root_with_only_an_uncommitted_save_returns_none(tmp_path, caplog):
    root = tmp_path / "root"
    (root / "step-000000005.partial-abcd").mkdir(parents=True)
    (root / "step-000000005.partial-abcd" / "x.tmp").write_bytes(b"half a chunk")
    ro = tg.CheckpointManager(root, read_only=True)
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        assert ro.restore_latest(blank_state()) is None
    assert "uncommitted" in caplog.text
    assert [(i.step, i.status) for i in ro.checkpoints()] == [(5, "incomplete")]


# -- resuming after a corrupt checkpoint -----------------------------------------------------------------
def test_a_resumed_run_can_save_again_the_step_it_skipped_as_corrupt(run, caplog):
    h, rec = newest_chunk(run, "model.big")
    flip_bit(run / rec["path"], 0, 0)
    with tg.CheckpointManager(run, save_policy=tg.EveryNSteps(1)) as mgr:
        assert mgr.restore_latest(blank_state()) == 2
        out = mgr.maybe_save(3, make_state(3))  # the resumed loop reaches step 3 again
        if hasattr(out, "wait"):
            out.wait()
        state = blank_state()
        assert mgr.restore_latest(state) == 3
        assert_state_is(state, 3)
    assert verify(run).ok


def test_re_saving_the_same_values_over_a_corrupt_chunk_writes_a_good_chunk(run, caplog):
    h, rec = newest_chunk(run, "model.big")
    flip_bit(run / rec["path"], 0, 0)
    with tg.CheckpointManager(run) as mgr:
        assert mgr.restore_latest(blank_state()) == 2  # detects the bad chunk and marks step 3 corrupt
        commit_save(mgr, 3, make_state(3), overwrite=True)  # deterministic training: the same values again
        state = blank_state()
        assert mgr.restore_latest(state) == 3, "step 3 was re-saved but does not restore"
        assert_state_is(state, 3)
    assert verify(run).ok


# -- unreadable chunks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["EIO", "directory"])
def test_an_unreadable_chunk_is_reported_and_restore_falls_back(run, caplog, monkeypatch, fault):
    from faultlib import faulty_local

    from trainguard.storage import Fault

    h, rec = newest_chunk(run, "model.big")
    path = run / rec["path"]
    injected: list[Any] = []
    if fault == "EIO":
        disk = faulty_local(monkeypatch, Fault("read", match=rec["path"], times=None, errno=errno.EIO))
        injected = disk.injected
    else:
        path.unlink()
        path.mkdir()
        injected.append(path)
    report = verify(run)
    assert injected, "the fault never fired"
    assert [(c["step"], c["chunk"]) for c in report.corrupt] == [(3, rec["path"])]
    # An I/O error is reported and skipped but never recorded as corruption (step 3 stays restorable once
    # the storage is readable again); a directory where a chunk should be is damage that listing sees.
    assert_falls_back(run, caplog, rec["path"], None, listed="unverified" if fault == "EIO" else "corrupt")
    assert not (run / "step-000000003" / "corrupt.json").exists() or fault != "EIO"


def test_fixture_roots_do_not_share_chunks_between_steps_except_frozen(run):
    """Guards the premise of the tests above: only model.frozen's chunk is shared between steps."""
    all_chunks = [set(read_manifest_json(run, s)["chunks"]) for s in STEPS]
    shared = all_chunks[0] & all_chunks[1] | all_chunks[1] & all_chunks[2] | all_chunks[0] & all_chunks[2]
    assert [owners_of(run, 1, h) for h in shared] == [["model.frozen"]]
    assert torch.equal(make_state(1)["model"]["frozen"], make_state(3)["model"]["frozen"])
