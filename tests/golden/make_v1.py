"""Regenerate tests/golden/v1 (only when deliberately changing what the golden file covers; a format change
needs a new version directory instead)."""

import shutil
from pathlib import Path

import torch

import trainguard as tg


def golden_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(4, 3, generator=g),
            "b": torch.arange(3, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False]),
            "big": torch.arange(300_000, dtype=torch.int32),
        },
        "meta": {"epoch": 2, "betas": (0.9, 0.95), "name": "golden", 7: "int key"},
    }


if __name__ == "__main__":
    out = Path(__file__).parent / "v1"
    shutil.rmtree(out, ignore_errors=True)
    with tg.CheckpointManager(out, async_save=False) as mgr:
        mgr.save(42, golden_state(), metrics={"loss": 1.25})
    shutil.rmtree(out / "events")
    (out / ".lock").unlink()
