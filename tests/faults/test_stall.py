"""A storage stall never hangs training, and an async save is never lost silently at exit (issue 16).

The stall is a real blocked write: the run root's storage (a ``FaultyStorage`` handed to the manager) blocks
every chunk that the saves of the chosen steps stage (``Fault(staging="*step-N.partial-*")``) on an event. Each test releases the event at the end, and checks that the
abandoned save never commits, even after its thread comes back.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from faultlib import assert_state_is, blank_state, make_state, manifest_path, require, wait_until

import trainguard as tg
import trainguard.manager as manager_mod
from trainguard.errors import ConfigError
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, LocalStorage

TIMEOUT_S = 0.5
# where a test needs the next save to come *within* the timeout of the stall (not after it): room for a loaded
# 2-core machine to deschedule the test's thread between the stall and that save
WITHIN_TIMEOUT_S = 3.0
# The persist thread runs at nice 10: on a loaded machine it reaches its first chunk write (DCP imported on the
# first save, planning, staging) only after tens of seconds (30 s ran out under load). Event-driven waits.
STALL_WAIT_S = 300
# "returns after the timeout, not never": a bound against a hang only, far above what a loaded machine needs
NOT_FOR_EVER_S = 120


class Stall:
    """Blocks every chunk write of the saves of ``steps`` until ``release()``; counts the blocked writes.
    ``disk`` is the run root's storage to hand to the manager."""

    def __init__(self, root: Path, steps: set[int]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.gate = threading.Event()
        self.blocked = 0
        self.returned = 0
        self._lock = threading.Lock()
        self.threads_before = set(threading.enumerate())  # (another test's manager may have left threads)
        faults = [
            Fault("write", staging=f"*step-{s:09d}.partial-*", times=None, call=self._block) for s in steps
        ]
        self.disk = FaultyStorage(LocalStorage(root), *faults)

    def _block(self, key: str) -> None:
        with self._lock:
            self.blocked += 1
        self.gate.wait()
        with self._lock:
            self.returned += 1

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def stall() -> Any:
    made: list[Stall] = []

    def make(root: Path, *steps: int) -> Stall:
        s = Stall(root, set(steps))
        made.append(s)
        return s

    yield make
    for s in made:
        s.release()


def save_threads(st: Stall) -> list[threading.Thread]:
    """The live threads of saves started since ``st`` was made: persist workers and their chunk writers (the
    managers of the test are closed: what is left belongs to the abandoned save)."""
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith(("trainguard-persist", "trainguard-write")) and t not in st.threads_before
    ]


def assert_never_committed(root: Path, st: Stall, step: int) -> None:
    st.release()
    wait_until(lambda: st.returned == st.blocked, 300, "the stuck writes to return")
    # the stuck save's commit (if it wrongly made one) comes after its remaining writes, on its own threads:
    # wait until they have ended (not a fixed sleep, which a loaded machine outlasts); its persist worker ends
    # too once its save returns (a new worker took over its queue)
    wait_until(lambda: not save_threads(st), 120, "the abandoned save's threads to end")
    assert not manifest_path(root, step).exists(), f"the abandoned save of step {step} committed later"
    assert not list(root.glob(f"step-{step:09d}.partial-*")), "the abandoned save left its partial directory"


def test_a_stalled_save_fails_after_the_timeout_and_the_next_save_waiting_for_buffers_runs(tmp_path, stall):
    """The issue's input with when_busy="wait": the training thread blocked forever at the next save."""
    root = tmp_path / "root"
    st = stall(root, 1)
    mgr = tg.CheckpointManager(
        st.disk, save_timeout_s=TIMEOUT_S, staging_buffers=1, save_policy=tg.EveryNSteps(1)
    )
    h1 = mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, STALL_WAIT_S, "the save of step 1 to stall")
    t0 = time.monotonic()
    with pytest.raises(tg.SaveError, match="step 1") as ei:
        mgr.maybe_save(2, make_state(2))
    assert time.monotonic() - t0 < NOT_FOR_EVER_S
    assert ei.value.step == 1 and "no progress" in str(ei.value) and "abandoned" in str(ei.value)
    assert h1.done() and isinstance(h1.error, tg.SaveError)
    h2 = ei.value.pending_save  # step 2 was staged (buffers were freed) before step 1's error was raised
    assert h2 is not None and h2.step == 2 and h2.wait() is not None
    assert mgr.maybe_save(2, make_state(2), force=True) is None  # the loop goes on: nothing to save again
    mgr.close()
    assert [e["step"] for e in read_events(root, event="save_abandoned")] == [1]
    assert_never_committed(root, st, 1)
    state = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 2
    assert_state_is(state, 2)


def test_with_when_busy_skip_saves_resume_after_the_stalled_one_is_abandoned(tmp_path, stall):
    """The issue's input with when_busy="skip": every later save was skipped and close() never returned."""
    root = tmp_path / "root"
    st = stall(root, 1)
    mgr = tg.CheckpointManager(
        st.disk,
        save_timeout_s=WITHIN_TIMEOUT_S,
        staging_buffers=1,
        when_busy="skip",
        save_policy=tg.EveryNSteps(1),
    )
    mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, STALL_WAIT_S, "the save of step 1 to stall")
    h2 = mgr.maybe_save(2, make_state(2))
    assert h2 is not None and h2.skipped  # within the timeout: skipped as before
    time.sleep(WITHIN_TIMEOUT_S + 0.2)
    with pytest.raises(tg.SaveError, match="step 1") as ei:
        mgr.maybe_save(3, make_state(3))
    h3 = ei.value.pending_save  # step 3 was started before step 1's error was raised
    assert h3 is not None and h3.step == 3 and h3.wait() is not None
    h4 = mgr.maybe_save(4, make_state(4))
    assert h4 is not None and not h4.skipped and h4.wait() is not None
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < NOT_FOR_EVER_S
    assert_never_committed(root, st, 1)
    assert [i.step for i in tg.CheckpointManager(root, read_only=True).checkpoints()] == [3, 4]


