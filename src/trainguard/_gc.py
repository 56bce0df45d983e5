"""Pausing Python's automatic garbage collection while trainguard builds many objects at once.

Parsing a manifest, and the plans and records of a save or restore, allocate container objects by the hundred
thousand; each allocation burst triggers collections, and every collection of the oldest generation traverses
every object of the process (the training job's modules and tensors included) while holding the GIL.
Measured on this project's 2-core VM with Python 3.11 (benchmarks/RESULTS.md, "All issue-15 targets", the run
of 2026-12-03 13:23, item 1), 32,000 tensors: a synchronous save 5.2-5.5 s, of which 2.6-3.1 s in
collections, 1.6 s paused; opening a writer 1.6-1.8 s, paused 0.5 s; ``restore_latest`` 2.7 s, paused 1.3 s.

How it pauses, and what it guarantees:

- Automatic collection stops by setting the first threshold to 0 (``gc.set_threshold``); the job's own
  ``gc.disable()``/``gc.enable()`` are left alone, before, during and after a pause (a job that manages the
  collector by hand, e.g. Megatron's ``--manual-gc``, keeps doing so).
- Pauses nest and overlap across threads: collection resumes when the last one ends, with the thresholds found
  when the first one began (unless the job set others meanwhile).
- When the last pause ends, the young generation is collected once (``gc.collect(0)``, when the collector is
  enabled): every object allocated during the pause is in it, so reference cycles made meanwhile (by the
  training loop too) are freed even when pauses follow each other back to back; this walks only those young
  objects, not the whole heap.
- A pause longer than its ``limit_s`` lets collection resume before it ends (a save stuck in storage retries
  must not leave the job's garbage uncollected); if the timer thread cannot start, the pause has no limit.
- A process forked during a pause (a DataLoader worker) starts with collection as it was before the pause.
- ``gc.get_threshold()`` reads 0 during a pause: a job that saves the thresholds and sets them back around its
  own code while a trainguard save persists should set its own values instead of the ones it read.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

DEFAULT_LIMIT_S = 60.0
"""Longest time automatic collection stays off for one run of pauses that has a limit (seconds)."""

_lock = threading.Lock()
_depth = 0  # pauses in progress, all threads
_saved: tuple[int, ...] | None = None  # the thresholds when the outermost pause began; None: none in effect
_timer: threading.Timer | None = None  # the limit of the current run of pauses, if any
# forks this process descends from: a pause entered before a fork is not exited in the child
_forks = 0


@contextlib.contextmanager
def paused_gc(limit_s: float | None = DEFAULT_LIMIT_S) -> Iterator[None]:
    """Pause automatic garbage collection for the body (reference counting still frees everything outside
    cycles at once); see the module docstring for the guarantees.

    Args:
        limit_s: seconds after which automatic collection resumes even if the body still runs; None: no limit
            (for bounded CPU work such as parsing one manifest). Only the outermost pause's timer runs.
    """
    _enter(limit_s)
    forks = _forks
    try:
        yield
    finally:
        if forks == _forks:  # in a child forked meanwhile the pause ended with the fork
            _exit()


def _enter(limit_s: float | None) -> None:
    global _depth, _saved, _timer
    with _lock:
        current = gc.get_threshold()
        if _depth == 0 and current[0] != 0:
            _saved = current
            gc.set_threshold(0, *current[1:])
        # threshold 0 at depth 0: the job's own setting (nothing saved, nothing to give back), or left by a pause
        # interrupted while ending (its _saved is kept and given back when this one ends)
        _depth += 1
        if limit_s is None or _timer is not None or _saved is None:
            return
        timer = threading.Timer(limit_s, _resume)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no thread can start (pids.max, ulimit -u): the pause runs without a limit
            return
        except BaseException:  # KeyboardInterrupt while the thread starts: no pause is left behind
            _depth -= 1
            if _depth == 0:
                _restore_thresholds()
            raise
        _timer = timer


def _exit() -> None:
    global _depth, _timer
    timer = None
    collect = False
    with _lock:
        _depth -= 1
        if _depth == 0:
            collect = _restore_thresholds()  # first: nothing below can leave collection off
            timer, _timer = _timer, None
    if timer is not None:
        timer.cancel()
    if collect and gc.isenabled():
        gc.collect(0)  # the cycles made during the pause: only young objects are walked


def _restore_thresholds() -> bool:
    """Put back the thresholds saved by the outermost pause (not when the job set others meanwhile); True if
    a pause was in effect. Called with the lock held."""
    global _saved
    saved = _saved
    if saved is None:
        return False
    if gc.get_threshold()[0] == 0:
        gc.set_threshold(*saved)
    _saved = None  # after the thresholds are back: a fork in between still finds them saved
    return True


def _resume() -> None:
    """The run of pauses passed its limit: automatic collection resumes now (the pauses still in progress stay
    counted and end without touching the thresholds again). A timer of an earlier run does nothing."""
    global _timer
    with _lock:
        if _timer is not threading.current_thread():  # this timer's run ended; another may be in progress
            return
        _timer = None
        _restore_thresholds()


def _after_fork_in_child() -> None:
    """A child forked during a pause gets the collection the job had before it: its pauses end with the fork
    (only the forking thread survives, and :func:`paused_gc` does not exit a pause entered before the fork)."""
    global _lock, _depth, _timer, _forks
    _lock = threading.Lock()
    _forks += 1
    _depth = 0
    _timer = None
    _restore_thresholds()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
