"""``trainguard ls / info / verify`` as a new user meets them: a checkpoint that is not valid never looks fine,
a problem is never cut, a folder that is not a run root never passes a check, and stored values are shown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.cli.main import main


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def training_state():
    """A user's state: SGD with Nesterov momentum, OneCycleLR, a resumable loader mid-epoch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.1, total_steps=50)
    loader = tg.ResumableLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), batch_size=4, seed=7)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
        optim.step()
        sched.step()
    return {"model": model, "optim": optim, "sched": sched, "loader": loader}


def make_run(root, steps=(1, 2)):
    state = training_state()
    with tg.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            with torch.no_grad():
                state["model"][0].weight.add_(1.0)  # every step's chunk differs from the last
            mgr.save(s, state, metrics={"loss": 1.0 / s})
    return state


def biggest_chunk(root, step):
    m = read_manifest(root, step)
    return root / max(m.chunks.values(), key=lambda c: c.length).path


@pytest.mark.parametrize("damage", ["missing", "truncated", "recorded-crc-mismatch"])
def test_info_on_a_step_with_a_missing_or_short_chunk_exits_1_and_names_the_problem(tmp_path, damage):
    make_run(tmp_path)
    chunk = biggest_chunk(tmp_path, 2)
    if damage == "missing":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-3])
    else:  # a full read found a mismatch and recorded it (docs/FORMAT.md corrupt marker)
        marker = {"problem": f"chunk chunks/{chunk.parent.name}/{chunk.name} fails CRC32C", "chunk": None}
        (tmp_path / "step-000000002" / "corrupt.json").write_text(json.dumps(marker))
    ls = json.loads(cli("ls", str(tmp_path), "--json").output)
    assert ls[-1]["status"] == "corrupt"

    text = CliRunner().invoke(main, ["info", str(tmp_path), "2"])
    assert text.exit_code == 1
    assert "corrupt" in text.output and chunk.name in text.output

    js = CliRunner().invoke(main, ["info", str(tmp_path), "2", "--json"])
    assert js.exit_code == 1
    out = json.loads(js.stdout)
    assert out["status"] == "corrupt" and chunk.name in out["problem"]

    ok = cli("info", str(tmp_path), "1", "--json")  # the intact older step still reads as valid, exit 0
    assert ok.exit_code == 0 and json.loads(ok.stdout)["status"] == "valid"


def test_ls_never_cuts_the_problem_column_so_every_number_stays_whole(tmp_path):
    make_run(tmp_path, steps=(1, 2, 3))
    flip = biggest_chunk(tmp_path, 3)
    data = bytearray(flip.read_bytes())
    data[len(data) // 2] ^= 0x01
    flip.write_bytes(bytes(data))
    from trainguard.errors import CorruptCheckpointError
    from trainguard.incremental.chunkstore import ChunkStore

    m = read_manifest(tmp_path, 3)
    rec = next(c for c in m.chunks.values() if (tmp_path / c.path) == flip)
    with pytest.raises(CorruptCheckpointError) as err:  # the full read finds the mismatch ...
        ChunkStore(tmp_path).verify(rec, step=3, owners=m.chunk_owners().get(rec.hash))
    marker = {"problem": str(err.value), "chunk": rec.path}  # ... and records it (docs/FORMAT.md)
    (tmp_path / "step-000000003" / "corrupt.json").write_text(json.dumps(marker))
    problem = json.loads(cli("ls", str(tmp_path), "--json").output)[-1]["problem"]
    assert len(problem) > 80 and re.search(r"\d{6,}", problem), problem
    r = cli("ls", str(tmp_path))
    assert r.exit_code == 0
    flat = " ".join(r.output.replace("│", " ").split())
    for token in problem.split():
        assert token in flat, (token, r.output)
    # an 80-column terminal: every number (times, sizes, the CRC32C values) whole, no ellipsis
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "trainguard", "ls", str(tmp_path)], capture_output=True, text=True, env=env
    ).stdout
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out, out
    words = out.replace("│", " ").split()
    for token in problem.split():
        assert token in words, (token, out)


def test_verify_on_an_empty_folder_fails_instead_of_passing(tmp_path):
    empty = tmp_path / "typo"
    empty.mkdir()
    r = CliRunner().invoke(main, ["verify", str(empty)])
    assert r.exit_code == 1
    assert "nothing was verified" in r.output and "not a run root" in r.output and "OK" not in r.output
    js = CliRunner().invoke(main, ["verify", str(empty), "--all", "--json"])
    assert js.exit_code == 1 and json.loads(js.stdout)["ok"] is False


def test_ls_info_and_verify_on_a_parent_folder_name_the_runs_inside_it(tmp_path):
    """A folder that is not a run root is an error for every command (exit 1), naming the runs inside it."""
    make_run(tmp_path / "runs" / "cnn", steps=(1,))
    make_run(tmp_path / "runs" / "sweep" / "lr-0.1", steps=(1,))
    parent = tmp_path / "runs"
    for cmd, code in (("ls", 1), ("verify", 1), ("info", 1)):
        r = CliRunner().invoke(main, [cmd, str(parent)])
        assert r.exit_code == code, (cmd, r.output)
        assert str(parent / "cnn") in r.output and str(parent / "sweep" / "lr-0.1") in r.output, (
            cmd,
            r.output,
        )
        assert f"trainguard {cmd} {parent / 'cnn'}" in r.output


def test_info_shows_stored_values_loader_position_and_scheduler_state(tmp_path):
    state = make_run(tmp_path)
    out = json.loads(cli("info", str(tmp_path), "--json").stdout)
    values = {e["fqn"]: e["value"] for e in out["entries"] if e["kind"] == "value"}
    assert values["loader"] == json.loads(json.dumps(state["loader"].state_dict()))
    assert values["loader"]["start"] == 12
    assert values["sched"]["last_epoch"] == 3 and values["sched"]["total_steps"] == 50
    assert values["optim"]["param_groups"][0]["nesterov"] is True
    text = cli("info", str(tmp_path))
    assert text.exit_code == 0
    assert '"start": 12' in text.output and "last_epoch" in text.output, text.output


def test_info_elides_a_long_value_visibly_and_json_keeps_all_of_it(tmp_path):
    long = {"history": [1234567.125] * 200, "tag": (1, 2)}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2), "extra": long})
    text = cli("info", str(tmp_path)).output
    assert "--json shows all" in text
    assert re.search(r"1234567\.1(?!25)", text) is None  # no number cut at the elision
    out = json.loads(cli("info", str(tmp_path), "--json").stdout)
    value = next(e["value"] for e in out["entries"] if e["fqn"] == "extra")
    assert value == {"history": [1234567.125] * 200, "tag": [1, 2]}


def test_info_json_is_strict_json_even_with_a_nan_metric_or_value(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(2), "stats": {"best": float("inf")}}, metrics={"loss": float("nan")})
    r = cli("info", str(tmp_path), "--json")
    assert r.exit_code == 0
    out = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert out["metrics"] == {"loss": "nan"}
    assert next(e["value"] for e in out["entries"] if e["fqn"] == "stats") == {"best": "inf"}
