"""Ray Train: ``TorchTrainer`` workers (2 CPU workers on a local Ray cluster) checkpoint with trainguard on a
shared root. A worker SIGKILLed mid-run makes Ray restart the worker group (``FailureConfig``), the new group
restores the newest valid trainguard checkpoint and ends bit-identical to an uninterrupted run; the same root
then continues at a different ``num_workers``. Ray's results carry the committed trainguard step, and no
checkpoint bytes are copied into Ray's storage."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

# Ray is heavy on 2 loaded cores: a worker group starts in 30-100 s (actors, torch imports, gloo), so the
# module runs two fits (three group starts); the uninterrupted reference runs the same loop under torchrun.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1500)]
ray = pytest.importorskip("ray")
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import trainguard as tg  # noqa: E402
import trainguard.ray  # noqa: E402,F401

from ..distributed.launch import REPO, run, torchrun_cmd  # noqa: E402
from ..distributed.worker import differences  # noqa: E402

STEPS, SAVE_EVERY, KILL_AT = 12, 4, 7


def train_loop(config: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    import trainguard as tg
    import trainguard.ray as tg_ray

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    loader = tg.ResumableLoader(ds, batch_size=2, shuffle=True, seed=3, rank=rank, world_size=world)
    state = {"model": model, "optim": optim, "loader": loader, "rng": tg.RNGState()}
    mgr = tg.CheckpointManager(config["root"], save_policy=tg.EveryNSteps(SAVE_EVERY))
    start = mgr.restore_latest(state) or 0
    with open(Path(config["root"]).parent / f"{Path(config['root']).name}-starts.txt", "a") as f:
        f.write(f"{rank} {world} {start}\n")
    batches = loader.forever()
    for step in range(start + 1, config["steps"] + 1):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optim.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        optim.step()
        mgr.maybe_save(step, state, force=step == config["steps"])
        if step == config["steps"]:
            mgr.wait()  # the final save committed, so the last report hands it to Ray
        if config.get("report", True):
            tg_ray.report(mgr, step, {"loss": loss.item()})
        marker = Path(config["root"]).parent / "killed"
        if config.get("kill") and step == KILL_AT and rank == 1 and not marker.exists():
            mgr.wait()  # the save of step 4 is committed: the restart must resume from it
            marker.write_text("1")
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()


def fit(root: Path, storage: Path, workers: int, steps: int = STEPS, kill: bool = False):
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"root": str(root), "steps": steps, "kill": kill},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(
            name=root.name, storage_path=str(storage), failure_config=FailureConfig(max_failures=1)
        ),
    )
    return trainer.fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(tg.__file__).parents[1])}})  # fmt: skip
    try:
        faulted = fit(d / "faulted", d / "ray_storage", 2, kill=True)
        resized = fit(d / "faulted", d / "ray_storage", 1, steps=STEPS + 4)
    finally:
        ray.shutdown()
    reference = torchrun_reference(d / "reference")
    assert reference.returncode == 0, reference.stdout[-4000:]
    return {"d": d, "faulted": faulted, "resized": resized}


REFERENCE = """
import sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from tests.integrations.test_ray import train_loop
dist.init_process_group("gloo")
train_loop({{"root": {root!r}, "steps": {steps}, "report": False}})
dist.destroy_process_group()
import os, sys
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # no interpreter finalization after gloo collectives: pytorch/pytorch#179291
"""


def torchrun_reference(root: Path):
    """The uninterrupted run: the same loop on 2 ranks under torchrun (no Ray, no report)."""
    script = root.parent / "reference.py"
    script.write_text(REFERENCE.format(repo=str(REPO), root=str(root), steps=STEPS))
    return run(torchrun_cmd(2, str(script)), timeout_s=600)


def starts(d: Path, name: str) -> list[tuple[int, int, int]]:
    return sorted(
        tuple(map(int, line.split())) for line in (d / f"{name}-starts.txt").read_text().splitlines()
    )


def test_a_killed_worker_is_restarted_by_ray_and_resumes_from_the_newest_trainguard_checkpoint(runs):
    d = runs["d"]
    assert (d / "killed").exists()
    newest = KILL_AT // SAVE_EVERY * SAVE_EVERY
    # first group from scratch; the group Ray restarted resumed from the checkpoint before the kill
    at_two = [s for s in starts(d, "faulted") if s[1] == 2]
    assert at_two == [(0, 2, 0), (0, 2, newest), (1, 2, 0), (1, 2, newest)]


def test_the_restarted_run_ends_bit_identical_to_an_uninterrupted_one(runs):
    finals = []
    for name in ("faulted", "reference"):
        state: dict[str, Any] = {"model": {}, "optim": {}, "loader": {}, "rng": {}}
        mgr = tg.CheckpointManager(runs["d"] / name, read_only=True)
        assert mgr.restore(STEPS, state) == STEPS
        finals.append(state)
    assert differences(finals[0], finals[1]) == []


def test_the_same_root_continues_at_a_different_number_of_workers(runs):
    assert (0, 1, STEPS) in starts(runs["d"], "faulted")
    state: dict[str, Any] = {"loader": {}}
    assert tg.CheckpointManager(runs["d"] / "faulted", read_only=True).restore_latest(state) == STEPS + 4
    # 12 steps x 2 workers x 2 samples = 48 (epoch 0 done), then 4 steps x 1 worker x 2 samples of epoch 1
    assert (state["loader"]["epoch"], state["loader"]["start"]) == (1, 8)


def test_ray_sees_each_committed_trainguard_step_without_a_copy_of_the_checkpoint(runs):
    import json

    for name in ("faulted", "resized"):
        result = runs[name]
        step = result.metrics[tg.ray.STEP_KEY]
        assert Path(result.metrics[tg.ray.ROOT_KEY]).name == "faulted"
        with result.checkpoint.as_directory() as pointer_dir:
            pointer = json.loads((Path(pointer_dir) / tg.ray.POINTER_NAME).read_text())
            assert sorted(p.name for p in Path(pointer_dir).iterdir()) == [tg.ray.POINTER_NAME]  # no bytes
        assert pointer["step"] == step and (Path(pointer["root"]) / pointer["manifest"]).is_file()
    assert runs["faulted"].metrics[tg.ray.STEP_KEY] == STEPS
    assert runs["resized"].metrics[tg.ray.STEP_KEY] == STEPS + 4  # the resized run committed its own steps
    storage = runs["d"] / "ray_storage"
    assert not list(storage.rglob("manifest.json")) and not list(storage.rglob("chunks"))
