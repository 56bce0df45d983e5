"""``AsyncPersister``: the background half of an asynchronous save (queue, worker thread, in-flight tracking,
stall watchdog and error surfacing), and the flush at interpreter exit.

Invariants:
- One save persists at a time, in order. A failed save is reported through its handle; the thread survives it.
- With ``save_timeout_s``, a save that makes no progress (no chunk written, deduplicated or deleted by the
  retention pass it waits for; no flush finished) for that long is *abandoned* by whichever caller notices it
  (``acquire`` waiting for a buffer set, ``wait_handle``): its handle fails with a SaveError naming the step,
  its buffer set is replaced by a fresh one (the stuck thread may still read the old one: it is never handed
  out again), and a new worker thread takes over the queue. The stuck thread, if it ever returns, commits
  nothing (its commit checks the cancel flag; one that committed before skips retention) and exits. At most
  ``staging_buffers`` abandoned saves may be stuck at once (each holds a copy of the state, so host memory
  stays within twice the usual bound); beyond that a save fails at once instead of staging another copy.
- A save that a caller waits for (its handle's ``wait``, :meth:`AsyncPersister.wait`, or a new save blocked
  for a buffer set) has its writer-thread limit lifted (:class:`~trainguard._writers.WriterThreads`): nothing
  trains meanwhile, so it persists with every writer thread.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._text import exception_text, naming_step
from .._writers import WriterThreads
from ..errors import SaveError
from ..results import SaveResult
from .buffers import BufferSet, Stager
from .pending import PendingSave

log = logging.getLogger("trainguard")
POLL_S = 0.05


PERSIST_NICE = 10
"""Nice value of the async persist thread and the writer threads it starts (Linux: per thread), so that the
training thread keeps its CPU while a save persists."""


@dataclass(frozen=True)
class SaveRequest:
    """What a background save persists: the staged state and what the manifest records.

    Attributes:
        step: the step being saved.
        staged: flat name -> staged value (tensors are views into the save's staging buffer set).
        paths: flat name -> nested path of the entry in the state (``trainguard.state.flatten``).
        top: per top-level key, how it was collected (``trainguard._statefn``).
        metrics: numbers recorded in the manifest.
        metadata: JSON-able user metadata recorded in the manifest.
        t0: ``time.perf_counter()`` when the save began (persist_s is measured from it), seconds.
    """

    step: int
    staged: dict[str, Any]
    paths: Mapping[str, Any]
    top: dict[str, dict[str, Any]]
    metrics: Mapping[str, Any] | None
    metadata: Mapping[str, Any] | None
    t0: float


PersistFn = Callable[[SaveRequest, float, threading.Event, WriterThreads], SaveResult]
"""``persist(request, staging_s, cancel, writers)``: write and commit one save (the save path,
``_persist.persist``); ``writers`` is lifted once a caller waits for the save."""


@dataclass(eq=False)
class _Job:
    handle: PendingSave
    bufset: BufferSet
    request: SaveRequest | None
    cancel: threading.Event = field(default_factory=threading.Event)
    writers: WriterThreads = field(default_factory=WriterThreads)
    finished: threading.Event = field(default_factory=threading.Event)
    started_t: float | None = None


class AsyncPersister:
    """Persists staged saves in a background thread, one at a time, in order.

    Args:
        persist: the save path (:data:`PersistFn`).
        stager: the staging buffer sets (released after each save).
        save_timeout_s: abandon a save without progress for this long (None: wait forever).
        last_progress: monotonic time of the save path's last progress (the chunk store's).
        event: writes an event to the run's event log.
        on_persisted: called with ``(step, staging_s, result)`` after each background save committed.
        rank: this process's rank (named in errors). where: the run root, for messages.

    Not thread-safe for callers: use it from the training loop's thread (the worker is its own thread).
    """

    def __init__(
        self,
        persist: PersistFn,
        stager: Stager,
        *,
        save_timeout_s: float | None,
        last_progress: Callable[[], float],
        event: Callable[..., None],
        on_persisted: Callable[[int, float, SaveResult], None],
        rank: int = 0,
        where: str = "",
    ) -> None:
        self.persist = persist
        self.stager = stager
        self.save_timeout_s = save_timeout_s
        self._last_progress = last_progress
        self._event = event
        self._on_persisted = on_persisted
        self.rank = rank
        self.where = where
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._pending: list[PendingSave] = []
        self._in_flight_t: dict[int, float] = {}  # step -> wall time its save began
        self._lock = threading.Lock()
        self._current: _Job | None = None  # the job the worker is persisting
        self._abandoned: list[_Job] = []  # abandoned jobs (their threads may still be stuck)

    # -- submitting -----------------------------------------------------------------------------------------
    def acquire(self, *, block: bool) -> BufferSet | None:
        """A free buffer set for a new save; abandons a stalled save while waiting (``save_timeout_s``).

        Returns:
            A buffer set, or None when ``block`` is False and every set is busy.

        Raises:
            SaveError: more abandoned saves than buffer sets are still stuck (the storage is not coming back).
        """
        stuck = self.still_stuck()
        if len(stuck) > len(self.stager.sets):
            raise SaveError(
                f"the storage under {self.where} is stalled: the abandoned saves of steps {stuck} have not "
                "returned; not staging another copy of the state. Check the storage (mount, network, quota)",
                step=None,
            )
        if not block:
            self.check_stalled()
            return self.stager.acquire(block=False)
        bufset = self.stager.acquire(block=False)
        if bufset is not None:
            return bufset
        self.hurry()  # the caller waits for a save in flight to free its buffers: nothing trains meanwhile
        while True:
            timeout = POLL_S if self.save_timeout_s is not None else None
            bufset = self.stager.acquire(block=True, timeout=timeout)
            if bufset is not None:
                return bufset
            self.check_stalled()

    def submit(self, request: SaveRequest, handle: PendingSave, bufset: BufferSet) -> None:
        """Queue a staged save (its buffer set comes back to the stager when it is done)."""
        self._in_flight_t[request.step] = time.time()
        self._pending.append(handle)
        job = _Job(handle, bufset, request)
        handle.on_wait = job.writers.lift  # a caller waiting for it: every writer thread may work
        self._queue.put(job)
        self._ensure_worker()

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="trainguard-persist", daemon=True)
            self._worker.start()

    # -- state ----------------------------------------------------------------------------------------------
    def in_flight(self, step: int) -> bool:
        """True while a save of ``step`` is queued or persisting."""
        return step in self._in_flight_t

    def in_flight_since(self) -> float:
        """Wall time the oldest save still in flight began (now when none), seconds since the epoch."""
        return min([*self._in_flight_t.values()] or [time.time()])

    def pending_steps(self) -> list[int]:
        """Steps of saves not done yet, ascending."""
        return sorted(h.step for h in self._pending if not h.done())

    def abandoned_steps(self) -> set[int]:
        """Steps of every save abandoned so far whose thread may still be stuck."""
        return {j.handle.step for j in self._abandoned}

    def still_stuck(self) -> list[int]:
        """Steps of abandoned saves whose thread has not returned yet."""
        self._abandoned = [j for j in self._abandoned if not j.finished.is_set()]
        return [j.handle.step for j in self._abandoned]

    # -- errors and waiting ---------------------------------------------------------------------------------
    def raise_background_error(self, skip: PendingSave | None = None) -> None:
        """Raise (once) the error of a background save nobody has seen yet; forget finished handles.

        Args:
            skip: a save whose error is not raised now (the one the calling ``save`` just submitted).
        """
        err = None
        keep = []
        for h in self._pending:
            if not h.done() or h is skip:
                keep.append(h)
            elif h.error is not None and err is None and not h.error_seen:
                err = h.take_error()
            elif h.error is not None and not h.error_seen:
                keep.append(h)
        self._pending = keep
        if err is not None:
            raise err

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed or failed.

        Raises:
            SaveError: a background save failed (raised once).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self._pending):
            if not self.wait_handle(h, deadline):
                raise TimeoutError(f"save of step {h.step} still persisting after {timeout} s")
        self.raise_background_error()

    def hurry(self) -> None:
        """Lift the writer-thread limit of every save queued or persisting (a caller waits for them)."""
        for h in self._pending:
            h.hurry()

    def wait_handle(self, h: PendingSave, deadline: float | None) -> bool:
        """Wait for ``h`` until ``deadline`` (monotonic seconds), abandoning it when it stalls. False on timeout.
        Saves queued before ``h`` and ``h`` itself persist with every writer thread from now on."""
        for earlier in self._pending:
            earlier.hurry()
            if earlier is h:
                break
        h.hurry()
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = left if self.save_timeout_s is None else min(POLL_S, left if left is not None else POLL_S)
            if h.wait_done(step):
                return True
            self.check_stalled()
            if h.done():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def stop(self) -> None:
        """Stop the worker thread after the queued saves (call after :meth:`wait`)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()

    # -- the worker -----------------------------------------------------------------------------------------
    def _work(self) -> None:
        q = self._queue
        try:  # lower this thread's CPU priority (its writer threads inherit it): training keeps the CPU
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            job = q.get()
            if job is None:
                return
            self._run(job)
            if job.cancel.is_set():  # abandoned: a new worker owns the queue now; this one's is orphaned
                return

    def _run(self, job: _Job) -> None:
        handle = job.handle
        with self._lock:
            self._current = job
            job.started_t = time.monotonic()
        result = err = None
        try:
            request, job.request = job.request, None
            assert request is not None
            result = self.persist(request, handle.staging_s, job.cancel, job.writers)
        except BaseException as e:  # noqa: BLE001 - reported on the next save/wait/close
            if isinstance(e, SaveError):  # reported by a later call: the message must name the failed step
                if e.step is None:
                    e.step = handle.step
                if e.args and isinstance(e.args[0], str):
                    e.args = (naming_step(e.args[0], handle.step), *e.args[1:])
            err = (
                e
                if isinstance(e, SaveError)
                else SaveError(
                    f"background save of step {handle.step} failed: {exception_text(e)}",
                    step=handle.step,
                    rank_errors={self.rank: e},
                )
            )
        finally:
            request = None
            job.finished.set()
        with self._lock:
            if job.cancel.is_set():  # abandoned meanwhile: its handle already failed, a new worker took over
                log.warning(
                    "the abandoned save of step %d returned; nothing was committed for it", handle.step
                )
                return
            self._current = None
            if result is not None:
                handle.resolve(result)
                self._on_persisted(handle.step, handle.staging_s, result)
            else:
                handle.fail(err if err is not None else SaveError("save failed", step=handle.step))
            self.stager.release(job.bufset)
            self._in_flight_t.pop(handle.step, None)

    def check_stalled(self) -> bool:
        """Abandon the running save if it made no progress for ``save_timeout_s``. Returns True if it did."""
        timeout = self.save_timeout_s
        if timeout is None:
            return False
        with self._lock:
            job = self._current
            if job is None or job.started_t is None or job.finished.is_set():
                return False
            idle = time.monotonic() - max(job.started_t, self._last_progress())
            if idle < timeout:
                return False
            step = job.handle.step
            job.cancel.set()
            self._current = None
            job.handle.fail(
                SaveError(
                    f"the save of step {step} made no progress for {idle:.1f} s (save_timeout_s={timeout}): "
                    "the storage stalled? It was abandoned: nothing is committed for step "
                    f"{step}, earlier checkpoints are intact, and its staging buffers were replaced so that the "
                    "next save can run",
                    step=step,
                )
            )
            self.stager.replace(job.bufset)
            self._in_flight_t.pop(step, None)
            self._abandoned.append(job)
            old, self._queue = self._queue, queue.Queue()
            while True:  # jobs queued behind the stuck one go to the new worker
                try:
                    self._queue.put(old.get_nowait())
                except queue.Empty:
                    break
            self._worker = None
        log.error("abandoned the save of step %d: no progress for %.1f s", step, idle)
        self._event("save_abandoned", step=step, idle_s=idle, save_timeout_s=timeout)
        self._ensure_worker()
        return True


