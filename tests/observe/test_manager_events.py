"""The manager's events that the report builds on: ``progress`` (steps over time between checkpoints) and
user events such as ``fault_injected``."""

from __future__ import annotations

import time

import pytest
import torch

import trainguard as tg
import trainguard.manager as manager_mod
from trainguard.errors import ConfigError
from trainguard.recovery.events import read_events


def test_log_event_refuses_trainguards_own_event_names(tmp_path):
    mgr = tg.CheckpointManager(tmp_path)
    with pytest.raises(ConfigError, match="another name"):
        mgr.log_event("failure", cause="made up")
    mgr.log_event("fault_injected", kind="hang", step=3)
    mgr.close()
    [rec] = read_events(tmp_path, event="fault_injected")
    assert (rec["kind"], rec["step"], rec["source"]) == ("hang", 3, "manager")


def test_maybe_save_logs_progress_at_most_once_per_interval(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod, "PROGRESS_INTERVAL_S", 0.2)
    mgr = tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1000))
    state = {"w": torch.zeros(4)}
    t0 = time.monotonic()
    for step in range(1, 31):
        mgr.maybe_save(step, state)
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    mgr.close()
    progress = read_events(tmp_path, event="progress")
    steps = [r["step"] for r in progress]
    assert steps == sorted(steps) and len(set(steps)) == len(steps) and steps[-1] <= 30
    assert 3 <= len(progress) <= elapsed / 0.2 + 1
    gaps = [b["t"] - a["t"] for a, b in zip(progress, progress[1:], strict=False)]
    assert all(g >= 0.19 for g in gaps), gaps


def test_log_event_on_a_read_only_manager_says_it_has_no_event_log(tmp_path):
    tg.CheckpointManager(tmp_path).close()
    ro = tg.CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(tg.TrainguardError, match="no event log"):
        ro.log_event("note")


def test_every_event_trainguard_writes_is_reserved_and_documented(repo):
    import re

    from trainguard.recovery.events import OWN_EVENTS

    src = "\n".join(p.read_text() for p in (repo / "src" / "trainguard").rglob("*.py"))
    written = set(re.findall(r'(?:_event|\.event|\.write)\(\s*"([a-z_]+)"', src))
    assert len(written) >= 20 and written <= OWN_EVENTS, written - OWN_EVENTS
    fmt = (repo / "docs" / "FORMAT.md").read_text()
    assert all(f"| `{name}` |" in fmt for name in OWN_EVENTS), [
        n for n in OWN_EVENTS if f"| `{n}` |" not in fmt
    ]
