"""trainguard pauses Python's cyclic garbage collector while the caller waits on a save or restore and while a
background save persists (trainguard._gc: a 32,000-tensor save spent 2.6-3.1 s of 5.2-5.5 s in collections),
and always gives it back: nested, concurrent, after errors, after a time limit, and never turning on a
collector the job had turned off."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import trainguard as tg
from trainguard._gc import paused_gc


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_nested_pauses_resume_after_the_outermost():
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_an_error_in_the_body_resumes_the_collector():
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_collector_the_job_turned_off_stays_off():
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_concurrent_pauses_resume_when_the_last_ends():
    first_in, release = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            first_in.set()
            release.wait(5)

    t = threading.Thread(target=other)
    t.start()
    assert first_in.wait(5)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread's pause is still in progress
    release.set()
    t.join(5)
    assert gc.isenabled()


def test_a_pause_past_its_limit_turns_the_collector_back_on():
    with paused_gc(limit_s=0.05):
        deadline = time.monotonic() + 5
        while not gc.isenabled() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.isenabled()
    assert gc.isenabled()


class _Probe:
    """A Stateful that records whether the collector ran while trainguard called it."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.t = torch.arange(4.0)

    def state_dict(self):
        self.seen.append(gc.isenabled())
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.seen.append(gc.isenabled())
        self.t = sd["t"]


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_restore_pause_the_collector_and_give_it_back(tmp_path, async_save):
    probe = _Probe()
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"probe": probe})
        mgr.wait()
        assert gc.isenabled()
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest({"probe": probe}) == 1
    assert gc.isenabled()
    assert probe.seen and not any(probe.seen), probe.seen  # collected and loaded with the collector paused


def test_a_background_persist_runs_with_the_collector_paused(tmp_path, monkeypatch):
    from trainguard import _persist

    real = _persist.persist
    seen: list[tuple[bool, bool]] = []  # (collector on, in the caller's thread)
    caller = threading.get_ident()

    def recording(*args, **kwargs):
        seen.append((gc.isenabled(), threading.get_ident() == caller))
        return real(*args, **kwargs)

    monkeypatch.setattr(_persist, "persist", recording)
    with tg.CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(8)}})
        mgr.wait()
        assert gc.isenabled()
    assert seen == [(False, False)]
