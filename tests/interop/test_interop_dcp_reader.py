"""``tg.dcp_reader``: plain ``dcp.load`` with DCP's default planner reads a trainguard checkpoint: tensors bit
for bit, nested state, non-tensor values; the newest valid step by default; invalid steps are refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import trainguard as tg
from trainguard.catalog import read_manifest


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def test_plain_dcp_load_with_the_default_planner_restores_tensors_and_values(tmp_path):
    model, opt = trained()
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(4, {"model": model, "optim": opt, "meta": {"epoch": 2, "betas": (0.9, 0.99)}}).wait()
    fresh = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    want_opt = opt.state_dict()
    state = {
        "model": fresh.state_dict(),
        "optim": {
            "state": {
                i: {k: torch.zeros_like(v) for k, v in s.items()} for i, s in want_opt["state"].items()
            },
            "param_groups": None,
        },
        "meta": {"epoch": 0, "betas": None},
    }
    reader = tg.dcp_reader(root)
    assert reader.step == 4
    dcp.load(state, storage_reader=reader)  # DefaultLoadPlanner, as plain DCP users call it
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v) and state["model"][k].dtype == v.dtype, k
    fresh.load_state_dict(state["model"])
    for i, s in want_opt["state"].items():
        for k, v in s.items():
            assert torch.equal(state["optim"]["state"][i][k], v), (i, k)
    assert state["optim"]["param_groups"] == want_opt["param_groups"]
    assert state["meta"] == {"epoch": 2, "betas": (0.9, 0.99)}


def test_the_default_step_is_the_newest_valid_one_and_invalid_steps_are_refused(tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.full((4,), 1.0)}).wait()
        mgr.save(2, {"w": torch.full((4,), 2.0)}).wait()
    rec = next(iter(read_manifest(root, 2).chunks.values()))
    (root / rec.path).unlink()  # step 2 is now corrupt
    assert tg.dcp_reader(root).step == 1
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=tg.dcp_reader(root))
    assert torch.equal(state["w"], torch.full((4,), 1.0))
    with pytest.raises(tg.CorruptCheckpointError, match="step 2 .* is corrupt"):
        tg.dcp_reader(root, 2)
    with pytest.raises(tg.CheckpointNotFoundError):
        tg.dcp_reader(root, 3)
    with pytest.raises(tg.NoValidCheckpointError):
        tg.dcp_reader(tmp_path / "root" / "chunks")


def test_a_bit_flip_fails_the_load_and_names_the_chunk(tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"w": torch.arange(300_000, dtype=torch.float32)}).wait()
    rec = next(iter(read_manifest(root, 1).chunks.values()))
    data = bytearray((root / rec.path).read_bytes())
    data[1000] ^= 1
    (root / rec.path).write_bytes(bytes(data))
    state = {"w": torch.zeros(300_000)}
    with pytest.raises(BaseException, match="CRC32C") as e:
        dcp.load(state, storage_reader=tg.dcp_reader(root, 1))
    assert rec.path in str(e.value)
