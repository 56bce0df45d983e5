"""Elastic resharding under torchrun (gloo, CPU): FSDP2 state saved at N ranks loads bit for bit at M ranks, and
the data-loader position reshards so that no sample of the epoch is seen twice or skipped."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.format import TensorEntry

from .launch import run_workers
from .worker import BATCH, DATASET_SIZE, differences

pytestmark = pytest.mark.distributed

SAVE_AT = (2, 4)
LOAD_AT = (1, 2, 3, 4)
STEPS = 4  # saves at steps 2 and 4 (asynchronous, while FSDP keeps training)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """One training job per world size in SAVE_AT: its run root and every rank's observations."""
    base = tmp_path_factory.mktemp("saved")
    out = {}
    for n in SAVE_AT:
        d = base / f"n{n}"
        root = d / "root"
        out[n] = {"root": root, "ranks": run_workers(n, "save", d, root=str(root), steps=STEPS)}
    return out


@pytest.fixture(scope="module")
def loaded(
    saved: dict[int, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[int], list[dict[str, Any]]]:
    """``loaded(m)``: every rank's observations after restoring each saved root at world size m (launched once
    per m, on first use)."""
    cache: dict[int, list[dict[str, Any]]] = {}
    base = tmp_path_factory.mktemp("loaded")

    def get(m: int) -> list[dict[str, Any]]:
        if m not in cache:
            roots = {f"n{n}": str(s["root"]) for n, s in saved.items()}
            cache[m] = run_workers(m, "load", base / f"m{m}", roots=roots)
        return cache[m]

    return get


@pytest.mark.parametrize("n", SAVE_AT)
def test_each_rank_writes_only_its_own_shards_and_replicated_tensors_once(saved, n):
    root, ranks = saved[n]["root"], saved[n]["ranks"]
    m = read_manifest(root, 2)
    assert m.world_size == n
    for e in m.entries.values():
        if isinstance(e, TensorEntry):  # the shards tile the tensor: nothing stored twice
            assert sum(math.prod(s.sizes) for s in e.shards) == math.prod(e.shape), e.fqn
    shards = {fqn: len(e.shards) for fqn, e in m.entries.items() if isinstance(e, TensorEntry)}
    assert shards["app.model.l2.weight"] == n and shards["app.optim.state.l2.weight.exp_avg"] == n
    # replicated on every rank (a buffer, a plain tensor, the optimizer's step counters): one copy
    assert shards["app.model.scale"] == 1 and shards["extra.replicated"] == 1
    assert shards["app.optim.state.l1.weight.step"] == 1
    # every rank wrote a part, and together exactly what the checkpoint references (fresh root: no dedup)
    written = [r["bytes_written"]["2"] for r in ranks]
    assert all(w > 0 for w in written) and sum(written) == m.bytes


@pytest.mark.parametrize("m", LOAD_AT)
@pytest.mark.parametrize("n", SAVE_AT)
def test_state_saved_at_n_ranks_loads_bitwise_equal_at_m_ranks(saved, loaded, n, m):
    results = loaded(m)
    saver = saved[n]["ranks"]
    for rank, res in enumerate(results):
        r = res[f"n{n}"]
        assert r["step"] == STEPS
        assert r["optim_steps"] == [STEPS], "an optimizer that never stepped got its saved state back"
        # each rank's RNG continues where the same rank left it; ranks that did not exist take rank 0's
        assert r["rng"] == saver[rank if rank < n else 0]["saved"][str(STEPS)]["rng"]
    # full model and optimizer state (gathered from the M shards) bit for bit equal to the N-rank job's
    assert results[0][f"n{n}"]["differences"] == []


@pytest.mark.parametrize("m", LOAD_AT)
@pytest.mark.parametrize("n", SAVE_AT)
def test_the_epoch_resumed_at_m_ranks_consumes_every_remaining_sample_exactly_once(saved, loaded, n, m):
    before = [i for r in saved[n]["ranks"] for i in r["consumed"]]
    after = [i for r in loaded(m) for i in r[f"n{n}"]["rest"]]
    assert len(before) == n * STEPS * BATCH
    assert sorted(before + after) == list(range(DATASET_SIZE))
    assert all(r["saved"][str(STEPS)]["loader"]["start"] == len(before) for r in saved[n]["ranks"])


@pytest.mark.parametrize("n", SAVE_AT)
def test_a_sharded_checkpoint_restores_in_one_process_into_plain_tensors(saved, n):
    root = saved[n]["root"]
    state: dict[str, Any] = {"app": {}}
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == STEPS
    ref = torch.load(Path(root).parent / f"ref-{STEPS}.pt", weights_only=True)
    assert differences(state["app"], ref) == []
    assert not any(hasattr(t, "placements") for t in state["app"]["model"].values())  # plain, not DTensor