def test_close_returns_after_the_timeout_reporting_the_abandoned_save(tmp_path, stall):
    root = tmp_path / "root"
    st = stall(root, 1)
    mgr = tg.CheckpointManager(st.disk, save_timeout_s=TIMEOUT_S)
    mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, STALL_WAIT_S, "the save of step 1 to stall")
    t0 = time.monotonic()
    with pytest.raises(tg.SaveError, match="step 1.*abandoned"):
        mgr.close()
    assert time.monotonic() - t0 < NOT_FOR_EVER_S
    tg.CheckpointManager(root).close()  # the lock was released
    assert_never_committed(root, st, 1)


def test_a_slow_save_that_keeps_making_progress_is_not_abandoned(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    one_at_a_time = threading.Lock()

    def slow_write(key: str) -> None:  # 0.4 s per chunk write, one after another whatever the writer threads
        with one_at_a_time:
            time.sleep(0.4)

    slow = Fault("write", match="chunks/*", times=None, call=slow_write)
    disk = FaultyStorage(LocalStorage(root), slow)
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)}  # 12 chunks of 1 MiB
    # 12 stalls one after another: 4.8 s in all, > the 3 s timeout; between two chunks stored there is one
    # 0.4 s stall and a 1 MiB write + fsync, far below it even on a busy disk
    with tg.CheckpointManager(disk, save_timeout_s=3.0) as mgr:
        # a first save without the stalls: the persist thread (nice 10) imports DCP at the first save, which a
        # loaded machine can stretch past the timeout before any chunk is written
        slow.enabled = False
        mgr.save(0, {"warm": torch.zeros(4)}).wait()
        slow.enabled = True
        t0 = time.monotonic()
        result = mgr.save(1, state).wait()
        took = time.monotonic() - t0
    require(slow.seen >= 12, "every chunk write was slowed")
    assert result is not None and took > 3.0  # longer than the timeout in all, but never idle that long
    assert manifest_path(root, 1).exists()


def test_save_timeout_must_be_positive_seconds(tmp_path):
    for bad in (0, -1, "10", True):
        with pytest.raises(ConfigError, match="save_timeout_s"):
            tg.CheckpointManager(tmp_path / "r", save_timeout_s=bad)  # type: ignore[arg-type]


# -- exit without close ---------------------------------------------------------------------------------------
EXIT_SCRIPT = """
import sys, time
import torch
import trainguard as tg
from trainguard.storage import Fault, FaultyStorage, LocalStorage

# every write takes 0.5 s: the persist is still running when the script ends
disk = FaultyStorage(LocalStorage(sys.argv[1]), Fault("write", times=None, stall=0.5))
mgr = tg.CheckpointManager(disk)
mgr.save(7, {"w": torch.full((1 << 18,), 7.0)})
print("saved", flush=True)
# no close(): the interpreter exits here
"""


def test_an_async_save_pending_at_interpreter_exit_is_flushed_with_a_warning(tmp_path):
    root = tmp_path / "root"
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "saved" in proc.stdout
    assert "without CheckpointManager.close()" in proc.stderr and "step(s) [7]" in proc.stderr, proc.stderr
    assert manifest_path(root, 7).exists(), "the pending save was lost at exit"
    state: dict[str, Any] = {"w": torch.zeros(1 << 18)}
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 7
    assert torch.equal(state["w"], torch.full((1 << 18,), 7.0))


# -- bounded history ------------------------------------------------------------------------------------------
def test_the_saves_history_keeps_only_the_most_recent_results(tmp_path, monkeypatch):
    monkeypatch.setattr(manager_mod, "SAVES_KEPT", 3)
    with tg.CheckpointManager(tmp_path / "root", async_save=False) as mgr:
        for s in range(1, 8):
            mgr.save(s, {"w": torch.full((16,), float(s))})
        assert [r.step for r in mgr.saves] == [5, 6, 7]


FORK_SCRIPT = """
import multiprocessing as mp, sys, time
import torch
import trainguard as tg
from trainguard.storage import Fault, FaultyStorage, LocalStorage

# every write takes 1 s: the save is still in flight when the child is forked
disk = FaultyStorage(LocalStorage(sys.argv[1]), Fault("write", times=None, stall=1.0))
mgr = tg.CheckpointManager(disk)
mgr.save(3, {"w": torch.full((1 << 18,), 3.0)})
child = mp.get_context("fork").Process(target=lambda: None)  # as a DataLoader worker is forked
child.start()
child.join(30)
print("child exit", child.exitcode, flush=True)
mgr.close()
"""


def test_a_forked_child_does_not_wait_for_the_parents_saves_at_its_exit(tmp_path):
    """A DataLoader worker forked while a save was in flight inherited the exit flush and hung at its exit
    waiting for a save that only the parent's thread could finish."""
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "root")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0" in proc.stdout, (proc.stdout, proc.stderr)
    assert manifest_path(tmp_path / "root", 3).exists()
