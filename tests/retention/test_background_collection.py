"""Retention deletes the chunks it let go of in a background pass (retention/collector.py): a save returns
without waiting for the unlinks, and nothing that writes the chunk store (the next save, close) runs beside a
pass. The pass is held at its first chunk deletion by a FaultyStorage stall, so every ordering below is forced,
not timed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import trainguard as tg
from trainguard.integrity.verify import verify
from trainguard.retention.collector import BackgroundCollection
from trainguard.storage import Fault, FaultyStorage, LocalStorage

from ..faults.faultlib import chunk_files, referenced_chunks

GATE_S = 30.0  # longest a test waits for something that must happen (never reached when it passes)


def state(fill: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 16,), fill), "b": torch.full((1 << 15,), -fill)}  # 2 chunks of their own


@contextlib.contextmanager
def manager(disk: FaultyStorage, gate: threading.Event, **kw: object) -> Iterator[tg.CheckpointManager]:
    """A manager on ``disk``; a failing test body lets the held deletions go before close() waits for them."""
    mgr = tg.CheckpointManager(disk, fsync=False, **kw)
    try:
        yield mgr
    except BaseException:
        gate.set()
        raise
    finally:
        mgr.close()


@pytest.fixture
def held(tmp_path) -> Iterator[tuple[FaultyStorage, threading.Event]]:
    """A disk whose chunk deletions wait for the returned event (every one of them); the event is set when
    the test ends, so that a failing test fails instead of hanging in close()."""
    gate = threading.Event()
    fault = Fault("delete", match="chunks/*", stall=gate, times=None)
    try:
        yield FaultyStorage(LocalStorage(tmp_path, fsync=False), fault), gate
    finally:
        gate.set()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_returns_before_the_old_chunks_are_deleted(tmp_path, held, async_save):
    disk, gate = held
    with manager(disk, gate, keep=1, async_save=async_save) as mgr:
        mgr.save(1, state(1.0)).wait()
        old = referenced_chunks(tmp_path, [1])
        done = threading.Event()
        threading.Thread(target=lambda: (mgr.save(2, state(2.0)).wait(), done.set()), daemon=True).start()
        assert done.wait(GATE_S), "the save waited for its retention's chunk deletions"
        assert mgr.ctx.collection.running
        assert old <= chunk_files(tmp_path), "a chunk was deleted while deletions were held"
        assert [i.step for i in mgr.checkpoints()] == [2], "step 1's manifest is removed at once"
        with pytest.raises(TimeoutError, match="still being deleted"):
            mgr.wait(timeout=0.2)
        gate.set()
        mgr.wait()
        assert not mgr.ctx.collection.running
        assert chunk_files(tmp_path) == referenced_chunks(tmp_path, [2])


def test_the_next_save_waits_for_the_pass_and_never_reuses_a_chunk_it_deletes(tmp_path, held):
    """Step 3 holds exactly step 1's bytes, whose chunks the pass after step 2 is deleting: had step 3
    deduplicated against them while they were still there, the pass (which chose them before step 3
    committed) would have deleted chunks step 3 references."""
    disk, gate = held
    with manager(disk, gate, keep=1, async_save=False) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(2.0))
        assert mgr.ctx.collection.running
        third = threading.Thread(target=mgr.save, args=(3, state(1.0)), daemon=True)
        third.start()
        third.join(0.5)
        assert third.is_alive(), "step 3 persisted beside the pass deleting the chunks it needs"
        assert [i.step for i in mgr.checkpoints()] == [2]
        gate.set()
        third.join(GATE_S)
        assert not third.is_alive()
        mgr.wait()
        assert chunk_files(tmp_path) == referenced_chunks(tmp_path, [3])
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(1 << 15)}
        assert mgr.restore(3, out) == 3
        assert torch.equal(out["w"], state(1.0)["w"]) and torch.equal(out["b"], state(1.0)["b"])
    assert verify(tmp_path).ok


def test_close_waits_for_the_pass_before_it_releases_the_root(tmp_path, held):
    disk, gate = held
    mgr = tg.CheckpointManager(disk, keep=1, async_save=False, fsync=False)
    mgr.save(1, state(1.0))
    mgr.save(2, state(2.0))
    closer = threading.Thread(target=mgr.close, daemon=True)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive(), "close() returned while chunks were still being deleted"
    with pytest.raises(tg.RootLockedError):  # the root is still this writer's
        tg.CheckpointManager(tmp_path, async_save=False)
    gate.set()
    closer.join(GATE_S)
    assert not closer.is_alive()
    assert chunk_files(tmp_path) == referenced_chunks(tmp_path, [2])
    tg.CheckpointManager(tmp_path, async_save=False).close()  # released


def test_a_pass_that_raises_is_logged_and_the_chunks_are_collected_at_the_next_open(tmp_path, caplog):
    fault = Fault("delete", match="chunks/*", exc=RuntimeError("planted: a backend bug"), times=1)
    disk = FaultyStorage(LocalStorage(tmp_path, fsync=False), fault)
    with caplog.at_level(logging.ERROR, logger="trainguard"):
        with tg.CheckpointManager(disk, keep=1, async_save=False, fsync=False) as mgr:
            mgr.save(1, state(1.0))
            mgr.save(2, state(2.0))  # its pass raises at the first chunk: the save does not
            mgr.save(3, state(3.0))
    assert fault.fired == 1
    assert "deleting unreferenced chunks failed" in caplog.text and "planted: a backend bug" in caplog.text
    assert chunk_files(tmp_path) != referenced_chunks(tmp_path, [3])  # the chunk left by the failed pass
    with tg.CheckpointManager(tmp_path, async_save=False):
        pass  # the next writer's open collects orphans
    assert chunk_files(tmp_path) == referenced_chunks(tmp_path, [3])
    assert verify(tmp_path).ok


def test_passes_run_one_at_a_time_and_wait_from_inside_returns():
    coll = BackgroundCollection()
    gate, order, inside = threading.Event(), [], []

    def first() -> None:
        inside.append(coll.wait(0))  # from the pass's own thread: no deadlock
        gate.wait(GATE_S)
        order.append(1)

    coll.start(first)
    assert coll.running and not coll.wait(0.05)
    second = threading.Thread(target=coll.start, args=(lambda: order.append(2),), daemon=True)
    second.start()
    second.join(0.2)
    assert second.is_alive(), "a second pass started beside the first"
    gate.set()
    second.join(GATE_S)
    assert coll.wait(GATE_S) and not coll.running
    assert order == [1, 2] and inside == [True]


def test_a_save_waiting_for_a_slow_but_moving_pass_is_not_taken_for_stuck(tmp_path):
    """``save_timeout_s`` abandons a save without progress; the deletions of the pass it waits for count as
    progress (8 chunk deletions of 0.3 s each: 2.4 s of waiting against a 1 s timeout)."""
    slow = Fault("delete", match="chunks/*", stall=0.3, times=None)
    disk = FaultyStorage(LocalStorage(tmp_path, fsync=False), slow)

    def big(step: int) -> dict[str, torch.Tensor]:  # 2 MiB each: 8 chunks of their own, none shared
        return {f"t{i}": torch.full((1 << 19,), float(100 * step + i)) for i in range(8)}

    with tg.CheckpointManager(disk, keep=1, async_save=True, fsync=False, save_timeout_s=1.0) as mgr:
        mgr.save(1, big(1)).wait()
        mgr.save(2, big(2)).wait()
        assert mgr.ctx.collection.running
        mgr.save(3, big(3))
        mgr.wait()  # raises SaveError if step 3 was abandoned while it waited for the pass
        assert [i.step for i in mgr.checkpoints()] == [3]
    assert slow.fired >= 16 and verify(tmp_path).ok


def test_an_abandoned_save_that_committed_never_deletes_a_chunk_its_successor_uses(tmp_path):
    """``save_timeout_s`` abandons step 2 while it deletes step 1's manifest (after its commit); its successor,
    step 3, deduplicates against step 1's chunks. The abandoned thread resuming must not start a pass that
    deletes them once step 3 has committed and unpinned them (found by a review: 5 of 6 runs lost a chunk)."""

    def st(s_val: float, u_val: float) -> dict[str, torch.Tensor]:  # 2 MiB tensors: a chunk each
        d = {f"s{i}": torch.full((1 << 19,), s_val + i) for i in range(4)}
        d.update({f"u{i}": torch.full((1 << 19,), u_val + i) for i in range(4)})
        return d

    gate1, gate3, at3 = threading.Event(), threading.Event(), threading.Event()
    disk = FaultyStorage(LocalStorage(tmp_path, fsync=False))
    mgr = tg.CheckpointManager(disk, keep=1, async_save=True, fsync=False, save_timeout_s=1.0)
    try:
        mgr.save(1, st(7.0, 100.0)).wait()
        disk.add(Fault("delete", match="step-000000001/manifest.json", stall=gate1))
        disk.add(Fault("write", match="step-000000003/manifest.json", stall=gate3, call=lambda k: at3.set()))
        disk.add(Fault("delete", match="chunks/*", stall=0.2, times=None))  # a slow unlink
        h2 = mgr.save(2, st(200.0, 300.0))
        h3 = mgr.save(3, st(7.0, 500.0))  # its s* equal step 1's

        def waiter() -> None:  # a caller waiting drives the watchdog: it abandons step 2 after 1 s
            with contextlib.suppress(Exception):
                mgr.wait()

        threading.Thread(target=waiter, daemon=True).start()
        assert at3.wait(GATE_S), "step 3 never reached its publish"
        deadline = time.monotonic() + GATE_S
        while h2.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(h2.error, tg.SaveError) and "no progress" in str(h2.error), h2.error
        gate1.set()  # the abandoned step-2 thread resumes after its commit
        time.sleep(0.3)
        gate3.set()  # step 3 commits and unpins
        assert h3.wait(GATE_S).step == 3
        with contextlib.suppress(tg.SaveError):
            mgr.wait()
        assert [i.step for i in mgr.checkpoints() if i.status == "valid"] == [3]
    finally:
        gate1.set()
        gate3.set()
        with contextlib.suppress(tg.SaveError):
            mgr.close()
    assert verify(tmp_path).ok


def test_a_tiered_restore_of_a_dropped_step_waits_for_the_pass_and_leaves_a_valid_hot_copy(tmp_path, held):
    """Retention dropped step 1 from the hot root (a tier still holds it) and its chunks are being deleted.
    ``restore(1)`` reading them from the hot root and writing step 1's manifest back there would leave a
    corrupt step once the pass deleted them: the restore waits for the pass, then reads the tier."""
    disk, gate = held
    cold = tmp_path.parent / f"{tmp_path.name}-cold"
    with manager(disk, gate, keep=1, async_save=False, tiers=[tg.Tier(str(cold), sync=True)]) as mgr:
        mgr.save(1, state(1.0))
        mgr.save(2, state(2.0))
        assert mgr.ctx.collection.running
        out = {"w": torch.zeros(1 << 16), "b": torch.zeros(1 << 15)}
        restorer = threading.Thread(target=mgr.restore, args=(1, out), daemon=True)
        restorer.start()
        restorer.join(0.5)
        assert restorer.is_alive(), "the restore ran beside the deletion of the chunks it reads"
        gate.set()
        restorer.join(GATE_S)
        assert not restorer.is_alive()
        assert torch.equal(out["w"], state(1.0)["w"]) and torch.equal(out["b"], state(1.0)["b"])
        mgr._tiers.settle()  # noqa: SLF001 - the restore's write-behind to the hot root
        mgr.wait()
        assert all(i.status == "valid" for i in mgr.checkpoints()), mgr.checkpoints()
    assert verify(tmp_path).ok
