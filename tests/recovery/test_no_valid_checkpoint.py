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
