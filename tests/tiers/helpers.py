"""Small training states for tier tests (a few chunks each, so tests stay fast)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CHUNK = 16 << 10  # 16 KiB chunks: a model below has several


def make_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": optim}


def train(state: dict[str, Any], steps: int = 1) -> None:
    model, optim = state["model"], state["optim"]
    for _ in range(steps):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()


def weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state["model"].state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save_on_shared_tier(tmp_path: Any, step: int) -> tuple[Any, dict[str, Any]]:
    """Train 2 steps and save ``step`` from ``tmp_path/node1`` with ``tmp_path/shared`` as a tier (a shared
    filesystem); returns the tier's path and the state saved."""
    import trainguard as tg

    shared = tmp_path / "shared"
    state = make_state()
    with tg.CheckpointManager(
        tmp_path / "node1", tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK
    ) as mgr:
        train(state, 2)
        mgr.save(step, state).wait()
    return shared, state


def save_two_steps(hot: Path, tiers: list[Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Save steps 1 and 2 from ``hot`` with ``tiers`` (``tg.Tier``s), training once before each; returns the
    weights saved at each step."""
    import trainguard as tg

    state = make_state()
    with tg.CheckpointManager(hot, tiers=tiers, chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
        w1 = weights(state)
        train(state)
        mgr.save(2, state).wait()
    return w1, weights(state)


def chunks_only_in_step_2(root: Path) -> list[str]:
    """The paths of the chunks step 2 references and step 1 does not (sorted), read from ``root``'s manifests."""
    from trainguard.format import manifest_from_json

    m1 = manifest_from_json((root / "step-000000001/manifest.json").read_bytes())
    m2 = manifest_from_json((root / "step-000000002/manifest.json").read_bytes())
    return sorted(m2.chunks[k].path for k in set(m2.chunks) - set(m1.chunks))


def object_round_trip(store: Any) -> None:
    """The ``ObjectStore`` contract on an empty ``store``: put, get, size, list by prefix, create-if-absent,
    delete (twice: deleting a missing object is fine), and a get of a deleted object raising FileNotFoundError."""
    import pytest

    store.put("chunks/ab/x", b"hello")
    store.put("step-000000001/manifest.json", b"{}")
    assert store.get("chunks/ab/x") == b"hello"
    assert store.size("chunks/ab/x") == 5 and store.size("nope") is None
    assert store.list("chunks/") == {"chunks/ab/x": 5}
    assert set(store.list("step-")) == {"step-000000001/manifest.json"}
    assert store.create(".lock", b"1") is True and store.create(".lock", b"2") is False
    assert store.get(".lock") == b"1"
    store.delete("chunks/ab/x")
    store.delete("chunks/ab/x")  # missing is fine
    assert store.size("chunks/ab/x") is None and store.list("chunks/") == {}
    with pytest.raises(FileNotFoundError):
        store.get("chunks/ab/x")
