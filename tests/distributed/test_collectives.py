"""Which calls are collective, and how long they wait (gloo, CPU, 4 ranks): trainguard's own process groups
inherit the timeout given to ``init_process_group`` (or ``dist_timeout_s``), so a rank that never joins fails
a save in the time the user chose, not in torch's 30-minute default; a read-only manager calls no collective,
so rank 0 alone can open one, list, and export while the other ranks do something else."""

from __future__ import annotations

from typing import Any

import pytest

from .launch import run_workers

pytestmark = pytest.mark.distributed

PG_TIMEOUT_S = 20
# dist_timeout_s of the override check (a value check only: long, so that no group times out on a rank that a
# loaded machine starts late) and of the save whose peers never join (it fails after it; the peers come back
# after PEERS_AWAY_S). Creating a group waits up to its timeout for every rank: 3 s was too tight under load.
OVERRIDE_TIMEOUT_S = 60.0
DEAD_TIMEOUT_S = 8.0
PEERS_AWAY_S = 30


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    d = tmp_path_factory.mktemp("collectives")
    return run_workers(
        4,
        "collectives",
        d,
        root=str(d / "root"),
        pg_timeout_s=PG_TIMEOUT_S,
        peers_away_s=PEERS_AWAY_S,
        override_timeout_s=OVERRIDE_TIMEOUT_S,
        dead_timeout_s=DEAD_TIMEOUT_S,
    )


def test_trainguards_groups_inherit_the_init_process_group_timeout(ranks):
    for res in ranks:
        assert res["inherited"] == [PG_TIMEOUT_S, PG_TIMEOUT_S]


def test_dist_timeout_s_overrides_the_inherited_timeout(ranks):
    for res in ranks:
        assert res["override"] == [OVERRIDE_TIMEOUT_S, OVERRIDE_TIMEOUT_S]


def test_a_read_only_manager_on_rank_0_alone_lists_and_restores_without_a_collective(ranks):
    alone = ranks[0]["alone"]
    print(f"rank 0 alone: list + restore in {alone['elapsed_s']:.2f} s")
    assert alone["latest"] == 1 and alone["listed"] == [1] and alone["restored"] == 1
    assert alone["w"] == [float(i + 1) for i in range(8)]
    assert alone["elapsed_s"] < PG_TIMEOUT_S / 2  # it did not wait for the other ranks


def test_a_save_whose_peers_never_join_fails_within_dist_timeout_s(ranks):
    dead = ranks[0]["dead_peers"]
    print(
        f"rank 0's save with dist_timeout_s={DEAD_TIMEOUT_S:g} and absent peers failed after {dead['elapsed_s']:.1f} s: {dead['error']}"
    )
    assert dead["error"] is not None
    # the timeout (plus slack), not torch's 30 min nor the peers' return
    assert dead["elapsed_s"] < PEERS_AWAY_S - 5, dead


def test_per_rank_stores_an_object_per_rank_even_when_the_ranks_agree(ranks):
    entries = ranks[0]["entries"]
    assert {f: r for f, r in entries.items() if f.startswith("pr.")} == {f"pr.k@rank{r}": r for r in range(4)}
    assert entries["w.t"] is None and entries["note"] is None  # the rest: stored once
