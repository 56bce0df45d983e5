"""A job whose ``restore_latest`` raises NoValidCheckpointError is not relaunched: every relaunch would find the
same invalid checkpoints. The manager writes a ``restore_failed`` event; the supervisor reads it and gives up at
once with exit 5."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import trainguard as tg
from trainguard.recovery.config import EXIT_NO_VALID_CHECKPOINT, Backoff, SupervisorConfig
from trainguard.recovery.events import read_events
from trainguard.recovery.supervisor import Supervisor

JOB = """
import os, torch, trainguard as tg
mgr = tg.CheckpointManager(os.environ["TRAINGUARD_ROOT"])
mgr.restore_latest({"w": torch.zeros(4)})
"""


def _config(root: Path) -> SupervisorConfig:
    return SupervisorConfig(
        root=root,
        max_restarts=3,
        max_no_progress_restarts=0,  # off: only the restore_failed event may stop the relaunches
        backoff=Backoff(initial_s=0.01, max_s=0.02, factor=2.0),
        poll_interval_s=0.05,
    )


def test_a_job_with_no_valid_checkpoint_is_not_relaunched(tmp_path: Path) -> None:
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
    [manifest] = root.glob("step-*/manifest.json")
    manifest.write_bytes(b"{not json")  # the only checkpoint is corrupt: restore_latest raises
    messages: list[str] = []
    result = Supervisor([sys.executable, "-c", JOB], _config(root), echo=messages.append).run()
    assert result.exit_code == EXIT_NO_VALID_CHECKPOINT == 5 and result.reason == "no_valid_checkpoint"
    assert len(result.attempts) == 1, "relaunched a job that cannot restore"
    [failed] = read_events(root, event="restore_failed")
    assert failed["error"] == "NoValidCheckpointError" and "none is valid" in failed["problem"]
    assert "step 1" in failed["problem"].split("\n", 1)[1]  # the whole message, not its first line
    said = "\n".join(messages)
    assert "none is valid:)" not in said and "[trainguard]     step 1: corrupt manifest" in said, said
    assert "no valid checkpoint" in said and f"trainguard verify {root} --all" in said, said
    assert read_events(root, event="give_up")[0]["reason"] == "no_valid_checkpoint"


def test_a_job_that_fails_otherwise_is_still_relaunched(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = Supervisor(
        [sys.executable, "-c", "raise SystemExit(1)"], _config(root), echo=lambda m: None
    ).run()
    assert result.reason == "max_restarts" and len(result.attempts) == 4


OTHER_ROOT_JOB = """
import sys, torch, trainguard as tg
mgr = tg.CheckpointManager(sys.argv[1])
mgr.restore_latest({"w": torch.zeros(4)})
"""


def test_a_job_writing_another_root_is_named_and_the_give_up_says_so(tmp_path: Path) -> None:
    """Tester report 5, finding 3: `trainguard run --root A` whose job writes B (no valid checkpoint there)
    burned its restarts in silence; the manager now warns and the supervisor names B."""
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    with tg.CheckpointManager(root_b) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).wait()
    [manifest] = root_b.glob("step-*/manifest.json")
    manifest.write_bytes(b"{not json")
    messages: list[str] = []
    config = SupervisorConfig(
        root=root_a,
        max_restarts=1,
        max_no_progress_restarts=0,
        backoff=Backoff(initial_s=0.01, max_s=0.02, factor=2.0),
        poll_interval_s=0.05,
    )
    result = Supervisor(
        [sys.executable, "-c", OTHER_ROOT_JOB, str(root_b)], config, echo=messages.append
    ).run()
    assert result.reason == "max_restarts"  # the job's restore_failed is in B's log, which it does not read
    said = "\n".join(messages)
    assert f"the job's CheckpointManager writes {root_b}, not the run root {root_a}" in said, said
    assert f"rerun with --root {root_b}" in said, said
    [give_up] = read_events(root_a, event="give_up")
    assert str(root_b) in give_up["root_hint"]
    mismatch = read_events(root_a, event="root_mismatch")
    assert len(mismatch) == 2 and {m["root"] for m in mismatch} == {str(root_b)}  # one per attempt
    assert read_events(root_b, event="root_mismatch")[0]["supervisor_root"] == str(root_a)


def test_a_job_that_never_uses_the_root_is_told_at_the_give_up(tmp_path: Path) -> None:
    root = tmp_path / "root"
    messages: list[str] = []
    config = SupervisorConfig(
        root=root,
        max_restarts=0,
        max_no_progress_restarts=0,
        backoff=Backoff(initial_s=0.01),
        poll_interval_s=0.05,
    )
    Supervisor([sys.executable, "-c", "raise SystemExit(1)"], config, echo=messages.append).run()
    assert f"the job never used the run root {root}" in "\n".join(messages)


def test_the_manager_warns_only_when_its_root_is_not_the_supervisors(tmp_path: Path, monkeypatch) -> None:
    import warnings

    import pytest

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("TRAINGUARD_RUN_ID", "r1")
    monkeypatch.setenv("TRAINGUARD_ROOT", str(tmp_path / "link"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tg.CheckpointManager(tmp_path / "real").close()  # the same directory by another path: no warning
    with pytest.warns(RuntimeWarning, match=r"writes the run root .*other, but `trainguard run` watches"):
        tg.CheckpointManager(tmp_path / "other").close()
    assert len(read_events(tmp_path / "real", event="root_mismatch")) == 1
    monkeypatch.delenv(
        "TRAINGUARD_RUN_ID"
    )  # TRAINGUARD_ROOT alone (a default for `trainguard run`): no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        tg.CheckpointManager(tmp_path / "third").close()
