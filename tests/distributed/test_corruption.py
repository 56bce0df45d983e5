"""Agreed fallback: a corrupt chunk that only rank 1 reads makes every rank restore the previous step
together, and training on from there re-saves the skipped step."""

from __future__ import annotations

from typing import Any

import pytest

from .launch import run_workers

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two ranks save steps 2 and 4; rank 0 flips a bit in a step-4-only chunk of rank 1's shards; restore."""
    d = tmp_path_factory.mktemp("corrupt")
    return run_workers(2, "corrupt", d, root=str(d / "root"))


def test_a_corrupt_chunk_of_rank_1_makes_every_rank_restore_the_previous_step_together(corrupt):
    chunk = corrupt[0]["corrupted"]["chunk"]
    assert [r["restored"] for r in corrupt] == [2, 2]
    for r in corrupt:
        assert [(s["step"], s["chunk"]) for s in r["skipped"]] == [(4, chunk)]
    assert corrupt[0]["differences"] == []  # every rank holds step 2's values


def test_only_rank_1_read_the_corrupt_chunk_so_its_failure_reached_rank_0(corrupt):
    h = corrupt[0]["corrupted"]["hash"]
    assert h in corrupt[1]["chunks_read"] and h not in corrupt[0]["chunks_read"]
    fqns = corrupt[0]["corrupted"]["fqns"]  # rank 1's shards of sharded parameters or their optimizer state
    assert fqns and all(f.startswith(("app.model.l", "app.optim.state.l")) for f in fqns)


def test_every_rank_logs_the_skip_as_an_event_naming_the_chunk(corrupt):
    chunk = corrupt[0]["corrupted"]["chunk"]
    events = corrupt[0]["events"]
    assert {e["rank"] for e in events} == {0, 1}
    assert all(e["step"] == 4 and e["chunk"] == chunk and e["tensors"] for e in events)


def test_training_on_from_the_fallback_resaves_the_skipped_step_bit_exact(corrupt):
    assert corrupt[0]["retrained_differences"] == []
    assert corrupt[0]["verify_after_resave"] == {"ok": True, "checked": [2, 4]}
