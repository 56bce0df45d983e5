"""Asynchronous saves: snapshot semantics, bounded staging memory, busy policies, background failures."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, LocalStorage

from .conftest import run_env


def slow_disk(root, seconds: float, gate: threading.Event | None = None) -> FaultyStorage:
    """``root``'s storage where every write takes ``seconds`` (or waits for ``gate``) first."""
    return FaultyStorage(
        LocalStorage(root), Fault("write", times=None, stall=gate if gate is not None else seconds)
    )


def test_a_tensor_modified_right_after_save_returns_is_saved_with_its_value_at_save_time(
    tmp_path,
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    optim.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in optim.state_dict()["state"].items()}
    gate = threading.Event()
    disk = slow_disk(tmp_path, 0.0, gate)  # the persist cannot write anything until the training step is done
    with tg.CheckpointManager(disk) as mgr:
        pending = mgr.save(1, {"model": model, "optim": optim})
        assert not pending.done()
        model(torch.randn(8, 64)).sum().backward()  # changes BatchNorm running stats (buffers)
        optim.step()  # changes parameters and exp_avg / exp_avg_sq / step in place
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        assert not torch.equal(model[0].weight, want["0.weight"]), "precondition: the live state changed"
        gate.set()
        result = pending.wait()
        assert result.step == 1 and result.block_s < result.persist_s
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        mgr.restore(1, {"model": fresh, "optim": fresh_optim})
    for k, v in want.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for i, st in want_optim.items():
        for k, v in st.items():
            assert torch.equal(fresh_optim.state_dict()["state"][i][k], v), (i, k)


def test_back_to_back_saves_on_a_slow_disk_wait_and_stay_within_two_buffer_sets(tmp_path):
    disk = slow_disk(tmp_path, 0.15)
    t = torch.randn(1 << 19)  # 2 MiB
    with tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(1)) as mgr:
        peak = 0
        for step in range(1, 7):
            t.add_(1.0)
            mgr.maybe_save(step, {"w": {"t": t}})
            peak = max(peak, mgr.staging_bytes)
        assert peak <= 2 * t.numel() * 4, "at most two staging buffer sets"
        mgr.wait()
        assert [i.step for i in mgr.checkpoints() if i.status == "valid"] == [1, 2, 3, 4, 5, 6]
        out: dict = {"w": {}}
        mgr.restore(6, out)
        assert torch.equal(out["w"]["t"], t)


def test_the_skip_policy_skips_saves_while_both_buffer_sets_are_busy_and_logs_it(tmp_path):
    gate = threading.Event()
    disk = slow_disk(tmp_path, 0.0, gate)
    t = torch.randn(1 << 19)
    with tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(1), when_busy="skip") as mgr:
        handles = [mgr.maybe_save(s, {"w": {"t": t + s}}) for s in range(1, 6)]
        assert [h.skipped for h in handles] == [False, False, True, True, True]
        assert mgr.staging_bytes <= 2 * t.numel() * 4
        gate.set()
        mgr.wait()
        assert [i.step for i in mgr.checkpoints()] == [1, 2]
    assert [e["step"] for e in read_events(tmp_path, event="save_skipped")] == [3, 4, 5]


def test_a_single_buffer_set_stages_only_when_no_save_is_persisting(tmp_path):
    disk = slow_disk(tmp_path, 0.2)
    with tg.CheckpointManager(disk, staging_buffers=1) as mgr:
        mgr.save(1, {"w": {"t": torch.randn(1 << 18)}})
        t0 = time.perf_counter()
        second = mgr.save(2, {"w": {"t": torch.randn(1 << 18)}})
        assert time.perf_counter() - t0 >= 0.15, "the second save waited for the first to persist"
        assert second.staging_s >= 0.15
        mgr.wait()


def test_a_background_write_failure_is_raised_by_wait_and_the_next_save_and_commits_nothing(
    tmp_path,
):
    disk = FaultyStorage(LocalStorage(tmp_path))
    with tg.CheckpointManager(disk) as mgr:
        mgr.save(1, {"w": {"t": torch.randn(1 << 18)}}).wait()
        broken = disk.add(Fault("write", times=None, exc=OSError(5, "injected I/O error")))
        p2 = mgr.save(2, {"w": {"t": torch.randn(1 << 18)}})
        with pytest.raises(tg.SaveError, match="injected I/O error"):
            p2.wait()
        p3 = mgr.save(
            3, {"w": {"t": torch.randn(1 << 18)}}
        )  # the error of 2 was seen via wait: not raised again
        deadline = time.monotonic() + 300  # fails at its first write: at once, or late on a loaded machine
        while not p3.done() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(tg.SaveError, match="step 3") as e:
            mgr.save(4, {"w": {"t": torch.randn(1 << 18)}})  # ... but the unseen failure of 3 is
        assert p3.done() and p3.error is not None
        assert e.value.pending_save.step == 4  # after staging the save of 4 (which fails on this disk too)
        with pytest.raises(tg.SaveError, match="injected I/O error"):
            e.value.pending_save.wait()
        broken.enabled = False
        mgr.save(5, {"w": {"t": torch.randn(1 << 18)}}).wait()
        assert {i.step: i.status for i in mgr.checkpoints()} == {1: "valid", 5: "valid"}
    assert [e["step"] for e in read_events(tmp_path, event="save_failed")] == [2, 3, 4]


