"""A corrupt delta BASE is found by the verify pass before any byte reaches the state's objects.

Before the fix the pre-load CRC pass read only the chunks the loaded entries own (the new delta chunk), not the
bases a decode reads: a base flipped on disk was found during the load, after other tensors were overwritten
(``state_modified=True``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from faultlib import flip_bit

import trainguard as tg

ROWS, DIM = 2000, 64


def states() -> list[dict[str, Any]]:
    """Three steps: ``a_first`` fixed, ``emb`` with 1% of its rows changed per step (saved as deltas)."""
    g = torch.Generator().manual_seed(0)
    a_first = torch.randn(30000, generator=g)
    emb = torch.randn(ROWS, DIM, generator=g)
    out = []
    for _ in range(3):
        emb = emb.clone()
        rows = torch.randint(0, ROWS, (ROWS // 100,), generator=g)
        emb[rows] = torch.randn(len(rows), DIM, generator=g)
        out.append({"a_first": a_first.clone(), "emb": emb})
    return out


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step-{step:09d}" / "manifest.json").read_bytes())


@pytest.fixture
def chain_root(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A run root of 3 delta saves whose step-2 delta base (a chunk step 2 shares with step 1) is flipped;
    returns the root and that base's chunk record."""
    with tg.CheckpointManager(tmp_path, async_save=False, compression="zstd", delta=True, fsync=False) as mgr:
        for step, state in enumerate(states(), 1):
            mgr.save(step, state)
    chunks = manifest(tmp_path, 2)["chunks"]
    bases = {c["base"] for c in chunks.values() if "base" in c}
    assert bases, "step 2 holds delta chunks"
    base = chunks[sorted(bases)[0]]
    (tmp_path / base["path"]).chmod(0o644)  # chunks are written read-only
    flip_bit(tmp_path / base["path"], base["length"] // 2)
    return tmp_path, base


@pytest.mark.parametrize("entries", [("a_first", "emb"), ("emb",)], ids=["two-tensors", "only-tensor"])
def test_the_verify_pass_reads_every_delta_base_and_leaves_the_objects_untouched(chain_root, entries):
    root, base = chain_root
    target = {name: torch.zeros_like(states()[1][name]) for name in entries}
    mgr = tg.CheckpointManager(root)
    try:
        with pytest.raises(tg.CorruptCheckpointError) as e:
            mgr.restore(2, target)
    finally:
        mgr.close()
    assert e.value.state_modified is False
    assert base["path"] in str(e.value) and "were not modified" in str(e.value)
    assert "rebuild" not in str(e.value)
    assert "emb" in str(e.value)  # the entries depending on the base are named
    for name in entries:
        assert not target[name].any(), f"{name} was not touched"
