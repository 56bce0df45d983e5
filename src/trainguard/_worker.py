"""The background persist worker of a ``CheckpointManager``, its stall watchdog and the flush at exit.

Invariants:
- One job persists at a time, in order. A failed job is reported through its handle; the thread survives it.
- With ``save_timeout_s``, a job that makes no progress (no chunk written or deduplicated, no flush finished)
  for that long is *abandoned* by whichever caller notices it (``save``/``maybe_save`` waiting for a buffer
  set, ``wait``, ``close``): its handle fails with a SaveError naming the step, its buffer set is replaced by a
  fresh one (the stuck thread may still read the old one: it is never handed out again), and a new worker
  thread takes over the queue. The stuck thread, if it ever returns, commits nothing (its commit checks the
  cancel flag) and exits. At most ``staging_buffers`` abandoned jobs may be stuck at once (each holds a copy
  of the state, so host memory stays within twice the usual bound); beyond that a save fails at once instead
  of staging another copy.
- At interpreter exit, a manager that was not closed is flushed: pending saves are waited for (bounded by
  ``save_timeout_s`` when set) and a warning says so; its failures are logged.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import SaveError

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .staging import BufferSet, PendingSave

log = logging.getLogger("trainguard")
POLL_S = 0.05


@dataclass(eq=False)
class Job:
    """One background save: its handle, its buffer set and the arguments of ``_persist.persist``."""

    handle: PendingSave
    bufset: BufferSet
    args: tuple[Any, ...]
    cancel: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    started_t: float | None = None


def work(mgr: CheckpointManager, q: queue.Queue[Any]) -> None:
    """Background persist loop (one thread per manager; replaced when its job is abandoned)."""
    from . import _persist

    try:  # lower this thread's CPU priority (its writer threads inherit it): training keeps the CPU
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    while True:
        job = q.get()
        if job is None:
            return
        handle = job.handle
        with mgr._job_lock:
            mgr._current = job
            job.started_t = time.monotonic()
        result = err = None
        try:
            staged, paths, top, metrics, metadata, t0 = job.args
            job.args = ()
            result = _persist.persist(
                mgr,
                handle.step,
                staged,
                paths,
                top,
                metrics,
                metadata,
                t0,
                blocking=False,
                staging_s=handle.staging_s,
                cancel=job.cancel,
            )
        except BaseException as e:  # noqa: BLE001 - reported on the next save/wait/close
            err = (
                e
                if isinstance(e, SaveError)
                else SaveError(
                    f"background save of step {handle.step} failed: {type(e).__name__}: {e}",
                    step=handle.step,
                    rank_errors={mgr.dist.rank: e},
                )
            )
        finally:
            staged = None  # noqa: F841 - drop the reference to the staged copy
            job.finished.set()
        with mgr._job_lock:
            if job.cancel.is_set():  # abandoned meanwhile: its handle already failed, a new worker took over
                log.warning(
                    "the abandoned save of step %d returned; nothing was committed for it", handle.step
                )
                return
            mgr._current = None
            if result is not None:
                handle._set_result(result)
                mgr.save_policy.record_save(
                    handle.step, now_s=time.monotonic(), block_s=handle.staging_s, persist_s=result.persist_s
                )
            else:
                handle._set_error(err if err is not None else SaveError("save failed", step=handle.step))
            if mgr._stager is not None:
                mgr._stager.release(job.bufset)
            mgr._in_flight.discard(handle.step)
            mgr._in_flight_t.pop(handle.step, None)


def check_stalled(mgr: CheckpointManager) -> bool:
    """Abandon the running job if it made no progress for ``save_timeout_s``. Returns True if it did."""
    timeout = mgr.save_timeout_s
    if timeout is None:
        return False
    with mgr._job_lock:
        job = mgr._current
        if job is None or job.started_t is None or job.finished.is_set():
            return False
        idle = time.monotonic() - max(job.started_t, mgr.store.last_progress)
        if idle < timeout:
            return False
        step = job.handle.step
        job.cancel.set()
        mgr._current = None
        job.handle._set_error(
            SaveError(
                f"the save of step {step} made no progress for {idle:.1f} s (save_timeout_s={timeout}): the "
                "storage stalled? It was abandoned: nothing is committed for step "
                f"{step}, earlier checkpoints are intact, and its staging buffers were replaced so that the "
                "next save can run",
                step=step,
            )
        )
        if mgr._stager is not None:
            mgr._stager.replace(job.bufset)
        mgr._in_flight.discard(step)
        mgr._in_flight_t.pop(step, None)
        mgr._abandoned.append(job)
        old, mgr._queue = mgr._queue, queue.Queue()
        while True:  # jobs queued behind the stuck one go to the new worker
            try:
                mgr._queue.put(old.get_nowait())
            except queue.Empty:
                break
        mgr._worker = None
    log.error("abandoned the save of step %d: no progress for %.1f s", step, idle)
    mgr._event("save_abandoned", step=step, idle_s=idle, save_timeout_s=timeout)
    mgr._ensure_worker()
    return True


def still_stuck(mgr: CheckpointManager) -> list[int]:
    """Steps of abandoned jobs whose thread has not returned yet."""
    mgr._abandoned = [j for j in mgr._abandoned if not j.finished.is_set()]
    return [j.handle.step for j in mgr._abandoned]


def acquire(mgr: CheckpointManager, *, block: bool) -> BufferSet | None:
    """A free buffer set for a new save; abandons a stalled save while waiting (``save_timeout_s``).

    Raises:
        SaveError: more abandoned saves than buffer sets are still stuck (the storage is not coming back).
    """
    assert mgr._stager is not None
    stuck = still_stuck(mgr)
    if len(stuck) > len(mgr._stager.sets):
        raise SaveError(
            f"the storage under {mgr.root} is stalled: the abandoned saves of steps {stuck} have not returned; "
            "not staging another copy of the state. Check the storage (mount, network, quota)",
            step=None,
        )
    if not block:
        check_stalled(mgr)
        return mgr._stager.acquire(block=False)
    while True:
        bufset = mgr._stager.acquire(block=True, timeout=POLL_S if mgr.save_timeout_s is not None else None)
        if bufset is not None:
            return bufset
        check_stalled(mgr)


def wait_handle(mgr: CheckpointManager, h: PendingSave, deadline: float | None) -> bool:
    """Wait for ``h`` until ``deadline`` (monotonic seconds), abandoning it when it stalls. False on timeout."""
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = left if mgr.save_timeout_s is None else min(POLL_S, left if left is not None else POLL_S)
        if h._event.wait(step):
            return True
        check_stalled(mgr)
        if h._event.is_set():
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False


# -- flush at interpreter exit ------------------------------------------------------------------------------
def register_exit_flush(mgr: CheckpointManager) -> Any:
    """Flush ``mgr`` at interpreter exit unless it is closed first; returns the handle for ``unregister``."""
    ref = weakref.ref(mgr)
    pid = os.getpid()

    def flush() -> None:
        # A forked child (a DataLoader worker) inherits this hook and runs it at its exit
        # (multiprocessing calls threading._shutdown): its copy of the manager has no persist thread.
        if os.getpid() != pid:
            return
        m = ref()
        if m is None or m._closed:
            return
        pending = sorted(h.step for h in m._pending if not h.done())
        if pending:
            msg = (
                f"trainguard: the process is exiting without CheckpointManager.close(); waiting for the "
                f"pending save(s) of step(s) {pending} under {m.root} to commit. Call close() (or use the "
                "manager as a context manager) at the end of training."
            )
            _tell(msg, logging.WARNING)
        try:
            m.close()
        except BaseException as e:  # noqa: BLE001 - nobody is left to raise to
            _tell(f"trainguard: a save failed while flushing at exit: {type(e).__name__}: {e}", logging.ERROR)

    # threading's exit hooks run before concurrent.futures refuses new work (the writer's thread pool) and
    # before atexit; later registrations run first. atexit where that hook is missing.
    try:
        (getattr(threading, "_register_atexit", None) or atexit.register)(flush)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(flush)
    return flush


def _tell(msg: str, level: int) -> None:
    if log.hasHandlers():
        log.log(level, msg)
    else:
        print(msg, file=sys.stderr, flush=True)
