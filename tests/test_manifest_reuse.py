"""restore_latest parses the manifest it loads once: the one a writer's open or ``lineage.head_manifest`` parsed
is reused by the restore when the file read again has the same bytes (size and CRC32C,
``read_manifest(reuse=...)``), with its chunk paths checked against the root's links again; other bytes are
parsed."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import trainguard as tg
from trainguard import catalog
from trainguard.catalog import read_manifest, read_parsed
from trainguard.format import MANIFEST_NAME, step_dir_name
from trainguard.format import manifest as manifest_mod
from trainguard.storage.objects import LocalObjects
from trainguard.storage.objectstorage import ObjectStorage


def _save(root, steps=(1, 2)):
    with tg.CheckpointManager(root, async_save=False) as mgr:
        for s in steps:
            mgr.save(s, {"model": {"w": torch.full((8,), float(s))}})


def _count_parses(monkeypatch):
    parsed: list[int] = []
    real = manifest_mod.manifest_from_json

    def counting(*args, **kwargs):
        m = real(*args, **kwargs)
        parsed.append(m.step)
        return m

    monkeypatch.setattr(catalog, "manifest_from_json", counting)
    return parsed


@pytest.mark.parametrize("read_only", [False, True])
def test_opening_and_restore_latest_parse_the_manifest_they_load_once(tmp_path, monkeypatch, read_only):
    """A writer's open reads every manifest (orphan-chunk collection) and keeps the newest for restore_latest,
    which reuses it for the lineage head and the load; a read-only manager parses it once in restore_latest."""
    _save(tmp_path)
    parsed = _count_parses(monkeypatch)
    target = {"model": {"w": torch.zeros(8)}}
    with tg.CheckpointManager(tmp_path, read_only=read_only) as mgr:
        assert mgr.restore_latest(target) == 2
        assert mgr.ctx.refs.newest is None  # taken: not kept for the manager's life
    assert torch.equal(target["model"]["w"], torch.full((8,), 2.0))
    assert parsed.count(2) == 1, parsed
    assert parsed.count(1) == (0 if read_only else 1), parsed


def test_a_writer_that_saves_before_restoring_drops_the_kept_manifest(tmp_path):
    _save(tmp_path)
    with tg.CheckpointManager(tmp_path, async_save=False, new_run=True) as mgr:
        assert mgr.ctx.refs.newest is not None and mgr.ctx.refs.newest.step == 2
        mgr.save(3, {"model": {"w": torch.zeros(8)}})
        assert mgr.ctx.refs.newest is None


def test_only_the_same_bytes_are_reused(tmp_path, monkeypatch):
    _save(tmp_path)
    other = tmp_path / "other"
    with tg.CheckpointManager(other, async_save=False) as mgr:  # step 2 with other values: other bytes
        mgr.save(2, {"model": {"w": torch.full((8,), 7.0)}})
    first = read_parsed(tmp_path, 2)
    parsed = _count_parses(monkeypatch)
    assert read_manifest(tmp_path, 2, reuse=first) is first.manifest  # unchanged: no parse
    assert read_manifest(tmp_path, 1, reuse=first).step == 1  # another step: parsed
    assert parsed == [1]
    key = tmp_path / step_dir_name(2) / MANIFEST_NAME
    data = key.read_bytes()
    os.replace(key, key.with_suffix(".old"))
    key.write_bytes(data)  # the same bytes in a new file (new inode and times): still the same manifest
    assert read_manifest(tmp_path, 2, reuse=first) is first.manifest
    key.write_bytes((other / step_dir_name(2) / MANIFEST_NAME).read_bytes())  # another manifest of step 2
    again = read_manifest(tmp_path, 2, reuse=first)
    assert parsed == [1, 2] and set(again.chunks) != set(first.manifest.chunks)


def test_a_reused_manifest_still_has_its_chunk_paths_checked(tmp_path):
    """The bytes are the same, but a chunk directory replaced by a symlink out of the root is refused, as a
    fresh parse would refuse it."""
    _save(tmp_path)
    first = read_parsed(tmp_path, 2)
    rel = next(iter(first.manifest.chunks.values())).path
    chunk_dir = tmp_path / rel.rsplit("/", 1)[0]
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    shutil.copytree(chunk_dir, outside)
    shutil.rmtree(chunk_dir)
    chunk_dir.symlink_to(outside, target_is_directory=True)
    with pytest.raises(tg.UnsafeCheckpointError):
        read_manifest(tmp_path, 2)
    with pytest.raises(tg.UnsafeCheckpointError):
        read_manifest(tmp_path, 2, reuse=first)


def test_a_manifest_deleted_since_it_was_parsed_is_not_returned(tmp_path):
    _save(tmp_path)
    first = read_parsed(tmp_path, 2)
    shutil.rmtree(tmp_path / step_dir_name(2))
    with pytest.raises(tg.CheckpointNotFoundError):
        read_manifest(tmp_path, 2, reuse=first)


def test_an_object_store_manifest_is_reused_for_the_same_bytes(tmp_path, monkeypatch):
    _save(tmp_path)
    storage = ObjectStorage(LocalObjects(tmp_path))  # the run root read as an object store
    assert storage.local_path is None
    first = read_parsed(storage, 2)
    parsed = _count_parses(monkeypatch)
    assert read_manifest(storage, 2, reuse=first) is first.manifest
    assert parsed == []


def test_restore_step_and_close_drop_the_manifest_kept_at_open(tmp_path):
    _save(tmp_path)
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.ctx.refs.newest is not None
        mgr.restore(1, {"model": {"w": torch.zeros(8)}})
        assert mgr.ctx.refs.newest is None
    mgr = tg.CheckpointManager(tmp_path)
    assert mgr.ctx.refs.newest is not None
    mgr.close()
    assert mgr.ctx.refs.newest is None
