"""Regression tests for traps a new user hits with DCP and torchdata (issue 2, "Known traps")."""

from __future__ import annotations

import pickle

import pytest
import torch

import trainguard as tg


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def steps(model, optim, n: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        out.append(loss.item())
    return out


def test_restoring_into_a_fresh_adamw_that_never_stepped_restores_its_moments(tmp_path):
    model, optim = make()
    steps(model, optim, 5)
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"model": model, "optim": optim})
    fresh_model, fresh_optim = make(seed=99)
    assert fresh_optim.state_dict()["state"] == {}, "precondition: the template has no optimizer state"
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest({"model": fresh_model, "optim": fresh_optim}) == 5
    for i, st in optim.state_dict()["state"].items():
        got = fresh_optim.state_dict()["state"][i]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[k], got[k]), (i, k)
    # and the runs continue identically, not only at the first step after resume
    assert steps(model, optim, 4, seed=7) == steps(fresh_model, fresh_optim, 4, seed=7)


class Growing:
    """A Stateful whose state_dict() grows after use (like a data loader or a scheduler with extra keys)."""

    def __init__(self) -> None:
        self.seen: dict[str, object] = {}

    def state_dict(self) -> dict:
        return dict(self.seen)

    def load_state_dict(self, sd: dict) -> None:
        self.seen = dict(sd)


def test_a_stateful_whose_state_grew_is_restored_with_everything_that_was_saved(tmp_path):
    g = Growing()
    g.seen = {"epoch": 3, "buffer": torch.arange(5), "nested": {"pos": 7}}
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"g": g})
        fresh = Growing()
        mgr.restore(1, {"g": fresh})
    assert fresh.seen["epoch"] == 3 and fresh.seen["nested"] == {"pos": 7}
    assert torch.equal(fresh.seen["buffer"], torch.arange(5))


def test_restore_never_unpickles_and_dcp_metadata_is_never_written(tmp_path, monkeypatch):
    model, optim = make()
    steps(model, optim, 2)
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(2, {"model": model, "optim": optim, "extra": {"betas": (0.9, 0.95)}})
    assert not list(tmp_path.rglob(".metadata")), "DCP's pickled .metadata must not exist"

    def no_pickle(*a, **k):
        raise AssertionError("pickle.load called on checkpoint data")

    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    real_load = torch.load

    def checked_load(*a, **k):
        assert k.get("weights_only") is True, "torch.load must be called with weights_only=True"
        return real_load(*a, **k)

    monkeypatch.setattr(torch, "load", checked_load)
    fresh_model, fresh_optim = make(3)
    extra: dict = {}
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.restore(2, {"model": fresh_model, "optim": fresh_optim, "extra": extra})
    assert extra["betas"] == (0.9, 0.95)
    assert torch.equal(fresh_model.weight, model.weight)


def test_a_shape_mismatch_is_a_clear_error_not_a_fallback(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(8, 4)})
        with pytest.raises(tg.StateMismatchError) as ei:
            mgr.restore_latest({"model": torch.nn.Linear(8, 3)})
    assert (
        "shape differs (2): model.bias (checkpoint (4,), target (3,)), "
        "model.weight (checkpoint (4, 8), target (3, 8))" in str(ei.value)
    )


def test_restoring_a_key_the_checkpoint_lacks_names_what_it_holds(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
        with pytest.raises(tg.StateMismatchError, match="no state entry 'optim'.*'model'"):
            mgr.restore(1, {"model": torch.nn.Linear(2, 2), "optim": {}})


class Counter:
    """An object with state_dict/load_state_dict (torch's Stateful protocol), not a tensor or container."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, d: dict) -> None:
        self.n = d["n"]


@pytest.mark.parametrize("async_save", [False, True])
def test_an_object_with_state_dict_nested_beside_tensors_is_refused_naming_it_and_nothing_is_written(
    tmp_path, async_save
):
    # it used to be saved as its state_dict() by a synchronous save and come back as a plain dict in its place
    # (the object never restored); an async save refused it as unpicklable
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        with pytest.raises(tg.ConfigError, match=r"'extra\.counter'.*top-level entry") as err:
            mgr.save(1, {"extra": {"w": torch.ones(3), "counter": Counter(7)}}).wait()
        assert "state['counter'] = obj" in str(err.value)
        assert mgr.latest_step() is None
        mgr.save(2, {"w": torch.ones(3), "counter": Counter(7)}).wait()  # at the top level it is restored
    live = {"w": torch.zeros(3), "counter": Counter(0)}
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(live) == 2
    assert isinstance(live["counter"], Counter) and live["counter"].n == 7
