"""A storage stall never hangs training, and an async save is never lost silently at exit (issue 16).

The stall is a real blocked write: ``trainguard.storage.local.write_file`` (every chunk goes through it) waits on
an event for the saves of the chosen steps. Each test releases the event at the end, and checks that the
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
import trainguard.storage.local as local
from trainguard.errors import ConfigError
from trainguard.recovery.events import read_events

TIMEOUT_S = 0.5


class Stall:
    """Blocks every chunk write of the saves of ``steps`` until ``release()``; counts the blocked writes."""

    def __init__(self, steps: set[int]) -> None:
        self.real = local.write_file
        self.steps = {f"step-{s:09d}.partial-" for s in steps}
        self.gate = threading.Event()
        self.blocked = 0
        self.returned = 0

    def __call__(self, path: Path, buf: Any, *, fsync: bool = True) -> None:
        if any(Path(path).parent.name.startswith(p) for p in self.steps):
            self.blocked += 1
            self.gate.wait()
            self.returned += 1
        self.real(path, buf, fsync=fsync)

    def release(self) -> None:
        self.gate.set()


@pytest.fixture
def stall(monkeypatch: pytest.MonkeyPatch) -> Any:
    made: list[Stall] = []

    def make(*steps: int) -> Stall:
        s = Stall(set(steps))
        monkeypatch.setattr(local, "write_file", s)
        made.append(s)
        return s

    yield make
    for s in made:
        s.release()


def assert_never_committed(root: Path, st: Stall, step: int) -> None:
    st.release()
    wait_until(lambda: st.returned == st.blocked, 30, "the stuck writes to return")
    time.sleep(0.3)  # the stuck thread's commit would come right after its writes
    assert not manifest_path(root, step).exists(), f"the abandoned save of step {step} committed later"


def test_a_stalled_save_fails_after_the_timeout_and_the_next_save_waiting_for_buffers_runs(tmp_path, stall):
    """The issue's input with when_busy="wait": the training thread blocked forever at the next save."""
    root = tmp_path / "root"
    st = stall(1)
    mgr = tg.CheckpointManager(
        root, save_timeout_s=TIMEOUT_S, staging_buffers=1, save_policy=tg.EveryNSteps(1)
    )
    h1 = mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, 30, "the save of step 1 to stall")
    t0 = time.monotonic()
    with pytest.raises(tg.SaveError, match="step 1") as ei:
        mgr.maybe_save(2, make_state(2))
    assert time.monotonic() - t0 < 20
    assert ei.value.step == 1 and "no progress" in str(ei.value) and "abandoned" in str(ei.value)
    assert h1.done() and isinstance(h1.error, tg.SaveError)
    h2 = mgr.maybe_save(2, make_state(2))  # the loop goes on: buffers were freed for the next save
    assert h2 is not None and h2.wait() is not None
    mgr.close()
    assert [e["step"] for e in read_events(root, event="save_abandoned")] == [1]
    assert_never_committed(root, st, 1)
    state = blank_state()
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 2
    assert_state_is(state, 2)


def test_with_when_busy_skip_saves_resume_after_the_stalled_one_is_abandoned(tmp_path, stall):
    """The issue's input with when_busy="skip": every later save was skipped and close() never returned."""
    root = tmp_path / "root"
    st = stall(1)
    mgr = tg.CheckpointManager(
        root, save_timeout_s=TIMEOUT_S, staging_buffers=1, when_busy="skip", save_policy=tg.EveryNSteps(1)
    )
    mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, 30, "the save of step 1 to stall")
    h2 = mgr.maybe_save(2, make_state(2))
    assert h2 is not None and h2.skipped  # within the timeout: skipped as before
    time.sleep(TIMEOUT_S + 0.2)
    with pytest.raises(tg.SaveError, match="step 1"):
        mgr.maybe_save(3, make_state(3))
    h4 = mgr.maybe_save(4, make_state(4))
    assert h4 is not None and not h4.skipped and h4.wait() is not None
    t0 = time.monotonic()
    mgr.close()
    assert time.monotonic() - t0 < 20
    assert_never_committed(root, st, 1)
    assert [i.step for i in tg.CheckpointManager(root, read_only=True).checkpoints()] == [4]


def test_close_returns_after_the_timeout_reporting_the_abandoned_save(tmp_path, stall):
    root = tmp_path / "root"
    st = stall(1)
    mgr = tg.CheckpointManager(root, save_timeout_s=TIMEOUT_S)
    mgr.save(1, make_state(1))
    wait_until(lambda: st.blocked > 0, 30, "the save of step 1 to stall")
    t0 = time.monotonic()
    with pytest.raises(tg.SaveError, match="step 1.*abandoned"):
        mgr.close()
    assert time.monotonic() - t0 < 20
    tg.CheckpointManager(root).close()  # the lock was released
    assert_never_committed(root, st, 1)


def test_a_slow_save_that_keeps_making_progress_is_not_abandoned(tmp_path, monkeypatch):
    real = local.write_file
    slow_calls = []

    def slow(path: Path, buf: Any, *, fsync: bool = True) -> None:
        if ".partial-" in Path(path).parent.name:
            slow_calls.append(path)
            time.sleep(0.4)
        real(path, buf, fsync=fsync)

    monkeypatch.setattr(local, "write_file", slow)
    root = tmp_path / "root"
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(12)}  # 12 chunks of 1 MiB
    with tg.CheckpointManager(root, save_timeout_s=1.0) as mgr:
        t0 = time.monotonic()
        result = mgr.save(1, state).wait()
        took = time.monotonic() - t0
    require(len(slow_calls) >= 12, "every chunk write was slowed")
    assert result is not None and took > 1.0  # longer than the timeout in all, but never idle that long
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
import trainguard.storage.local as local

real = local.write_file
def slow(path, buf, *, fsync=True):
    time.sleep(0.5)  # the persist is still running when the script ends
    real(path, buf, fsync=fsync)
local.write_file = slow
mgr = tg.CheckpointManager(sys.argv[1])
mgr.save(7, {"w": torch.full((1 << 18,), 7.0)})
print("saved", flush=True)
# no close(): the interpreter exits here
"""


def test_an_async_save_pending_at_interpreter_exit_is_flushed_with_a_warning(tmp_path):
    root = tmp_path / "root"
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120
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
import trainguard.storage.local as local

real = local.write_file
def slow(path, buf, *, fsync=True):
    time.sleep(1.0)  # the save is still in flight when the child is forked
    real(path, buf, fsync=fsync)
local.write_file = slow
mgr = tg.CheckpointManager(sys.argv[1])
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
        [sys.executable, str(script), str(tmp_path / "root")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0" in proc.stdout, (proc.stdout, proc.stderr)
    assert manifest_path(tmp_path / "root", 3).exists()
