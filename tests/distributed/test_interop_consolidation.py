"""Export consolidates shards: a checkpoint saved by 2 FSDP2 ranks (torchrun, gloo) exports to one safetensors
file, a DCP directory and a torch.save file equal bitwise to the full (unsharded) tensors; ``tg.dcp_reader``
loads it into full tensors in one process with plain ``dcp.load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.format import TensorEntry
from trainguard.interop import export

from .launch import run_workers

pytestmark = pytest.mark.distributed

STEPS = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("consolidate")
    root = d / "root"
    run_workers(2, "save", d, root=str(root), steps=STEPS)
    full = torch.load(d / f"ref-{STEPS}.pt", weights_only=True)  # rank 0's full_state_dict of the model
    return {"root": root, "dir": d, "model": full["model"]}


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k], v), f"{k} differs"


def test_the_checkpoint_really_holds_shards_from_two_ranks(saved):
    m = read_manifest(saved["root"], STEPS)
    sharded = [e for e in m.entries.values() if isinstance(e, TensorEntry) and len(e.shards) == 2]
    assert m.world_size == 2 and len(sharded) >= 6  # l1/l2/l3 weights and biases, sharded by FSDP2


def test_safetensors_export_of_a_two_rank_checkpoint_equals_the_full_tensors_bitwise(saved, tmp_path):
    res = export(saved["root"], tmp_path / "model.safetensors", format="safetensors")
    assert res.entry == "app.model"
    same(load_file(tmp_path / "model.safetensors"), saved["model"])
    export(saved["root"], tmp_path / "sharded", format="safetensors", max_shard_bytes=8192)
    parts: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "sharded").glob("model-*.safetensors")):
        parts.update(load_file(f))
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) >= 2
    same(parts, saved["model"])


def test_dcp_and_torch_exports_and_dcp_reader_give_the_full_tensors(saved, tmp_path):
    export(saved["root"], tmp_path / "w", format="dcp")
    target = {k: torch.zeros_like(v) for k, v in saved["model"].items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "w"), no_dist=True)
    same(target, saved["model"])
    export(saved["root"], tmp_path / "w.pt", format="torch")
    same(torch.load(tmp_path / "w.pt", weights_only=True), saved["model"])
    state = {"app": {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}}}
    dcp.load(state, storage_reader=tg.dcp_reader(saved["root"]), no_dist=True)
    same(state["app"]["model"], saved["model"])


def test_imported_back_the_export_restores_into_a_plain_model_state(saved, tmp_path: Path):
    from trainguard.interop import import_checkpoint

    export(saved["root"], tmp_path / "m.safetensors", format="safetensors")
    import_checkpoint(tmp_path / "m.safetensors", tmp_path / "root2", format="safetensors", step=STEPS)
    state: dict[str, Any] = {"model": {}}
    with tg.CheckpointManager(tmp_path / "root2", read_only=True) as mgr:
        mgr.restore(STEPS, state)
    same(state["model"], saved["model"])
