"""restore_latest picks the newest committed, valid checkpoint and never starts from scratch silently."""

from __future__ import annotations

import torch

import trainguard as tg


def save(root, step: int, value: float) -> None:
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(step, {"w": {"t": torch.full((8,), value)}})


def test_a_step_directory_killed_before_its_manifest_is_ignored(tmp_path):
    save(tmp_path, 10, 1.0)
    (tmp_path / "step-000000020").mkdir()  # commit killed between mkdir and the manifest rename
    (tmp_path / "step-000000020.partial-dead").mkdir()
    state: dict = {"w": {}}
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    assert {i.step: i.status for i in mgr.checkpoints()} == {10: "valid", 20: "incomplete"}
    assert mgr.restore_latest(state) == 10 and state["w"]["t"][0] == 1.0


def test_only_uncommitted_saves_means_a_fresh_start(tmp_path):
    (tmp_path / "step-000000005").mkdir()
    (tmp_path / "step-000000005.partial-x").mkdir()
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": {}}) is None


def test_a_writer_cleans_up_what_a_killed_commit_left(tmp_path):
    save(tmp_path, 10, 1.0)
    (tmp_path / "step-000000020").mkdir()
    (tmp_path / "step-000000020.partial-dead").mkdir()
    (tmp_path / "chunks" / "ab").mkdir(parents=True, exist_ok=True)
    orphan = tmp_path / "chunks" / "ab" / ("ab" * 16)
    orphan.write_bytes(b"orphan chunk of a killed save")
    with tg.CheckpointManager(tmp_path) as mgr:
        assert [i.step for i in mgr.checkpoints()] == [10]
    assert not orphan.exists() and not (tmp_path / "step-000000020").exists()


def test_an_empty_root_returns_none_and_a_root_with_only_corrupt_ones_raises(tmp_path):
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": {}}) is None
    save(tmp_path, 3, 1.0)
    (tmp_path / "step-000000003" / "manifest.json").write_text("{not json")
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    try:
        mgr.restore_latest({"w": {}})
    except tg.NoValidCheckpointError as e:
        assert "step 3" in str(e) and "verify" in str(e)
    else:
        raise AssertionError("expected NoValidCheckpointError")
