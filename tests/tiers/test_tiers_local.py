"""Tiers on a shared-filesystem path and the object-store backends (no S3 server needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.format import manifest_from_json
from trainguard.recovery.events import read_events
from trainguard.storage.objects import FsspecObjects, LocalObjects, ObjectStore, open_objects
from trainguard.tiers.remote import RemoteRoot

from ..conftest import run_env
from .helpers import CHUNK, make_state, object_round_trip, same, save_on_shared_tier, train, weights


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_each_object_store_backend_satisfies_the_protocol_and_moves_bytes(kind: str, tmp_path: Path) -> None:
    import uuid

    store = open_objects(tmp_path / "t" if kind == "local" else f"memory://tg-{uuid.uuid4().hex}/run")
    assert isinstance(store, ObjectStore)
    assert isinstance(store, LocalObjects if kind == "local" else FsspecObjects)
    object_round_trip(store)


def test_tier_arguments_are_checked_and_secrets_are_never_recorded(tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match="stall_timeout_s"):
        tg.Tier("s3://b/r", stall_timeout_s=0)
    with pytest.raises(tg.ConfigError, match="keep"):
        tg.Tier("s3://b/r", keep="two")
    with pytest.raises(tg.ConfigError, match="storage_options"):
        tg.Tier("s3://b/r", storage_options="key=1")
    assert issubclass(tg.TierUploadError, tg.TrainguardError)
    t = tg.Tier(
        str(tmp_path / "shared") + "/", storage_options={"secret": "s", "client_kwargs": {"key": "k", "x": 1}}
    )
    assert t.key == str(tmp_path / "shared")
    assert t.record()["storage_options"] == {"client_kwargs": {"x": 1}}
    with pytest.raises(tg.ConfigError, match="unknown storage scheme"):
        tg.CheckpointManager(tmp_path / "hot", tiers=[tg.Tier("nosuch://b/r")])
    with pytest.raises(tg.MissingDependencyError, match="pip install"):
        tg.CheckpointManager(tmp_path / "hot2", tiers=[tg.Tier("gs://bucket/run")])  # gcsfs not installed
    with pytest.raises(tg.ConfigError, match="given twice"):
        tg.CheckpointManager(
            tmp_path / "hot3", tiers=[tg.Tier(str(tmp_path / "s")), tg.Tier(str(tmp_path / "s"))]
        )


def test_per_tier_retention_keeps_the_tiers_policy_and_frees_only_unreferenced_chunks(tmp_path: Path) -> None:
    hot, shared = tmp_path / "hot", tmp_path / "shared"
    state = make_state()
    with tg.CheckpointManager(
        hot, keep=1, tiers=[tg.Tier(str(shared), keep=2, sync=True)], chunk_size_bytes=CHUNK
    ) as mgr:
        for step in range(1, 6):
            train(state)
            mgr.save(step, state).wait()
        infos = mgr.checkpoints()
    # hot keeps 1, the tier keeps 2; steps only on the tier are listed from there
    assert {i.step: i.tiers for i in infos} == {4: {str(shared): "valid"}, 5: {str(shared): "valid"}}
    remote = RemoteRoot(LocalObjects(shared))
    assert remote.committed_steps() == [4, 5]
    referenced = set()
    for s in (4, 5):
        referenced |= {
            r.path
            for r in manifest_from_json(
                (shared / f"step-00000000{s}/manifest.json").read_bytes()
            ).chunks.values()
        }
    assert set(LocalObjects(shared).list("chunks/")) == referenced
    assert sorted(e["step"] for e in read_events(hot, event="tier_retention_delete")) == [1, 2, 3]


def test_a_new_node_with_an_empty_hot_root_restores_from_a_shared_filesystem_tier(tmp_path: Path) -> None:
    shared, state = save_on_shared_tier(tmp_path, 7)
    fresh = make_state(seed=11)
    with tg.CheckpointManager(
        tmp_path / "node2", tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK
    ) as mgr:
        assert mgr.prefetch() == 7
        assert mgr.restore_latest(fresh) == 7
    assert same(weights(state), weights(fresh))
    assert json.loads((tmp_path / "node2" / "tiers.json").read_text())["tiers"][0]["url"] == str(shared)


def test_hot_retention_keeps_a_checkpoint_still_to_be_uploaded(tmp_path: Path) -> None:
    from trainguard.tiers.attach import TierSet

    hot = tmp_path / "hot"
    state = make_state()
    mgr = tg.CheckpointManager(
        hot, keep=1, tiers=[tg.Tier(str(tmp_path / "shared"), upload_timeout_s=1)], chunk_size_bytes=CHUNK
    )
    assert isinstance(mgr._tiers, TierSet)
    mgr._tiers.uploader.stop.set()  # uploads are held back: every step stays "to be sent"
    link = mgr._tiers.links[0]
    for step in (1, 2, 3):
        train(state)
        mgr.save(step, state).wait()
        link.failed[step] = "held"  # as a failed upload waiting for its retry
    assert sorted(s for s in (1, 2, 3) if (hot / f"step-00000000{s}/manifest.json").exists()) == [1, 2, 3]
    with pytest.raises(tg.TierUploadError):
        mgr.close()


def test_background_scrubber_repairs_hot_chunks_from_a_tier(tmp_path: Path) -> None:
    import os

    import torch

    from trainguard.catalog import corrupt_marker, read_manifest

    hot, shared = tmp_path / "hot", tmp_path / "shared"
    mgr = tg.CheckpointManager(
        hot,
        save_policy=tg.EveryNSteps(1),
        scrub_interval_s=3600,
        chunk_size_bytes=CHUNK,
        tiers=[tg.Tier(str(shared), sync=True)],
    )
    mgr.save(1, {"w": torch.arange(4096, dtype=torch.float32), "v": torch.ones(4096)}).wait()
    recs = sorted(read_manifest(hot, 1).chunks.values(), key=lambda r: r.path)
    assert len(recs) >= 2
    good = {r.path: (hot / r.path).read_bytes() for r in recs}
    flipped, removed = hot / recs[0].path, hot / recs[1].path
    os.chmod(flipped, 0o644)
    data = bytearray(flipped.read_bytes())
    data[7] ^= 1
    flipped.write_bytes(bytes(data))  # bit rot on the hot root
    removed.unlink()  # and a chunk lost there
    mgr._scrubber.scrub_once()
    assert corrupt_marker(hot, 1) is None  # every damaged chunk repaired and re-verified
    for r in recs:
        assert (hot / r.path).read_bytes() == good[r.path]
    rep = list(read_events(hot, event="tier_repair"))
    assert {e["chunk"] for e in rep} == {recs[0].path, recs[1].path}
    assert all(e["from"] == str(shared) and e["step"] == 1 for e in rep)
    assert list(read_events(hot, event="scrub"))[-1]["repaired"] == [1]
    assert tg.CheckpointManager(hot, read_only=True).checkpoints()[0].status != "corrupt"
    # damage no tier can repair stays marked: the tier's copy rotted too
    tier_chunk = shared / recs[0].path
    os.chmod(tier_chunk, 0o644)
    tier_chunk.write_bytes(b"x" * len(good[recs[0].path]))
    flipped.write_bytes(bytes(data))  # the same bit flip again on the hot root
    mgr._scrubber.scrub_once()
    assert corrupt_marker(hot, 1) is not None
    assert list(read_events(hot, event="scrub"))[-1]["repaired"] == []
    mgr.close()
    st = {i.step: i for i in tg.CheckpointManager(hot, read_only=True).checkpoints()}
    assert st[1].status == "corrupt"


def test_background_scrubber_without_tiers_only_reports(tmp_path: Path) -> None:
    import torch

    from trainguard.catalog import corrupt_marker, read_manifest

    mgr = tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), scrub_interval_s=3600)
    mgr.save(1, {"w": torch.ones(1000)}).wait()
    chunk = tmp_path / next(iter(read_manifest(tmp_path, 1).chunks.values())).path
    chunk.chmod(0o644)
    chunk.write_bytes(b"\0" * chunk.stat().st_size)  # bit rot
    mgr._scrubber.scrub_once()
    mgr.close()
    assert corrupt_marker(tmp_path, 1) is not None
    assert not list(read_events(tmp_path, event="tier_repair"))
    assert "repaired" not in list(read_events(tmp_path, event="scrub"))[-1]


def test_a_filesystem_that_fails_to_construct_is_a_config_error_without_unraisable_noise(
    tmp_path: Path,
) -> None:
    """ftp:// without its required `host` option: FTPFileSystem.__init__ raises TypeError and its __del__
    then fails on the half-built object; the user sees one ConfigError naming the URL and nothing else."""
    code = (
        "import trainguard as tg\n"
        "for make in (lambda: tg.CheckpointManager('ftp://host/y'),\n"
        f"             lambda: tg.CheckpointManager({str(tmp_path / 'hot')!r}, tiers=[tg.Tier('ftp://host/y')])):\n"
        "    try:\n"
        "        make()\n"
        "    except tg.ConfigError as e:\n"
        "        print('CONFIG', e)\n"
        "import gc; gc.collect()\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), timeout=120
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(
        line.startswith("CONFIG 'ftp://host/y': the ftp:// filesystem") for line in lines
    )
    assert "host" in lines[0] and "storage_options" in lines[0]
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
