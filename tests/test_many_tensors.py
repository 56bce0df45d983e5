"""Thousands of tiny tensors packed into one chunk: owners listed once each, in entry order, and a bit-exact
restore (the owner lists of such a chunk were built with a list's `in`: quadratic in the tensor count)."""

from __future__ import annotations

import torch

import trainguard as tg
from trainguard._restore import delta_chain_users
from trainguard.catalog import read_manifest


def test_a_packed_chunk_lists_each_owner_once_in_entry_order_and_restores_bit_exact(tmp_path):
    n = 3000
    state = {f"t{i}": torch.arange(4, dtype=torch.float32) + i for i in range(n)}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"model": state})
    m = read_manifest(tmp_path, 1)
    owners = m.chunk_owners()
    packed = max(owners.values(), key=len)
    assert len(packed) >= n and len(packed) == len(set(packed))
    assert packed == [fqn for fqn in m.entries if fqn in set(packed)]  # entry order
    users = delta_chain_users(m, list(owners), owners)
    assert all(users[h] == owners[h] for h in owners)  # raw chunks: no bases, the same lists
    target = {f"t{i}": torch.zeros(4) for i in range(n)}
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest({"model": target}) == 1
    assert all(torch.equal(target[k], v) for k, v in state.items())
