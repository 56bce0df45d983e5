"""trainguard pauses Python's automatic garbage collection while the caller waits on a save or restore, while a
manifest is parsed and while a background save persists (trainguard._gc: a 32,000-tensor save spent 2.6-3.1 s
of 5.2-5.5 s in collections), and always gives it back: nested, concurrent, after errors, after a time limit,
in forked children, without touching the job's own gc.enable()/gc.disable(), and collecting the cycles made
during the pause when it ends."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest
import torch

import trainguard as tg
from trainguard import _gc
from trainguard._gc import paused_gc


def _paused() -> bool:
    return gc.get_threshold()[0] == 0


@pytest.fixture(autouse=True)
def _collector_state():
    was, thresholds = gc.isenabled(), gc.get_threshold()
    gc.enable()
    yield
    gc.set_threshold(*thresholds)
    if was:
        gc.enable()
    else:
        gc.disable()
    assert _gc._depth == 0


def test_nested_pauses_resume_after_the_outermost_with_the_thresholds_found():
    before = gc.get_threshold()
    with paused_gc():
        assert _paused() and gc.isenabled()  # the job's on/off flag is not touched
        with paused_gc(limit_s=None):
            assert _paused()
        assert _paused()
    assert gc.get_threshold() == before


def test_an_error_in_the_body_resumes_collection():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.get_threshold() == before


def test_the_jobs_own_gc_disable_is_left_alone_before_and_during_a_pause():
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()
    gc.enable()
    with paused_gc():
        gc.disable()  # a job that manages the collector by hand (e.g. --manual-gc) while a save persists
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
    assert _paused()  # the other thread's pause is still in progress
    release.set()
    t.join(5)
    assert not _paused()


def test_a_pause_past_its_limit_resumes_collection():
    with paused_gc(limit_s=0.05):
        deadline = time.monotonic() + 5
        while _paused() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _paused()
    assert not _paused()


def test_a_timer_that_cannot_start_leaves_a_pause_without_limit_that_still_ends(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Timer, "start", refuse)
    with paused_gc():
        assert _paused()
    assert not _paused()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_cycles_made_during_back_to_back_pauses_are_collected_when_each_ends():
    refs = []
    for _ in range(3):
        with paused_gc():
            c = _Cycle()
            refs.append(weakref.ref(c))
            del c
            assert refs[-1]() is not None  # not collected while paused
        assert refs[-1]() is None  # the young generation is collected as the pause ends


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_pause_gets_collection_back_and_can_pause_again():
    before = gc.get_threshold()
    r, w = os.pipe()
    with paused_gc():
        pid = os.fork()
    if pid == 0:  # the child, after leaving the pause it was forked in
        try:
            with paused_gc():
                inside = _paused()
            os.write(w, f"{gc.get_threshold()} {_gc._depth} {inside}".encode())
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 200).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert got == f"{before} 0 True"


def test_a_limit_timer_of_an_ended_run_does_not_end_a_later_one():
    stale = threading.Thread(target=_gc._resume)  # a timer that fired late, after its run ended
    with paused_gc():
        stale.start()
        stale.join(5)
        assert _paused()
    assert not _paused()


def test_an_interrupt_while_the_limit_timer_starts_leaves_no_pause(monkeypatch):
    before = gc.get_threshold()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(threading.Timer, "start", interrupted)
    with pytest.raises(KeyboardInterrupt), paused_gc():
        pass
    assert gc.get_threshold() == before and _gc._depth == 0


def test_thresholds_left_by_a_pause_interrupted_while_ending_come_back_with_the_next_one():
    before = gc.get_threshold()
    _gc._saved = before  # the state an interrupt between the two steps of _exit would leave
    gc.set_threshold(0, *before[1:])
    with paused_gc():
        assert _paused()
    assert gc.get_threshold() == before and _gc._saved is None


def test_a_jobs_own_threshold_zero_is_kept():
    before = gc.get_threshold()
    gc.set_threshold(0, *before[1:])
    with paused_gc():
        pass
    assert gc.get_threshold()[0] == 0


class _Probe:
    """A Stateful that records whether collection was paused while trainguard called it."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.t = torch.arange(4.0)

    def state_dict(self):
        self.seen.append(_paused())
        return {"t": self.t}

    def load_state_dict(self, sd):
        self.seen.append(_paused())
        self.t = sd["t"]


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_restore_pause_collection_and_give_it_back(tmp_path, async_save):
    probe = _Probe()
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"probe": probe})
        mgr.wait()
        assert not _paused()
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest({"probe": probe}) == 1
    assert not _paused() and gc.isenabled()
    assert probe.seen and all(probe.seen), probe.seen  # collected and loaded with collection paused


def test_a_background_persist_runs_with_collection_paused(tmp_path, monkeypatch):
    from trainguard import _persist

    real = _persist.persist
    seen: list[tuple[bool, bool]] = []  # (paused, in the caller's thread)
    caller = threading.get_ident()

    def recording(*args, **kwargs):
        seen.append((_paused(), threading.get_ident() == caller))
        return real(*args, **kwargs)

    monkeypatch.setattr(_persist, "persist", recording)
    with tg.CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(8)}})
        mgr.wait()
        assert not _paused()
    assert seen == [(True, False)]
