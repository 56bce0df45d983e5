"""``BackgroundCollection``: the deletion of a save's garbage chunks, off the save's critical path.

After a commit, retention removes the manifests of the checkpoints its policy no longer keeps (at once, in the
save), then deletes the chunk files only those checkpoints referenced. The deletion is one unlink per chunk
file, which is not free: on this project's VM (ext4 mounted with ``discard``) about 3 ms per 8 MiB file,
0.14-0.18 s of a 0.55 s synchronous save of 0.5 GiB in 64 chunks with ``keep=1`` (benchmarks/RESULTS.md,
"Retention's chunk deletion off the save's path"); a parallel or network filesystem pays a round trip per file.
So the deletion runs in one background thread, and the save returns (or an async save resolves) without it.

Invariants:

- At most one pass runs at a time; :meth:`BackgroundCollection.start` waits for the previous one first.
- The next save's persist, retention itself, a failed save's cleanup, a restore (a tiered one would
  otherwise read a dropped step's chunks from the hot root and publish its manifest there again),
  ``CheckpointManager.wait`` and ``close`` wait for the pass (``close`` before it releases the root's write
  lock; with ``save_timeout_s``, a pass without progress that long is cancelled at its next chunk). So a pass
  never runs beside a save of this process that could deduplicate against a chunk it is deleting.
- Whatever the timing (an abandoned save's thread, which skips retention, included), a chunk is deleted only
  if, under the chunk store's lock, it is not pinned by a save in flight and no committed manifest known to
  the retention cache references it (a save records its manifest's chunks there before it unpins them:
  :meth:`~trainguard.incremental.chunkstore.ChunkStore.collect`). Other ranks' saves are
  covered as before by retention's grace period (``GC_GRACE_S``).
- A pass that raises is logged, never fatal: its chunks are only garbage, collected by a later pass or when
  the next writer opens the root (``cleanup_after_crash``). The thread is a daemon: a process that exits
  during a pass leaves garbage, never a broken checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("trainguard")


class BackgroundCollection:
    """One background chunk-collection pass at a time (thread-safe)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._runner: threading.Thread | None = None  # the thread running the pass in progress
        self._cancel = threading.Event()

    def start(self, collect: Callable[[], None]) -> None:
        """Run ``collect`` in a new daemon thread (``trainguard-gc``), after any pass still running ended."""
        thread = threading.Thread(target=self._run, args=(collect,), name="trainguard-gc", daemon=True)
        with self._cond:
            self._cond.wait_for(lambda: self._runner is None)
            self._runner = thread
            self._cancel.clear()
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (interpreter shutting down): collect here instead
            with self._cond:
                self._runner = threading.current_thread()
            self._run(collect)

    def _run(self, collect: Callable[[], None]) -> None:
        try:
            collect()
        except Exception:  # noqa: BLE001 - garbage stays garbage; a later pass or the next open collects it
            log.exception("deleting unreferenced chunks failed; a later save or the next open collects them")
        finally:
            with self._cond:
                self._runner = None
                self._cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether a pass is in progress."""
        with self._cond:
            return self._runner is not None

    def cancel(self) -> None:
        """Stop the pass in progress at its next chunk (what it has not deleted stays: garbage, collected by
        the next writer's open). For ``close`` when the pass makes no progress (a hung storage)."""
        self._cancel.set()

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called since the current pass began (the pass's ``stop`` check)."""
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no pass runs (at most ``timeout`` seconds; None: no limit). Returns False on a timeout.
        Called from the pass's own thread it returns at once."""
        with self._cond:
            if self._runner is threading.current_thread():
                return True
            return self._cond.wait_for(lambda: self._runner is None, timeout)