# -- flush at interpreter exit ------------------------------------------------------------------------------
class Flushable(Protocol):
    """What the exit flush needs of a manager: whether it is closed, its pending steps, and ``close``."""

    _closed: bool

    def _pending_steps(self) -> list[int]: ...

    def close(self) -> None: ...


def register_exit_flush(owner: Flushable, where: str) -> Any:
    """Flush ``owner`` at interpreter exit unless it is closed first; returns the handle for ``unregister``."""
    ref = weakref.ref(owner)
    pid = os.getpid()

    def flush() -> None:
        # A forked child (a DataLoader worker) inherits this hook and runs it at its exit
        # (multiprocessing calls threading._shutdown): its copy of the manager has no persist thread.
        if os.getpid() != pid:
            return
        m = ref()
        if m is None or m._closed:
            return
        pending = m._pending_steps()
        if pending:
            msg = (
                f"trainguard: the process is exiting without CheckpointManager.close(); waiting for the "
                f"pending save(s) of step(s) {pending} under {where} to commit. Call close() (or use the "
                "manager as a context manager) at the end of training."
            )
            _tell(msg, logging.WARNING)
        try:
            m.close()
        except BaseException as e:  # noqa: BLE001 - nobody is left to raise to
            _tell(f"trainguard: a save failed while flushing at exit: {exception_text(e)}", logging.ERROR)

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
