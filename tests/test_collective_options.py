"""Options of the collective machinery, checked in one process: bad values are ConfigErrors naming the fix
(the multi-rank behaviour is in tests/distributed/test_collectives.py and test_per_rank.py)."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg


@pytest.mark.parametrize("bad", [0, -1.0, "30", True])
def test_dist_timeout_s_must_be_a_positive_number_of_seconds(tmp_path, bad):
    with pytest.raises(tg.TrainguardError, match="dist_timeout_s"):
        tg.CheckpointManager(tmp_path, dist_timeout_s=bad)


def test_a_writer_cannot_be_local(tmp_path):
    with pytest.raises(tg.TrainguardError, match="collective=False is for read_only=True"):
        tg.CheckpointManager(tmp_path, collective=False)


def test_a_local_read_only_manager_in_one_process_restores(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False, dist_timeout_s=5) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    for collective in (None, True, False):
        state = {"w": torch.zeros(3)}
        assert (
            tg.CheckpointManager(tmp_path, read_only=True, collective=collective).restore_latest(state) == 1
        )
        assert torch.equal(state["w"], torch.ones(3))


def test_per_rank_needs_a_stateful_object_or_a_dict_and_a_callable_hook():
    with pytest.raises(tg.TrainguardError, match="state_dict"):
        tg.PerRank(3)
    with pytest.raises(tg.TrainguardError, match="callable"):
        tg.PerRank({}, reshard="saved[0]")  # type: ignore[arg-type]


def test_per_rank_in_one_process_saves_and_restores_like_the_object_it_wraps(tmp_path):
    cursor = {"offset": 7, "t": torch.tensor([70])}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"cursor": tg.PerRank(cursor)})
    back = tg.PerRank({"offset": -1, "t": torch.zeros(1, dtype=torch.int64)})
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"cursor": back}) == 1
    assert back.obj["offset"] == 7 and torch.equal(back.obj["t"], torch.tensor([70]))
