"""Pausing Python's cyclic garbage collector while trainguard builds many objects at once.

Parsing a manifest, and the plans and records of a restore, allocate container objects by the hundred
thousand; each allocation burst triggers collections, and every third-generation one traverses every object
of the process (the training job's modules and tensors included). Measured on this project's 2-core VM with
Python 3.11 (benchmarks/RESULTS.md, "All issue-15 targets", the run of 2026-12-03 13:23, item 1), 32,000
tensors: a synchronous save 5.2-5.5 s, of which 2.6-3.1 s in collections, 1.6 s paused; opening a writer
1.6-1.8 s, paused 0.5 s; ``restore_latest`` 2.7 s, paused 1.3 s.

The pause is process-wide (``gc.disable``), so it only wraps work that the caller waits for and that creates
no reference cycles worth collecting meanwhile; nested and concurrent pauses (several threads) keep the
collector off until the last one ends, then restore the state found at the first one (a job that runs with
the collector off keeps it off).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # pauses in progress, all threads
_was_enabled = False  # gc.isenabled() when the outermost pause began


@contextlib.contextmanager
def paused_gc(limit_s: float | None = None) -> Iterator[None]:
    """Keep the cyclic garbage collector off for the body (reference counting still frees everything
    without cycles at once); the collector's previous state is restored when the last concurrent pause
    ends. Objects in cycles made meanwhile are collected by the next collection after that.

    Args:
        limit_s: seconds after which the collector is turned back on even if the body still runs (a
            background save stuck in storage retries must not keep the training job's garbage uncollected);
            None: no limit.
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    timer = None
    if limit_s is not None:
        timer = threading.Timer(limit_s, _resume)
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def _resume() -> None:
    """A pause ran past its limit: the collector runs again (the pauses still in progress stay counted)."""
    with _lock:
        if _depth > 0 and _was_enabled:
            gc.enable()
