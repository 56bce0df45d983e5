"""Per-rank state under torchrun (gloo, CPU): a value that differs between ranks is never collapsed into one
rank's value. Four (and two) ranks each save a cursor whose ``state_dict()`` is ``{"offset": rank, "consumed":
tensor([rank * 10]), "rank": rank}``, plain per-rank values and tensors, and nested dicts, beside replicated
state; at the same world size each rank gets its own back; at another world size the restore raises naming
the keys unless ``tg.PerRank(obj, reshard=fn)`` gives the rule."""

from __future__ import annotations

from typing import Any

import pytest

import trainguard as tg

from .launch import run_workers
from .worker import fresh_per_rank_state, observed, per_rank_state

pytestmark = pytest.mark.distributed

WORLD = (2, 4)


def own(rank: int) -> dict[str, Any]:
    """What rank ``rank`` saved, as ``observed`` reports it."""
    return observed(per_rank_state(rank))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    base = tmp_path_factory.mktemp("perrank")
    out = {}
    for n in WORLD:
        root = base / f"n{n}" / "root"
        out[n] = {"root": root, "ranks": run_workers(n, "perrank", base / f"n{n}", root=str(root))}
    return out


@pytest.mark.parametrize("n", WORLD)
def test_every_rank_restores_its_own_values_at_the_same_world_size(saved, n):
    for rank, res in enumerate(saved[n]["ranks"]):
        assert res["step"] == 1
        assert res["restored"] == own(rank), f"rank {rank} got a mixture of other ranks' values"


@pytest.mark.parametrize("n", WORLD)
def test_differing_keys_are_stored_per_rank_and_identical_ones_once(saved, n):
    entries = saved[n]["ranks"][0]["entries"]
    assert saved[n]["ranks"][0]["format_version"] == 2
    for fqn in ("cursor.offset", "cursor.consumed", "cursor.rank", "vals.offset", "vals.t", "vals.nested.a"):
        assert {r: entries.get(f"{fqn}@rank{r}") for r in range(n)} == {r: r for r in range(n)}, fqn
        assert fqn not in entries
    for fqn in ("shared.lr", "shared.w", "vals.nested.same_t"):
        assert entries[fqn] is None and not any(f"{fqn}@rank{r}" in entries for r in range(n))


@pytest.fixture(scope="module")
def resharded(saved, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 4-rank root restored at 2 ranks and the 2-rank root at 4 ranks (one launch each)."""
    base = tmp_path_factory.mktemp("perrank_load")
    at2 = run_workers(2, "perrank_load", base / "m2", roots={"n4": str(saved[4]["root"])})
    at4 = run_workers(4, "perrank_load", base / "m4", roots={"n2": str(saved[2]["root"])})
    return [
        *({"m": 2, "n": 4, "res": r["n4"], "rank": i} for i, r in enumerate(at2)),
        *({"m": 4, "n": 2, "res": r["n2"], "rank": i} for i, r in enumerate(at4)),
    ]


def test_another_world_size_without_a_reshard_hook_raises_naming_the_keys(resharded):
    for case in resharded:
        err = case["res"]["no_hook"]["error"]
        assert err is not None, f"{case['n']} -> {case['m']} ranks restored per-rank values without a rule"
        assert "'cursor'" in err and "cursor.offset" in err and "tg.PerRank(obj, reshard=fn)" in err
        assert f"world size {case['n']}" in err and f"world size {case['m']}" in err
        assert case["res"]["no_hook"]["untouched"] == observed(fresh_per_rank_state())  # nothing half-loaded


def test_another_world_size_with_a_per_rank_hook_gets_what_the_hook_chose_from_every_saved_rank(resharded):
    for case in resharded:
        n, m, rank, res = case["n"], case["m"], case["rank"], case["res"]
        assert res["step"] == 1
        assert res["calls"] == [{"saved_ranks": n, "rank": rank, "world_size": m}] * 2  # cursor and vals
        want = own(rank % n)
        assert res["hooked"] == want


def test_one_process_restores_a_per_rank_checkpoint_only_with_a_hook(saved):
    root = saved[4]["root"]
    with pytest.raises(tg.StateMismatchError, match="cursor"):
        tg.CheckpointManager(root, read_only=True).restore_latest(fresh_per_rank_state())
    state = fresh_per_rank_state()
    state["cursor"] = tg.PerRank(state["cursor"], reshard=lambda saved, r, w: saved[3])
    state["vals"] = tg.PerRank(state["vals"], reshard=lambda saved, r, w: saved[2])
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 1
    got = observed(state)
    assert (
        got["cursor"] == own(3)["cursor"]
        and got["vals"] == own(2)["vals"]
        and got["shared"] == own(0)["shared"]
    )
