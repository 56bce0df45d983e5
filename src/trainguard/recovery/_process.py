"""The supervisor's handle on one attempt's process group: spawn bookkeeping, signals, exit descriptions."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path


class Job:
    """A running attempt; a waiter thread reaps it the instant it exits (no polling latency)."""

    def __init__(
        self, proc: subprocess.Popen[bytes], attempt: int, heartbeat_file: Path, t_spawn: float
    ) -> None:
        self.proc = proc
        self.pgid = proc.pid  # start_new_session=True: the child leads its own group
        self.attempt = attempt
        self.heartbeat_file = heartbeat_file
        self.t_spawn = t_spawn
        self.done = threading.Event()
        self.returncode: int | None = None
        self.t_exit: float | None = None
        self.forwarded = False
        threading.Thread(target=self._wait, name=f"trainguard-wait-{proc.pid}", daemon=True).start()

    def _wait(self) -> None:
        rc = self.proc.wait()
        self.t_exit = time.time()
        self.returncode = rc
        self.done.set()


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def group_alive(pgid: int) -> bool:
    # Caveat: a member left as a zombie under a non-reaping PID 1 counts as alive; callers bound their wait.
    return signal_group(pgid, 0)


def spawn_problem(program: str, e: OSError) -> str:
    """Why ``program`` did not start, in words a user acts on."""
    if isinstance(e, FileNotFoundError):
        where = "no such file" if os.sep in program else "not found on PATH"
        return f"command not found: {program!r} ({where}); check the spelling and the path"
    if isinstance(e, PermissionError):
        return (
            f"{program!r} is not executable (permission denied); `chmod +x` it or run it with its interpreter"
        )
    return f"{program!r} could not be started: {e}"


def signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


ATTEMPT_ID_ENV = "TRAINGUARD_ATTEMPT_ID"
# Jobs started by every Supervisor of this process and not yet reaped by their own waiter thread: another
# supervisor in the same process (threads, an embedding program) never reaps or stops them as its leftovers.
_LIVE_JOBS: dict[int, Job] = {}
_LIVE_JOBS_LOCK = threading.Lock()


def register_live_job(job: Job) -> None:
    """Record a job this process started until its waiter thread reaps it (see :func:`other_live_jobs`)."""
    with _LIVE_JOBS_LOCK:
        _LIVE_JOBS[job.proc.pid] = job


def other_live_jobs(own: int) -> set[int]:
    """Pids of the jobs every supervisor of this process started and that are still running, but ``own``."""
    with _LIVE_JOBS_LOCK:
        for pid in [p for p, j in _LIVE_JOBS.items() if j.done.is_set()]:
            del _LIVE_JOBS[pid]
        return set(_LIVE_JOBS) - {own}


def carries_attempt(pid: int, token: str) -> bool:
    """Whether process ``pid`` has ``TRAINGUARD_ATTEMPT_ID=token`` in its environment (inherited from the
    attempt that started it); False when that cannot be read (a zombie, another user's process)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(1 << 20)
    except OSError:
        return False
    return f"{ATTEMPT_ID_ENV}={token}".encode() in env.split(b"\0")
