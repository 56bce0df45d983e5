"""Tiers under torch.distributed: a 2-rank torchrun job (gloo, CPU, FSDP2) with an S3 tier (moto's server).

Who uploads what: the ranks write their chunks to the shared hot root and rank 0 commits; rank 0 alone then
uploads every chunk of the step (its own and the other ranks') and, last, the manifest. A new node with an
empty hot root restores the step from the tier at 2 ranks, bit-exact (model, optimizer, RNG, data position)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..distributed.launch import HERE, run_workers

pytestmark = [pytest.mark.distributed, pytest.mark.s3]
TIER_WORKER = HERE / "tier_worker.py"


def test_rank0_uploads_every_chunk_then_the_manifest_and_a_new_node_restores_from_s3_bit_exact(
    bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/dist"
    out = tmp_path / "out"
    saved = run_workers(
        2, "tier_save", out, worker=TIER_WORKER, root=str(tmp_path / "hot"), url=url, timeout_s=240
    )
    r0, r1 = saved
    manifest = "step-000000002/manifest.json"
    assert r1["puts"] == []  # rank 1 sends nothing: its chunks are on the shared hot root
    assert r0["puts"][-1] == manifest and r0["puts"].count(manifest) == 1  # the commit on the tier: last
    assert sorted(r0["puts"][:-1]) == r0["chunks"]  # every chunk of the step, each once, by rank 0
    assert r0["uploaders"] == [0]
    from trainguard.storage.objects import open_objects
    from trainguard.tiers.remote import RemoteRoot

    assert [(s.step, s.status) for s in RemoteRoot(open_objects(url)).scan()] == [(2, "valid")]
    loaded = run_workers(
        2, "tier_load", out, worker=TIER_WORKER, root=str(tmp_path / "node2-hot"), url=url, timeout_s=240
    )
    for rank, res in enumerate(loaded):
        assert res["step"] == 2 and res["restored_from_tier"] == [2]
        assert res["rng"] == saved[rank]["saved"]["rng"] and res["loader"] == saved[rank]["saved"]["loader"]
    assert loaded[0]["differences"] == []  # the full model and optimizer state, bitwise
