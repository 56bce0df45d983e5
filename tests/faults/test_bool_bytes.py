"""A bool tensor's bytes must be 0 or 1. A manifest (correctly signed) that calls a float32 chunk ``bool`` with a
shape of the same byte count is refused at restore, never loaded as bools holding other bytes (undefined
behaviour in torch's kernels). tests/faults/test_manifest_fuzz.py found it: its oracle's ``copy_`` turns every
such byte into 1, trainguard kept the raw bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faultlib import assert_state_is, commit_save, make_state, read_manifest_json, write_manifest

import trainguard as tg
from trainguard.errors import CorruptCheckpointError


def retyped_as_bool(root: Path, step: int, fqn: str) -> None:
    """Re-sign ``step``'s manifest with ``fqn`` (float32, one shard) declared as bool of the same bytes."""
    body = read_manifest_json(root, step)
    e = body["entries"][fqn]
    assert e["dtype"] == "float32" and len(e["shards"]) == 1
    e["dtype"] = "bool"
    e["shape"][-1] *= 4
    e["shards"][0]["sizes"][-1] *= 4
    write_manifest(root, step, body)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    retyped_as_bool(root, 2, "model.frozen")
    return root


@pytest.mark.parametrize("verify_before_load", [True, False])
def test_a_float_chunk_declared_bool_is_refused_naming_the_tensor(root, verify_before_load):
    state = {"model": {}, "optim": {}, "trainer": {}, "epoch": -1}
    with tg.CheckpointManager(root, read_only=True, verify_before_load=verify_before_load) as mgr:
        with pytest.raises(CorruptCheckpointError, match="model.frozen hold bytes other than 0 and 1") as e:
            mgr.restore(2, state)
    assert e.value.step == 2


def test_restore_latest_falls_back_to_the_intact_step(root):
    state = {"model": {}, "optim": {}, "trainer": {}, "epoch": -1}  # takes any dtype (a typed target refuses)
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest(state) == 1
    assert_state_is(state, 1)


def test_real_bool_tensors_restore_bit_exactly(tmp_path):
    mask = torch.rand(4099, generator=torch.Generator().manual_seed(3)) > 0.5
    empty = torch.zeros(0, dtype=torch.bool)
    with tg.CheckpointManager(tmp_path / "r") as mgr:
        commit_save(mgr, 1, {"m": {"mask": mask, "empty": empty, "one": torch.tensor(True)}})
        live = {"m": {"mask": torch.zeros_like(mask), "empty": empty.clone(), "one": torch.tensor(False)}}
        assert mgr.restore(1, live) == 1
    assert torch.equal(live["m"]["mask"], mask) and bool(live["m"]["one"])
    assert torch.equal(live["m"]["mask"].view(torch.uint8), mask.view(torch.uint8))
