"""Checkpoints written by format version 1 keep loading (tests/golden/v1 is committed, never regenerated for
a format change)."""

from __future__ import annotations

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
