"""``export``: a checkpoint as safetensors (one file, or Hugging Face's sharded layout with an index), a
directory plain ``dcp.load`` reads, or a ``torch.save`` file; model weights by default, keyed as the model's
own state_dict, bit for bit; the output appears only when complete."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.cli.main import main as cli
from trainguard.errors import ConfigError, CorruptCheckpointError
from trainguard.interop import export


class Net(nn.Module):
    """Several dtypes (fp32, bf16, int64 buffer) and a nested module, as a real model's state_dict has."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4).to(torch.bfloat16)
        self.register_buffer("positions", torch.arange(10, dtype=torch.int64))


def trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = model.block(model.emb(torch.arange(8))).to(torch.bfloat16)
    model.head(x).float().square().mean().backward()
    opt.step()
    return model, opt


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.fixture
def run(tmp_path: Path) -> dict:
    model, opt = trained()
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(7, {"model": model, "optim": opt, "epoch": 2}).wait()
    return {
        "root": root,
        "model": model,
        "opt": opt,
        "sd": {k: v.clone() for k, v in model.state_dict().items()},
    }


def test_safetensors_export_loads_with_the_safetensors_library_and_equals_the_weights_bitwise(run, tmp_path):
    out = tmp_path / "model.safetensors"
    res = export(run["root"], out, format="safetensors")
    assert (res.step, res.entry, res.tensors, res.files) == (7, "model", len(run["sd"]), [])
    loaded = load_file(out)
    same(loaded, run["sd"])  # the model's own keys: no "model." prefix
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["format"] == "pt"  # what Hugging Face's from_pretrained checks
    fresh = Net()
    fresh.load_state_dict(loaded)  # strict
    same(fresh.state_dict(), run["sd"])


def test_over_max_shard_size_safetensors_is_sharded_with_a_hugging_face_index(run, tmp_path):
    out = tmp_path / "sharded"
    limit = 2500  # bytes: emb (3200 B) alone, the rest spread over several files
    res = export(run["root"], out, format="safetensors", max_shard_bytes=limit)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert names == sorted([*shards, "model.safetensors.index.json"]) == sorted(res.files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    sizes = {k: v.numel() * v.element_size() for k, v in run["sd"].items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    assert sorted(index["weight_map"]) == sorted(run["sd"])
    merged: dict[str, torch.Tensor] = {}
    for s in shards:
        part = load_file(out / s)
        assert all(index["weight_map"][k] == s for k in part)
        in_file = sum(sizes[k] for k in part)
        assert in_file <= limit or len(part) == 1  # a tensor larger than the limit gets a file of its own
        merged.update(part)
    same(merged, run["sd"])


def test_dcp_export_loads_with_plain_dcp_load(run, tmp_path):
    export(run["root"], tmp_path / "w", format="dcp")
    target = {k: torch.zeros_like(v) for k, v in run["sd"].items()}
    dcp.load(target, checkpoint_id=str(tmp_path / "w"), no_dist=True)
    same(target, run["sd"])
    # the whole state, nested as saved: the optimizer's state too
    export(run["root"], tmp_path / "all", format="dcp", all_state=True)
    want_opt = run["opt"].state_dict()
    target = {
        "model": {k: torch.zeros_like(v) for k, v in run["sd"].items()},
        "optim": {
            "state": {i: {k: torch.zeros_like(v) for k, v in s.items()} for i, s in want_opt["state"].items()}
        },
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "all"), no_dist=True)
    same(target["model"], run["sd"])
    for i, s in want_opt["state"].items():
        same(target["optim"]["state"][i], s)


def test_torch_export_is_a_weights_only_loadable_state_dict_and_all_keeps_the_nesting(run, tmp_path):
    export(run["root"], tmp_path / "m.pt", format="torch")
    same(torch.load(tmp_path / "m.pt", weights_only=True), run["sd"])
    export(run["root"], tmp_path / "all.pt", format="torch", all_state=True)
    full = torch.load(tmp_path / "all.pt", weights_only=True)
    assert full["epoch"] == 2
    same(full["model"], run["sd"])
    want = run["opt"].state_dict()
    assert full["optim"]["param_groups"] == want["param_groups"]
    for i, s in want["state"].items():
        same(full["optim"]["state"][i], s)


def test_the_model_inside_a_model_optimizer_state_is_the_default_without_prefix(tmp_path):
    model, opt = trained(1)
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(3, {"app": tg.ModelOptimizerState(model, opt), "rng": tg.RNGState()}).wait()
    res = export(root, tmp_path / "m.safetensors", format="safetensors")
    assert res.entry == "app.model"
    same(load_file(tmp_path / "m.safetensors"), model.state_dict())


def test_an_explicit_entry_and_a_missing_default_entry(tmp_path):
    model, _ = trained(2)
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"student": model, "teacher": Net()}).wait()
    with pytest.raises(ConfigError, match=r"no entry 'model'.*\['student', 'teacher'\].*--entry"):
        export(root, tmp_path / "x.pt", format="torch")
    assert not (tmp_path / "x.pt").exists()
    export(root, tmp_path / "s.pt", format="torch", entry="student")
    same(torch.load(tmp_path / "s.pt", weights_only=True), model.state_dict())
    with pytest.raises(ConfigError, match="no state entry 'nope'"):
        export(root, tmp_path / "y.pt", format="torch", entry="nope")


