"""Heartbeats from the job to the supervisor, and the job-side preemption flag.

The channel is one small local file whose path the supervisor passes in ``TRAINGUARD_HEARTBEAT_FILE`` (a new
file for every attempt, so a straggler of an earlier attempt can never look alive). The file is an array of
fixed-size slots of :data:`RECORD_SIZE_BYTES` bytes, one per local rank (``LOCAL_RANK``, else 0); each process
overwrites its own slot in place, so every rank of a ``torchrun`` job can beat into the same file without
locking and the file never grows. A slot holds one ASCII line::

    tg1 <step> <t> <pid> <first_step> <first_t> <crc32 of the text before it, 8 hex>

``t`` is the wall time (seconds since the epoch) of the beat, ``first_*`` the first beat of that process. A
reader that races a writer may see a torn slot; the CRC rejects it and the reader uses the other slots or
the previous reading. The supervisor takes the newest slot.

Cost: :func:`heartbeat` is one environment lookup (~0.3 us) when ``TRAINGUARD_HEARTBEAT_FILE`` is unset.
When set, the slot is memory-mapped (``MAP_SHARED``): a new step is a ~1 us memory store, recorded at once
and kept even if the process is SIGKILLed a microsecond later (so ``steps_lost`` is exact); repeated beats
of the same step refresh the time at most once per :data:`MIN_WRITE_INTERVAL_S`. Without mmap, writes are
``pwrite`` calls rate-limited to 10 per second, and a held-back beat is written by the next call after the
interval, at interpreter exit, or by :func:`exit_after_preemption_save`. I/O errors are swallowed: a
heartbeat never raises into the training loop.

Preemption: :func:`install_preemption_handler` turns SIGTERM into a flag (:func:`preemption_requested`) that
the ``CheckpointManager`` polls at each step boundary; after saving it calls
:func:`exit_after_preemption_save`, which exits with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "stopped
early, checkpoint saved, run me again").
"""

from __future__ import annotations

import atexit
import mmap
import os
import signal
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from ..errors import ConfigError

HEARTBEAT_FILE_ENV = "TRAINGUARD_HEARTBEAT_FILE"
PREEMPT_SIGNALS_ENV = "TRAINGUARD_PREEMPT_SIGNALS"
"""Comma-separated signal names (``USR1``) that ``trainguard run --preempt-signal`` passes to the job: the
preemption handler catches them as well as SIGTERM (a scheduler may signal every process of the job)."""
"""Environment variable holding the heartbeat file's path (set by the supervisor)."""

RECORD_SIZE_BYTES = 128
"""Size of one slot of the heartbeat file."""

MAX_SLOTS = 4096
"""Slots beyond this local rank wrap around (two processes sharing a slot only lose the older beat)."""

MIN_WRITE_INTERVAL_S = 0.1
"""Minimum time between two writes by one process, except a new step through the memory map (seconds)."""

EXIT_PREEMPTED = 75
"""Exit code of a job that stopped on a preemption request after saving a checkpoint (``EX_TEMPFAIL``).

The supervisor never restarts after a stop it forwarded itself; otherwise it restarts the job (failure cause
``"preempted"``), which resumes from the checkpoint just saved.
"""

_MAGIC = "tg1"


@dataclass(frozen=True)
class Heartbeat:
    """One slot of the heartbeat file.

    Attributes:
        step: the step of the latest recorded beat.
        t: wall time of that beat (seconds since the epoch).
        pid: the process that beat.
        first_step: the step of that process's first beat.
        first_t: wall time of that process's first beat (seconds since the epoch).
        slot: the slot index (local rank).
    """

    step: int
    t: float
    pid: int
    first_step: int
    first_t: float
    slot: int


def _encode(step: int, t: float, pid: int, first_step: int, first_t: float) -> bytes | None:
    body = f"{_MAGIC} {step} {t:.6f} {pid} {first_step} {first_t:.6f}"
    line = f"{body} {zlib.crc32(body.encode('ascii')):08x}"
    if len(line) >= RECORD_SIZE_BYTES:
        return None  # an absurd step number; skip the beat rather than corrupt the neighbouring slot
    return (line.ljust(RECORD_SIZE_BYTES - 1) + "\n").encode("ascii")


