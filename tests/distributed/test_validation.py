"""check_finite and the probe fingerprint under torch.distributed (FSDP2, gloo; issue 11)."""

from __future__ import annotations

import pytest

from .launch import run_workers

pytestmark = pytest.mark.distributed
RANKS = 2


def test_a_nan_in_one_ranks_shard_rejects_the_save_on_every_rank_and_the_probe_matches(tmp_path):
    res = run_workers(RANKS, "validation", tmp_path, root=str(tmp_path / "root"), **{"async": True})
    for r in res:
        f = r["failure"]
        assert f is not None and f["type"] == "NonFiniteStateError", f
        assert r["restored"] == 3 and r["validate_s"] > 0
    assert res[RANKS - 1]["failure"]["tensors"] == {"app.model.l2.weight": 1}
    assert res[0]["failure"]["tensors"] == {}  # rank 0 found none; it names the other rank's finding
    assert "another rank" in res[0]["failure"]["message"]
    assert res[0]["listed"] == [[1, "valid"], [3, "valid"]]


def test_a_sharded_restore_scans_each_ranks_shard_as_it_lands_and_finds_a_saved_nan(tmp_path):
    res = run_workers(RANKS, "finite_load", tmp_path, root=str(tmp_path / "root"))
    for r in res:
        assert r["failure"] is not None and "non-finite" in r["failure"], r  # every rank fails together
        assert r["known"] == [["m.big"]], r  # scanned by the reading threads, not again; the packed one after
    assert "m.big" in res[RANKS - 1]["failure"]  # the rank holding the NaN names the tensor
    assert all(r["bitwise"] == {"big": True, "small": True, "bias": True} for r in res)  # the bytes did land