def test_a_dotted_entry_names_a_part_and_a_mixed_entry_is_refused_without_mentioning_all(tmp_path):
    model, _ = trained(3)
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"app": {"net": model.state_dict(), "epoch": 4}}).wait()
    with pytest.raises(ConfigError, match=r"also holds values \(epoch\)") as e:
        export(root, tmp_path / "a.safetensors", format="safetensors", entry="app")
    assert "--all" not in str(e.value) and "'app.net'" in str(e.value)  # names the part that would work
    res = export(root, tmp_path / "n.safetensors", format="safetensors", entry="app.net")
    assert res.entry == "app.net"
    same(load_file(tmp_path / "n.safetensors"), model.state_dict())
    with pytest.raises(ConfigError, match=r"no state entry 'app.nope'; 'app' holds \['epoch', 'net'\]"):
        export(root, tmp_path / "b.safetensors", format="safetensors", entry="app.nope")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.safetensors", "root"]


def test_safetensors_refuses_values_with_the_whole_state_and_names_the_formats_that_hold_them(run, tmp_path):
    with pytest.raises(ConfigError, match=r"tensors only.*epoch.*--format dcp or --format torch"):
        export(run["root"], tmp_path / "a.safetensors", format="safetensors", all_state=True)
    assert list(tmp_path.iterdir()) == [run["root"]]


def test_an_existing_output_is_never_overwritten(run, tmp_path):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(ConfigError, match="already exists"):
        export(run["root"], out, format="safetensors")
    assert out.read_bytes() == b"precious"


def test_a_corrupt_chunk_fails_the_export_naming_it_and_leaves_no_output(run, tmp_path):
    m = read_manifest(run["root"], 7)
    fqn = "model.emb.weight"  # 3200 bytes: a chunk of its own? find the chunk holding it
    chunk = m.entries[fqn].shards[0].segments[0].chunk
    path = run["root"] / m.chunks[chunk].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))
    for fmt, kw in (
        ("safetensors", {}),
        ("safetensors", {"max_shard_bytes": 2500}),
        ("dcp", {}),
        ("torch", {}),
    ):
        with pytest.raises(CorruptCheckpointError, match="CRC32C|crc32c") as e:
            export(run["root"], tmp_path / "out", format=fmt, **kw)
        assert m.chunks[chunk].path in str(e.value) or e.value.chunk == m.chunks[chunk].path
        assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no output, no partial file


def test_export_picks_the_newest_valid_step_and_refuses_an_invalid_one(run, tmp_path):
    with tg.CheckpointManager(run["root"]) as mgr:
        mgr.save(9, {"model": Net(), "optim": run["opt"], "epoch": 3}).wait()
    m = read_manifest(run["root"], 9)
    rec = next(iter(m.chunks.values()))
    (run["root"] / rec.path).unlink()  # step 9 lists as corrupt
    res = export(run["root"], tmp_path / "a.pt", format="torch")
    assert res.step == 7
    same(torch.load(tmp_path / "a.pt", weights_only=True), run["sd"])
    with pytest.raises(CorruptCheckpointError, match="step 9 .* is corrupt"):
        export(run["root"], tmp_path / "b.pt", format="torch", step=9)
    with pytest.raises(tg.CheckpointNotFoundError):
        export(run["root"], tmp_path / "c.pt", format="torch", step=8)


def test_progress_reports_bytes_up_to_the_total(run, tmp_path):
    seen: list[tuple[int, int]] = []
    res = export(
        run["root"],
        tmp_path / "s",
        format="safetensors",
        max_shard_bytes=2500,
        progress=lambda d, t: seen.append((d, t)),
    )
    assert len(seen) >= 3
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (res.bytes, res.bytes)


def test_cli_export_json_and_exit_codes(run, tmp_path):
    r = CliRunner().invoke(
        cli,
        [
            "export",
            str(run["root"]),
            str(tmp_path / "o"),
            "--format",
            "safetensors",
            "--max-shard-size",
            "2.5kB",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["step"] == 7 and doc["format"] == "safetensors"
    assert "model.safetensors.index.json" in doc["files"]
    r = CliRunner().invoke(cli, ["export", str(run["root"]), str(tmp_path / "o"), "--format", "torch"])
    assert r.exit_code == 2 and "already exists" in r.output
    r = CliRunner().invoke(
        cli, ["export", str(run["root"]), str(tmp_path / "p"), "--format", "torch", "--step", "8", "--json"]
    )
    assert r.exit_code == 2 and json.loads(r.stdout)["ok"] is False
    r = CliRunner().invoke(
        cli,
        ["export", str(run["root"]), str(tmp_path / "q"), "--format", "safetensors", "--max-shard-size", "5"],
    )
    assert r.exit_code == 2 and "no unit" in r.output
    r = CliRunner().invoke(cli, ["export", str(run["root"]), str(tmp_path / "m.pt"), "--format", "torch"])
    assert r.exit_code == 0 and re.search(r"exported step 7 \(model: \d+ tensors", r.output), r.output


def test_dcp_export_of_keys_dcp_would_join_into_one_name_is_a_config_error(tmp_path):
    """DCP flattens nested dicts by joining keys with '.': an int key 5 and a str key '5' (legitimate in a
    stored value) collide. The export raised DCP's CheckpointException (the CLI: a traceback); it is now a
    ConfigError naming the key and the format that keeps them, and leaves no output."""
    root = tmp_path / "r"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2)}, "v": {5: "int", "5": "str"}})
    with pytest.raises(ConfigError, match=r"become 'v\.5'.*--format torch"):
        export(root, tmp_path / "o", format="dcp", all_state=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    r = CliRunner().invoke(cli, ["export", str(root), str(tmp_path / "o2"), "--all", "--format", "dcp"])
    assert r.exit_code == 2 and "become 'v.5'" in r.output and "Traceback" not in r.output, r.output
    export(root, tmp_path / "o.pt", format="torch", all_state=True)
    assert torch.load(tmp_path / "o.pt", weights_only=True)["v"] == {5: "int", "5": "str"}
