"""Checkpoints written by format version 1 keep loading (tests/golden/v1 is committed, never regenerated for
a format change)."""

from __future__ import annotations

import json
import shutil

import torch

import trainguard as tg
from trainguard.format import FORMAT_VERSION

from .conftest import REPO
from .golden.make_v1 import golden_state


def test_the_version_1_golden_checkpoint_loads_bit_for_bit(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(REPO / "tests" / "golden" / "v1", root)
    mgr = tg.CheckpointManager(root, read_only=True)
    # copied in: no full read of its bytes is recorded here yet, so it lists as unverified (restore uses it)
    assert [(i.step, i.status) for i in mgr.checkpoints()] == [(42, "unverified")]
    state: dict = {"model": {}, "meta": {}}
    assert mgr.restore_latest(state) == 42
    want = golden_state()
    for k, t in want["model"].items():
        assert state["model"][k].dtype == t.dtype and torch.equal(state["model"][k], t), k
    assert state["meta"] == want["meta"]
    from trainguard.integrity.verify import verify

    assert verify(root).ok  # a passing full read is recorded: every view now says valid
    assert [(i.step, i.status) for i in mgr.checkpoints()] == [(42, "valid")]


def test_the_golden_manifest_declares_the_current_format_version():
    import json

    m = json.loads((REPO / "tests" / "golden" / "v1" / "step-000000042" / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION == 1


def test_the_version_2_golden_checkpoint_with_per_rank_entries_loads_each_saved_ranks_values(tmp_path):
    import pytest

    from .golden.make_v2 import golden_state as golden_v2

    root = tmp_path / "v2"
    shutil.copytree(REPO / "tests" / "golden" / "v2", root)
    m = json.loads((root / "step-000000007" / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["entries"]["cursor.offset@rank1"]["rank"] == 1
    mgr = tg.CheckpointManager(root, read_only=True)
    with pytest.raises(tg.StateMismatchError, match="cursor"):  # saved at 2 ranks, loaded in one process
        mgr.restore_latest({"cursor": {}, "shared": {}})
    for r in (0, 1):
        state: dict = {"cursor": tg.PerRank({}, reshard=lambda saved, rank, ws, r=r: saved[r]), "shared": {}}
        assert mgr.restore_latest(state) == 7
        want = golden_v2(r)
        got = state["cursor"].obj
        assert got["offset"] == r and got["nested"] == want["cursor"]["nested"]
        assert torch.equal(got["consumed"], want["cursor"]["consumed"])
        assert torch.equal(state["shared"]["w"], want["shared"]["w"]) and state["shared"]["lr"] == 0.5


def test_the_version_3_golden_checkpoints_with_compressed_and_delta_chunks_load_bit_for_bit(tmp_path):
    from .golden.make_v3 import golden_state as golden_v3

    root = tmp_path / "v3"
    shutil.copytree(REPO / "tests" / "golden" / "v3", root)
    m = json.loads((root / "step-000000002" / "manifest.json").read_text())
    assert m["format_version"] == 3
    assert any("base" in c and c["codec"] == "blosc2" for c in m["chunks"].values())
    mgr = tg.CheckpointManager(root, read_only=True)
    for step in (1, 2):
        state: dict = {"model": {}, "meta": {}}
        mgr.restore(step, state)
        want = golden_v3(step)
        for k, t in want["model"].items():
            assert state["model"][k].dtype == t.dtype and torch.equal(state["model"][k], t), (step, k)
        assert state["meta"] == want["meta"]
    from trainguard.integrity.verify import verify

    assert verify(root).ok