def _decode(raw: bytes, slot: int) -> Heartbeat | None:
    try:
        parts = raw.decode("ascii").split()
    except UnicodeDecodeError:
        return None
    if len(parts) != 7 or parts[0] != _MAGIC:
        return None
    body = " ".join(parts[:6])
    try:
        if int(parts[6], 16) != zlib.crc32(body.encode("ascii")):
            return None  # torn by a concurrent write
        return Heartbeat(
            step=int(parts[1]),
            t=float(parts[2]),
            pid=int(parts[3]),
            first_step=int(parts[4]),
            first_t=float(parts[5]),
            slot=slot,
        )
    except ValueError:
        return None


def _local_slot() -> int:
    raw = os.environ.get("LOCAL_RANK", "0")
    return int(raw) % MAX_SLOTS if raw.isdigit() else 0


class _Beater:
    """The per-process writer behind :func:`heartbeat`. Thread-safe; re-created in a forked child.

    The first write of a process ``pwrite``s its slot (which extends the file and never shrinks it, so ranks
    cannot truncate each other's slots), then maps the slot's page with ``MAP_SHARED``: later beats are
    memory stores into the page cache, visible to the supervisor at once and kept when the process is
    SIGKILLed. Without mmap (an exotic filesystem) every write is a ``pwrite``, rate-limited.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._path: str | None = None
        self._fd = -1
        self._map: mmap.mmap | None = None
        self._map_offset = 0
        self._slot = 0
        self._retry_open_after = 0.0  # monotonic seconds
        self._last_write = float("-inf")  # monotonic seconds
        self._written_step: int | None = None
        self._first: tuple[int, float] | None = None
        self._pending: tuple[int, float] | None = None

    def beat(self, path: str, step: int) -> None:
        now = time.monotonic()
        t = time.time()
        with self._lock:
            if path != self._path:
                self._switch(path)
            if self._first is None:
                self._first = (step, t)
            # A new step is recorded at once when that is a memory store; anything else at most 10 times a second.
            due = now - self._last_write >= MIN_WRITE_INTERVAL_S
            if not due and not (self._map is not None and step != self._written_step):
                self._pending = (step, t)
                return
            self._write(step, t, now)

    def flush(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._write(*self._pending, time.monotonic())

    def _switch(self, path: str) -> None:
        self._close()
        self._path = path
        self._slot = _local_slot()
        self._retry_open_after = 0.0
        self._last_write = float("-inf")
        self._written_step = None
        self._first = None
        self._pending = None

    def _close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except (OSError, ValueError, BufferError):
                pass
        self._map = None
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = -1

    def _write(self, step: int, t: float, now: float) -> None:
        self._pending = None
        self._last_write = now
        if self._path is None or self._first is None:
            return
        record = _encode(step, t, self._pid, self._first[0], self._first[1])
        if record is None:
            return
        if self._map is not None:
            try:
                self._map[self._map_offset : self._map_offset + RECORD_SIZE_BYTES] = record
                self._written_step = step
                return
            except (ValueError, IndexError, OSError):
                self._map = None  # fall back to pwrite below
        if self._fd < 0:
            if now < self._retry_open_after:
                return
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError:
                self._retry_open_after = now + 1.0  # a missing directory must not cost a syscall per step
                return
        offset = self._slot * RECORD_SIZE_BYTES
        try:
            os.pwrite(self._fd, record, offset)
        except OSError:
            self._close()
            self._retry_open_after = now + 1.0
            return
        self._written_step = step
        page = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            self._map = mmap.mmap(self._fd, offset - page + RECORD_SIZE_BYTES, mmap.MAP_SHARED, offset=page)
            self._map_offset = offset - page
        except (OSError, ValueError):
            self._map = None  # keep the rate-limited pwrite path


_beater = _Beater()


def _reset_after_fork() -> None:
    # A child (DataLoader worker, ...) must not inherit the parent's lock state, fd position or first beat.
    global _beater
    _beater = _Beater()


os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(lambda: _beater.flush())


def heartbeat(step: int) -> None:
    """Tell the supervisor that the job is alive and at ``step``.

    ``CheckpointManager.maybe_save`` calls this on every step; call it yourself in loops that do not use the
    manager (once per step is right). A no-op unless the job runs under ``trainguard run``.

    Args:
        step: the training step just completed (an int, or anything ``int()`` accepts).
    """
    path = os.environ.get(HEARTBEAT_FILE_ENV)
    if not path:
        return
    _beater.beat(path, int(step))


def flush_heartbeat() -> None:
    """Write a beat held back by the rate limit now (done automatically at interpreter exit)."""
    _beater.flush()


def read_heartbeats(path: str | os.PathLike[str]) -> list[Heartbeat]:
    """Return every valid slot of a heartbeat file (empty when the file is missing or unreadable).

    Args:
        path: the heartbeat file.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    beats = []
    for slot in range(min(len(data) // RECORD_SIZE_BYTES, MAX_SLOTS)):
        raw = data[slot * RECORD_SIZE_BYTES : (slot + 1) * RECORD_SIZE_BYTES]
        if raw.strip(b"\0 \n"):
            hb = _decode(raw, slot)
            if hb is not None:
                beats.append(hb)
    return beats


def read_heartbeat(path: str | os.PathLike[str]) -> tuple[int, float] | None:
    """Return ``(step, t)`` of the newest beat in a heartbeat file, or None when there is none yet.

    Args:
        path: the heartbeat file.

    Returns:
        The step and wall time (seconds since the epoch) of the most recent beat of any rank.
    """
    beats = read_heartbeats(path)
    if not beats:
        return None
    newest = max(beats, key=lambda b: b.t)
    return newest.step, newest.t


# --- preemption ---------------------------------------------------------------------------------------------

_preempted = False
_previous_handlers: dict[int, Any] = {}


def _on_preemption_signal(signum: int, frame: object) -> None:
    # Only set a flag: the save happens at the next step boundary, outside the signal handler. A second
    # SIGTERM (torchrun forwards one, the supervisor signals the whole group) is deliberately not fatal.
    # A plain global, no lock: Python runs a second signal's handler inside the first one, between its
    # bytecodes, so a handler that takes a lock (threading.Event.set) deadlocked on itself when two signals
    # came together (Slurm's USR1 and the agent's SIGTERM: the job hung until SIGKILL).
    global _preempted
    _preempted = True


def install_preemption_handler(signals: tuple[int, ...] | None = None) -> None:
    """Make SIGTERM (and ``$TRAINGUARD_PREEMPT_SIGNALS``) set the preemption flag instead of killing the process.

    Idempotent. Call from the main thread (Python runs signal handlers there), before the training loop.

    Args:
        signals: the signals to catch (default SIGTERM and the signals named in
            ``$TRAINGUARD_PREEMPT_SIGNALS``; SIGINT keeps raising KeyboardInterrupt).

    Raises:
        ConfigError: when called outside the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(
            "install_preemption_handler() must run in the main thread (Python delivers signals there); "
            "create the CheckpointManager with save_on_preemption=True in the main thread"
        )
    if signals is None:
        signals = (signal.SIGTERM, *preempt_signals_from_env())
    for sig in signals:
        previous = signal.signal(sig, _on_preemption_signal)
        if previous is not _on_preemption_signal:
            _previous_handlers[int(sig)] = previous


def parse_signal(name: str | int) -> signal.Signals:
    """``"USR1"``, ``"SIGUSR1"``, ``"10"`` or ``10`` -> ``signal.SIGUSR1``.

    Raises:
        ConfigError: not a signal of this platform.
    """
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ConfigError(f"{name!r} is not a signal name or number (e.g. USR1, SIGUSR2, 10)") from None


def preempt_signals_from_env() -> tuple[signal.Signals, ...]:
    """The signals named in ``$TRAINGUARD_PREEMPT_SIGNALS`` (empty when unset)."""
    names = [n for n in os.environ.get(PREEMPT_SIGNALS_ENV, "").split(",") if n.strip()]
    return tuple(parse_signal(n) for n in names)


def uninstall_preemption_handler() -> None:
    """Restore the handlers replaced by :func:`install_preemption_handler` and clear the flag."""
    for sig, previous in list(_previous_handlers.items()):
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        del _previous_handlers[sig]
    global _preempted
    _preempted = False


def preemption_requested() -> bool:
    """Return True once a preemption signal arrived (cheap: safe to call every step, from any thread)."""
    return _preempted


def exit_after_preemption_save() -> NoReturn:
    """Exit the job after the preemption checkpoint is committed, with :data:`EXIT_PREEMPTED`.

    Flushes the pending heartbeat first so the supervisor sees the final step. Raises ``SystemExit``, so
    ``finally`` blocks and ``atexit`` handlers still run.
    """
    flush_heartbeat()
    raise SystemExit(EXIT_PREEMPTED)
