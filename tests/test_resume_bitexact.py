"""A job killed with SIGKILL at a random step and resumed continues bit for bit like an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import trainguard as tg

from .conftest import REPO, run_env

STEPS = 90
SAVE_EVERY = 10


def train(root: Path, *extra: str, expect_kill: bool = False, workers: int = 0) -> None:
    cmd = [
        str(Path(__import__("sys").executable)),
        str(REPO / "examples" / "train_mlp.py"),
        "--root",
        str(root),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--keep",
        "100",
        "--hidden",
        "64",
        "--num-workers",
        str(workers),
        *extra,
    ]
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=300)
    if expect_kill:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr


def losses(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "losses.jsonl").read_text().splitlines()]


def final_state(root: Path) -> dict:
    """Restore the final checkpoint of a run into freshly built objects (as a new process would)."""
    model = nn.Sequential(
        nn.Linear(2, 64),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(64, 2),
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    ds = torch.utils.data.TensorDataset(torch.zeros(2048, 2), torch.zeros(2048), torch.arange(2048))
    loader = tg.ResumableLoader(ds, batch_size=32)
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
    mgr = tg.CheckpointManager(root, read_only=True)
    assert mgr.restore(STEPS, state) == STEPS
    return {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "sched": sched.state_dict(),
        "loader": loader.state_dict(),
        "rng": tg.RNGState().state_dict(),
    }


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            assert_same(x, y, f"{where}[{i}]")
    elif callable(a):
        return
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[list[dict], dict]:
    root = tmp_path_factory.mktemp("uninterrupted")
    train(root)
    return losses(root), final_state(root)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_job_killed_at_a_random_step_resumes_bit_for_bit(tmp_path, reference, seed):
    ref_losses, ref_state = reference
    kill_at = random.Random(seed).randrange(SAVE_EVERY + 1, STEPS - 2)
    train(tmp_path, "--die-at-step", str(kill_at), expect_kill=True)
    before = losses(tmp_path)
    assert before[-1]["step"] == kill_at
    # Saves persist in the background: at the kill the newest committed checkpoint may trail the last policy
    # step, by at most the two saves the staging buffers allow in flight (and none may have committed yet).
    newest = tg.CheckpointManager(tmp_path, read_only=True).latest_step() or 0
    last_policy_step = (kill_at // SAVE_EVERY) * SAVE_EVERY
    assert last_policy_step - 2 * SAVE_EVERY <= newest <= kill_at and newest % SAVE_EVERY == 0
    train(tmp_path)
    log = losses(tmp_path)
    resumed = log[len(before) :]
    assert resumed[0]["step"] == newest + 1, "resumed from the newest checkpoint valid at the kill"
    by_step = {r["step"]: r for r in ref_losses}
    for r in resumed:  # loss, LR and data order of every step after the resume point
        assert r == by_step[r["step"]], f"step {r['step']} diverged"
    assert resumed[-1]["step"] == STEPS
    assert_same(ref_state, final_state(tmp_path))


def test_resume_is_bit_exact_with_worker_processes_and_two_resumes(tmp_path, reference):
    ref_losses, ref_state = reference
    train(tmp_path, "--die-at-step", "23", expect_kill=True, workers=2)
    train(tmp_path, "--die-at-step", "67", expect_kill=True, workers=2)
    train(tmp_path, workers=2)
    by_step = {r["step"]: r for r in ref_losses}
    log = losses(tmp_path)
    for r in log:
        assert r == by_step[r["step"]]
    assert {r["step"] for r in log} == set(range(1, STEPS + 1))
    assert_same(ref_state, final_state(tmp_path))
