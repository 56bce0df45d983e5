"""Regenerate tests/golden/v2, a checkpoint with per-rank entries (format version 2), saved by 2 ranks:
``torchrun --nproc-per-node 2 tests/golden/make_v2.py`` (only when deliberately changing what the golden file
covers; a format change needs a new version directory instead)."""

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import trainguard as tg


def golden_state(rank: int) -> dict:
    return {
        "cursor": {"offset": rank, "consumed": torch.tensor([rank * 10]), "nested": {"rank": [rank, "x"]}},
        "shared": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "lr": 0.5},
    }


if __name__ == "__main__":
    dist.init_process_group("gloo")
    out = Path(__file__).parent / "v2"
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    with tg.CheckpointManager(out, async_save=False) as mgr:
        mgr.save(7, golden_state(dist.get_rank()), metrics={"loss": 0.5})
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out / "events")
        (out / ".lock").unlink()
    dist.destroy_process_group()
