"""AdaptivePolicy driving a real CheckpointManager."""

from __future__ import annotations

import time

import pytest

from trainguard.planning.adaptive import AdaptivePolicy
from trainguard.recovery.events import read_events

torch = pytest.importorskip("torch")


def test_the_manager_binds_the_policy_reports_its_saves_and_the_choice_is_logged(tmp_path) -> None:
    from trainguard.manager import CheckpointManager

    # Intervals of 0.2-0.4 s against steps of ~5 ms: many steps per save even when a loaded machine makes a
    # step 5x slower; the loop runs 1.5 s and then on until two saves are logged (a slow disk delays them).
    policy = AdaptivePolicy(prior_mtbf_s=1.0, prior_failures=1e6, min_interval_s=0.2, max_interval_s=0.4)
    manager = CheckpointManager(tmp_path, save_policy=policy, keep=2)
    state = {"w": torch.zeros(1000)}
    start, step = time.monotonic(), 0
    try:
        while True:
            step += 1
            manager.maybe_save(step, state)
            time.sleep(0.005)
            elapsed = time.monotonic() - start
            if elapsed >= 1.5 and step % 20 == 0:
                if len(read_events(tmp_path, event="save")) >= 2 or elapsed > 300:
                    break
        manager.wait()
    finally:
        manager.close()
    saves = read_events(tmp_path, event="save")
    assert 2 <= len(saves) < step / 2  # saved on time, not every step
    d = policy.decision
    assert d.block_s is not None and d.persist_s is not None
    assert policy.interval_s >= max(d.persist_s, 0.05)
    logged = read_events(tmp_path, event="adaptive_interval")
    assert logged[0]["block_s"] is None  # at bind, before any save
    assert any(e["block_s"] is not None for e in logged)  # the first measured decision
