"""Regenerate tests/golden/v3, two checkpoints with compressed and delta chunks (format version 3):
``python -m tests.golden.make_v3`` (only when deliberately changing what the golden files cover; a format
change needs a new version directory instead)."""

import shutil
from pathlib import Path

import torch

import trainguard as tg


def golden_state(step: int) -> dict:
    w = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024) / 7.0
    w[: step * 3] += step  # a few rows change between the two saves
    return {
        "model": {"w": w, "h": w.to(torch.bfloat16), "n": torch.arange(5) * step},
        "meta": {"step": step},
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "v3"
    shutil.rmtree(out, ignore_errors=True)
    with tg.CheckpointManager(out, async_save=False, compression="zstd", delta=True) as mgr:
        for step in (1, 2):
            mgr.save(step, golden_state(step))
    shutil.rmtree(out / "events")
    (out / ".lock").unlink()
    for f in out.glob("step-*/verified.json"):
        f.unlink()
