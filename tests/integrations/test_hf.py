"""Hugging Face Transformers through ``tg.hf.TrainguardTrainer``: a Trainer run SIGKILLed mid-training and
resumed with ``train(resume_from_checkpoint=True)`` continues identically (per-step losses and final weights,
bitwise) to an uninterrupted run, also when the newest checkpoint is corrupt. The job is
``examples/train_hf.py`` (a 2-layer GPT-2 built from a config, dropout on, AdamW + linear schedule, 6 steps
per epoch, a save every 4 steps).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ..conftest import REPO, run_env
from ._example import losses, run_example

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainguard as tg  # noqa: E402
from trainguard.catalog import read_manifest  # noqa: E402
from trainguard.format import chunk_relpath  # noqa: E402
from trainguard.recovery.events import read_events  # noqa: E402

pytestmark = pytest.mark.hf

SCRIPT = REPO / "examples" / "train_hf.py"
STEPS, SAVE_EVERY = 30, 4


def train(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_example(SCRIPT, root, out, STEPS, SAVE_EVERY, *extra)


def flip_bit_only_in(root: Path, step: int, older: int) -> Path:
    """Flip one bit in a chunk that checkpoint ``step`` references and ``older`` does not."""
    only = sorted(set(read_manifest(root, step).chunks) - set(read_manifest(root, older).chunks))
    chunk = root / chunk_relpath(only[0])
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    return chunk


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("hf")
    ref, faulted = d / "reference", d / "faulted"
    ref.mkdir()
    faulted.mkdir()
    r = train(ref / "root", ref)
    assert r.returncode == 0, r.stderr[-3000:]
    kills = []
    # step 7: after the save of step 4 (mid-epoch 0; the Trainer skips 4 batches); step 15: after the save of
    # step 12 (an epoch boundary: the Trainer reloads the RNG at the epoch start)
    for kill_at in (7, 15):
        p = train(faulted / "root", faulted, "--kill-at", str(kill_at))
        kills.append(p.returncode)
    corrupted = flip_bit_only_in(faulted / "root", 12, 8)  # the newest checkpoint fails CRC32C: resume from 8
    final = train(faulted / "root", faulted)
    assert final.returncode == 0, final.stderr[-3000:]
    return {"ref": ref, "faulted": faulted, "kills": kills, "corrupted": corrupted, "log": final.stderr}


def test_a_killed_trainer_run_resumes_bit_exactly(runs: dict[str, Any]) -> None:
    assert runs["kills"] == [-signal.SIGKILL, -signal.SIGKILL]  # both faults fired
    ref, faulted = losses(runs["ref"]), losses(runs["faulted"])
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert faulted == ref
    a = torch.load(runs["ref"] / "final.pt", weights_only=True)
    b = torch.load(runs["faulted"] / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and "lm_head.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_each_attempt_resumed_from_the_newest_valid_checkpoint(runs: dict[str, Any]) -> None:
    rows = [json.loads(line) for line in (runs["faulted"] / "losses.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    restarts = [(steps[i - 1], steps[i]) for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
    # killed after step 6 (step 7 not logged) -> resumed from 4; killed after 14 -> the newest (12) is corrupt,
    # resumed from 8
    assert restarts == [(6, 5), (14, 9)]
    assert "skipping checkpoint of step 12" in runs["log"]
    chunk = runs["corrupted"]
    assert len(list(chunk.parent.glob(chunk.name + ".corrupt-*"))) == 1  # moved aside, never loaded
    state: dict[str, Any] = {"model": {}, "trainer": {}, "rng": {}}
    tg.CheckpointManager(runs["faulted"] / "root", read_only=True).restore(12, state)  # redone: passes CRC32C
    assert json.loads(state["trainer"]["trainer_state"])["global_step"] == 12


def test_checkpoints_are_trainguard_ones_holding_the_whole_trainer_state(runs: dict[str, Any]) -> None:
    root = runs["faulted"] / "root"
    mgr = tg.CheckpointManager(root, read_only=True)
    steps = [i.step for i in mgr.checkpoints() if i.usable]
    assert steps == [*range(SAVE_EVERY, STEPS, SAVE_EVERY), STEPS]  # step 12 redone; the final save at 30
    state: dict[str, Any] = {"model": {}, "trainer": {}, "rng": {}}
    assert mgr.restore_latest(state) == STEPS
    saved = state["trainer"]
    assert set(saved) == {"optimizer", "scheduler", "trainer_state"}
    assert json.loads(saved["trainer_state"])["global_step"] == STEPS
    assert saved["scheduler"]["last_epoch"] == STEPS
    final = torch.load(runs["faulted"] / "final.pt", weights_only=True)
    assert state["model"].keys() == final.keys()
    assert all(torch.equal(state["model"][k], final[k]) for k in final)
    assert {"python", "numpy", "torch"} <= set(state["rng"])


def test_the_weights_export_as_they_are(runs: dict[str, Any], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from trainguard.interop import export

    export(runs["faulted"] / "root", tmp_path / "model.safetensors", format="safetensors")
    got = load_file(tmp_path / "model.safetensors")
    final = torch.load(runs["faulted"] / "final.pt", weights_only=True)
    assert got.keys() == final.keys()  # the model's own state_dict keys (tied lm_head.weight included)
    assert all(torch.equal(got[k], final[k]) for k in got)


def test_sigterm_saves_the_current_step_exits_75_and_the_run_resumes_bit_exactly(
    runs: dict[str, Any], tmp_path: Path
) -> None:
    cmd = [sys.executable, str(SCRIPT), "--root", str(tmp_path / "root"), "--steps", str(STEPS), "--save-every",
           "100", "--losses", str(tmp_path / "losses.jsonl"), "--final", str(tmp_path / "final.pt")]  # fmt: skip
    env = run_env() | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = tmp_path / "losses.jsonl"
        while not (log.exists() and log.read_text().count("\n") >= 9):  # 9 whole lines (the last may be torn)
            assert p.poll() is None, p.communicate()[1][-3000:]
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)  # what `trainguard run` sends on a preemption notice
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, err[-3000:]  # EX_TEMPFAIL: saved, requeue me
    mgr = tg.CheckpointManager(tmp_path / "root", read_only=True)
    [saved] = [i.step for i in mgr.checkpoints() if i.usable]  # the only save: no save_steps was due
    assert 9 <= saved < STEPS
    assert [e["step"] for e in read_events(tmp_path / "root", event="first_step")] == [1]  # TTR's first step
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(tmp_path) == losses(runs["ref"])
    a = torch.load(runs["ref"] / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _trainer(tmp_path: Path, trainguard_options: dict[str, Any] | None = None, **args: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=4, n_embd=8, n_layer=1, n_head=1))
    ta = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=1, **args
    )
    ds = [{"input_ids": torch.zeros(4, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}] * 2
    return tg.hf.TrainguardTrainer(
        model=model,
        args=ta,
        train_dataset=ds,
        trainguard_root=tmp_path / "root",
        trainguard_options=trainguard_options,
    )


def test_unsupported_settings_are_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match="save_policy"):
        _trainer(tmp_path, trainguard_options={"save_policy": tg.EveryNSteps(5)})
    trainer = _trainer(tmp_path, save_only_model=True)
    with pytest.raises(tg.ConfigError, match="save_only_model"):
        trainer.train()
    assert not (tmp_path / "root").exists()
    with pytest.raises(tg.ConfigError, match="resume_from_checkpoint must be"):
        _trainer(tmp_path).train(resume_from_checkpoint=1.5)  # type: ignore[arg-type]


def test_a_step_that_does_not_exist_is_an_error_and_a_checkpoint_of_another_kind_is_refused(
    tmp_path: Path,
) -> None:
    with pytest.raises(tg.CheckpointNotFoundError):
        _trainer(tmp_path).train(resume_from_checkpoint=5)
    with tg.CheckpointManager(tmp_path / "root") as mgr:
        mgr.save(5, {"model": {"w": torch.ones(2)}})
    with pytest.raises(tg.ConfigError, match="not written by tg.hf.TrainguardTrainer"):
        _trainer(tmp_path).train(resume_from_checkpoint=True)