def test_close_raises_an_unseen_background_failure_after_releasing_the_lock(tmp_path):
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("write", times=None, exc=OSError(5, "injected")))
    mgr = tg.CheckpointManager(disk)
    mgr.save(1, {"w": {"t": torch.randn(1 << 18)}})
    with pytest.raises(tg.SaveError):
        mgr.close()
    tg.CheckpointManager(tmp_path).close()  # the lock was released


CHILD = r"""
import os, signal, sys, torch, trainguard as tg
from trainguard.storage import Fault, FaultyStorage, LocalStorage
disk = FaultyStorage(LocalStorage(sys.argv[1]))
mgr = tg.CheckpointManager(disk)
t = torch.arange(1 << 20, dtype=torch.float32)
mgr.save(1, {"w": {"t": t}}).wait()
disk.add(Fault("write", match="chunks/*", call=lambda key: os.kill(os.getpid(), signal.SIGKILL)))
mgr.save(2, {"w": {"t": t + 1}})
t.add_(100)  # training goes on while the background persist runs
mgr.wait()
"""


def test_a_sigkill_during_a_background_persist_loses_only_that_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=run_env(), timeout=120)
    assert r.returncode == -signal.SIGKILL
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    assert {i.step: i.status for i in mgr.checkpoints()} == {1: "valid", 2: "incomplete"}
    out: dict = {"w": {}}
    assert mgr.restore_latest(out) == 1
    assert torch.equal(out["w"]["t"], torch.arange(1 << 20, dtype=torch.float32))
    from trainguard.integrity.verify import verify

    assert verify(tmp_path).ok


def test_a_background_persist_leaves_the_training_thread_a_core(monkeypatch):
    """An async save's writer pool has at most one thread fewer than the usable CPUs (at least one): on a
    2-core machine 4 writer threads made the training thread wait for a CPU (benchmarks/RESULTS.md); a
    synchronous save, whose caller waits anyway, keeps every thread."""
    import os

    from trainguard.distributed.options import WriterOptions

    opts = WriterOptions(threads=4)
    for cpus, want in ((1, 1), (2, 1), (3, 2), (4, 3), (5, 4), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=cpus: set(range(n)))
        assert opts.background().threads == want, cpus
    assert WriterOptions(threads=1).background().threads == 1


def test_writer_threads_let_low_threads_work_until_lifted_then_high():
    """The limit of a background save's writer threads: ``low`` work at once, ``high`` once someone waits."""
    from trainguard._writers import WriterThreads

    wt = WriterThreads()
    wt.configure(low=1, high=3)
    inside = []
    release = threading.Event()
    lock = threading.Lock()

    def work():
        with wt.slot():
            with lock:
                inside.append(1)
            release.wait(10)
            with lock:
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert len(inside) == 1 and wt.limit == 1 and not wt.lifted  # the other two wait for a slot
    wt.lift()
    deadline = time.monotonic() + 5
    while len(inside) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(inside) == 3 and wt.limit == 3
    release.set()
    for t in threads:
        t.join(5)
    assert not inside
    with pytest.raises(ValueError, match="low"):
        wt.configure(low=0, high=2)


def concurrency_probe(root) -> tuple[FaultyStorage, dict]:
    """``root``'s storage where every chunk write takes 50 ms, recording the most writes in progress at once."""
    seen = {"now": 0, "max": 0}
    lock = threading.Lock()

    def slow(_key):
        with lock:
            seen["now"] += 1
            seen["max"] = max(seen["max"], seen["now"])
        time.sleep(0.05)
        with lock:
            seen["now"] -= 1

    return FaultyStorage(LocalStorage(root), Fault("write", match="chunks/*", times=None, call=slow)), seen


def test_an_async_save_nobody_waits_for_keeps_one_writer_and_a_waited_on_one_uses_all(tmp_path, monkeypatch):
    """While training runs beside it, an async save's writers leave a core (one writer thread on 2 CPUs); once
    the caller waits for it (``wait()``), nothing trains, and it persists with every writer thread as a
    synchronous save does (0.5 GiB here: 81% -> 97% of the raw write, benchmarks/RESULTS.md)."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})  # 2 CPUs: background() = 1 thread
    disk, seen = concurrency_probe(tmp_path)
    mgr = tg.CheckpointManager(disk, async_save=True, check_finite="off")
    state = {"w": {f"t{i}": torch.full((1 << 19,), float(i)) for i in range(8)}}  # 8 own chunks of 2 MiB
    h = mgr.save(1, state)
    while not h.done():  # polled, as a training loop does: nobody waits
        time.sleep(0.005)
    assert h.error is None
    assert seen["max"] == 1
    seen["max"] = 0
    for t in state["w"].values():
        t.add_(10)  # new bytes for every chunk (no tensor equals another one of any save)
    mgr.save(2, state).wait()
    assert 2 <= seen["max"] <= 4  # the manager's 4 writer threads
    seen["max"] = 0
    for t in state["w"].values():
        t.add_(10)
    mgr.save(3, state)
    mgr.close()  # close() waits too
    assert seen["max"] >= 2
    out: dict = {"w": {}}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(out) == 3
    assert torch.equal(out["w"]["t7"], torch.full((1 << 19,), 27.0))
