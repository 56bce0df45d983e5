"""A manifest missing one parameter's optimizer state (issue 16) is refused, never restored "successfully" with
that parameter's Adam state silently empty (or a KeyError at the next ``optimizer.step()``)."""

from __future__ import annotations

import pytest
import torch
from faultlib import read_manifest_json, write_manifest

import trainguard as tg


def model_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def saved_run(root, wrap: bool):
    model, optim = model_and_adamw(0)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        optim.step()
        optim.zero_grad()
    state = {"app": tg.ModelOptimizerState(model, optim)} if wrap else {"model": model, "optim": optim}
    with tg.CheckpointManager(root, async_save=False, fsync=False) as mgr:
        mgr.save(1, state)
    return "app.optim.state.1.weight" if wrap else "optim.state.2"


def drop_entries(root, prefix: str, keys: tuple[str, ...]) -> list[str]:
    body = read_manifest_json(root, 1)
    gone = [f for f in body["entries"] if any(f == f"{prefix}.{k}" for k in keys)]
    assert gone, f"precondition: entries under {prefix!r} exist"
    for f in gone:
        del body["entries"][f]
    write_manifest(root, 1, body)  # a consistent manifest (valid CRC32C) that lacks them
    return gone


@pytest.mark.parametrize("wrap", [False, True], ids=["optimizer", "ModelOptimizerState"])
@pytest.mark.parametrize(
    "keys", [("exp_avg", "exp_avg_sq", "step"), ("exp_avg_sq",)], ids=["whole-parameter", "one-moment"]
)
def test_a_manifest_missing_a_parameters_optimizer_state_is_refused(tmp_path, wrap, keys):
    prefix = saved_run(tmp_path, wrap)
    gone = drop_entries(tmp_path, prefix, keys)
    model, optim = model_and_adamw(1)
    state = {"app": tg.ModelOptimizerState(model, optim)} if wrap else {"model": model, "optim": optim}
    before = [p.detach().clone() for p in model.parameters()]
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(tg.StateMismatchError, match="lacks optimizer state that its manifest recorded") as ei:
        mgr.restore_latest(state)
    for f in gone:
        assert f in str(ei.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "nothing loaded"
    if not wrap:  # strict=False is the explicit way to continue (DCP's set_state_dict has its own strictness)
        assert mgr.restore_latest(state, strict=False) == 1
        assert torch.equal(next(model.parameters()), next(saved_params(tmp_path)))


def saved_params(root):
    model, _ = model_and_adamw(2)
    tg.CheckpointManager(root, read_only=True).restore_latest({"model": model})
    return model.parameters()
