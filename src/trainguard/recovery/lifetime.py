"""Keeping a supervised job's processes tied to the supervisor's life (Linux).

- **Signals**: every catchable signal whose default action terminates the supervisor
  (:data:`TERMINATING_SIGNALS`: SIGHUP from a closing ssh session, SIGUSR1/SIGUSR2 from a batch scheduler,
  SIGQUIT, SIGALRM, ...) is handled like SIGTERM: forwarded to the job, which is stopped and not restarted.
  Left at their default, they killed the supervisor and left the job training unsupervised.
- **The supervisor dies first** (SIGKILL, a crash): the job's first process gets ``PR_SET_PDEATHSIG`` =
  SIGKILL, so the kernel kills it when the supervisor dies.
- **Descendants in other sessions**: the supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``) while it
  runs, so a process the job started in a new session (out of reach of the job's process group) is
  re-parented to the supervisor when its parent exits instead of to init; after each attempt the supervisor
  stops every remaining descendant of the job and every process re-parented to it since the attempt began
  (SIGTERM, then SIGKILL after the grace period) and reaps them.

Elsewhere (no ``prctl``) these are no-ops except the signal list. A descendant that starts its own new
session while the supervisor is SIGKILLed is out of reach (nothing is left to stop it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable

TERMINATING_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name)
    for name in (
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGTERM",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGVTALRM",
        "SIGPROF",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGIO",
        "SIGPWR",
        "SIGSTKFLT",
    )
    if hasattr(signal, name)
)
"""Catchable signals whose default action ends a process (SIGPIPE excepted: Python ignores it)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover - no loadable C library
        return None
    fn = getattr(libc, "prctl", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
    return fn


_PRCTL = _load_prctl()


def set_child_subreaper(on: bool) -> bool:
    """Make this process adopt orphaned descendants (True) or stop doing so; returns whether it worked."""
    return _PRCTL is not None and _PRCTL(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when ``parent_pid`` dies (and exits
    at once if it already has). Only calls into an already-loaded C function between fork and exec."""
    prctl = _PRCTL

    def setup() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the prctl took effect
            os._exit(128 + sig)

    return setup


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        if len(fields) > 1:
            out[int(name)] = int(fields[1])
    return out


def children(pid: int) -> set[int]:
    """The direct children of ``pid``."""
    return {p for p, pp in _parents().items() if pp == pid}


def descendants(roots: Iterable[int]) -> set[int]:
    """Every process below ``roots`` (not the roots themselves)."""
    parents = _parents()
    kids: dict[int, list[int]] = {}
    for p, pp in parents.items():
        kids.setdefault(pp, []).append(p)
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _reap(pids: Iterable[int]) -> None:
    for p in pids:
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass  # not our child (or already reaped)


def reap_adopted(exclude: set[int]) -> None:
    """Reap this process's exited children except ``exclude`` (children it started itself and waits for
    elsewhere): as a subreaper it adopts a job's orphans, and nobody else reaps them."""
    _reap(children(os.getpid()) - exclude)


def stop_processes(pids: set[int], grace_s: float, *, reap: set[int] | None = None) -> set[int]:
    """SIGTERM ``pids``, SIGKILL those still there after ``grace_s`` seconds, and reap those of ``reap`` (our
    own children). Returns the pids that had to be SIGKILLed."""
    alive = set()
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
            alive.add(p)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        _reap(alive & (reap or set()))
        alive = {p for p in alive if _running(p)}
        if alive:
            time.sleep(0.02)
    for p in alive:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        _reap(pids & (reap or set()))
        if not any(_running(p) for p in pids):
            break
        time.sleep(0.02)
    return alive


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    state = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
    return state not in (b"Z", b"X")
