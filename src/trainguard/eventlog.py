"""The run's event log: JSON lines under ``<run root>/events/``.

Every process that writes events (the manager in each rank, the supervisor) appends to its own file
``events/<source>-<pid>-<nonce>.jsonl``, so writers never interleave partial lines. Readers merge all files and
sort by ``t``. Each line is one JSON object with at least:

- ``t`` (float, seconds since the epoch), ``time`` (ISO 8601 UTC), ``event`` (str), ``source`` (str),
  ``pid`` (int), and where known ``rank``, ``run_id``, ``restart_count`` and ``elastic_restart`` (torchrun's
  ``TORCHELASTIC_RESTART_COUNT``).

Event names and their fields are listed in docs/FORMAT.md ("Event log"). A torn last line (the writer was
killed mid-write) is skipped by the reader, never an error.

Writing an event never fails the caller: a line the filesystem refuses (a full disk, an I/O error) is dropped
with one warning per log (and counted in :attr:`EventLog.dropped`), so a full disk never stops training or
the manager's constructor (``keep=1`` can still free space).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._time import iso
from .errors import FULL_ERRNOS
from .storage.safeio import MAX_EVENT_FILE_BYTES, ensure_dir, open_regular, read_bounded

log = logging.getLogger("trainguard")

EVENTS_DIR = "events"

OWN_EVENTS = frozenset(
    {
        "manager_start",
        "resume",
        "save",
        "save_failed",
        "save_skipped",
        "replace_corrupt",
        "restore",
        "restore_skipped",
        "restore_failed",
        "first_step",
        "progress",
        "retention_delete",
        "retention_deferred",
        "save_abandoned",
        "failed_save_chunks_freed",
        "leftovers_stopped",
        "cleanup",
        "preemption",
        "preempted",
        "adaptive_interval",
        "supervisor_start",
        "job_start",
        "prefetch",
        "failure",
        "restart",
        "recovery",
        "success",
        "give_up",
        "stop",
        "spawn_error",
        "save_rejected",
        "save_nonfinite",
        "checkpoint_suspect",
        "resume_diverged",
        "resume_confirmed",
        "resume_not_reproduced",
        "root_mismatch",
        "scrub",
        "tier_upload",
        "tier_restore",
        "tier_repair_failed",
        "tier_upload_failed",
        "tier_upload_incomplete",
        "tier_repair",
        "tier_unreachable",
        "tier_retention_delete",
    }
)
"""Event names trainguard itself writes (docs/FORMAT.md); ``CheckpointManager.log_event`` refuses them."""


def check_user_event(event: Any) -> None:
    """Check the name of a user's own event (``CheckpointManager.log_event``).

    Raises:
        ConfigError: an empty name or one of trainguard's own event names (:data:`OWN_EVENTS`).
    """
    from .errors import ConfigError

    if not isinstance(event, str) or not event.strip():
        raise ConfigError(f"event must be a non-empty string, got {event!r}")
    if event in OWN_EVENTS:
        raise ConfigError(
            f"{event!r} is an event trainguard writes itself; give your event another name "
            "(e.g. 'fault_injected' or 'user_note')"
        )


class EventLog:
    """Append-only writer of one process's events.

    Args:
        root: the run root (a local directory). The ``events/`` folder is created if missing.
        source: who writes (``"manager"``, ``"supervisor"``, ...); part of the file name.
        fsync: flush every line to disk with fsync (default False: a line is flushed to the OS at once,
            which survives a process crash; fsync also survives a machine crash at ~1 ms per event).

    Raises:
        UnsafeFileError: ``events`` under the root is a symlink or not a directory.
        OSError: the log cannot be created (read-only filesystem, permissions). A full disk is not an error:
            the file is created at the first write that finds room (events before it are dropped).

    Attributes:
        dropped: events the filesystem refused so far (not written; warned about once).

    Thread-safe: a lock serializes appends.
    """

    def __init__(self, root: str | os.PathLike[str], source: str, *, fsync: bool = False) -> None:
        self.dir = Path(root) / EVENTS_DIR
        name = f"{source}-{os.getpid()}-{secrets.token_hex(3)}.jsonl"
        self.path = self.dir / name
        self.source = source
        self._fsync = fsync
        self._lock = threading.Lock()
        self._closed = False
        self._fd: int | None = None
        self.dropped = 0
        self._warned = False
        try:
            self._open()
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                raise
            self._refused(e)
        self._context: dict[str, Any] = {}
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        """Called with each record written (e.g. to update metrics); a failing listener is ignored."""
        run_id = os.environ.get("TRAINGUARD_RUN_ID")
        if run_id:
            self._context["run_id"] = run_id
        rc = os.environ.get("TRAINGUARD_RESTART_COUNT")
        if rc is not None and rc.isdigit():
            self._context["restart_count"] = int(rc)
        # torchrun's agent restarts its workers by itself (--max-restarts): the supervisor sees no failure, so
        # these restarts are told apart by the agent's count in the workers' environment
        erc = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if erc is not None and erc.isdigit():
            self._context["elastic_restart"] = int(erc)

    def set_context(self, **fields: Any) -> None:
        """Add fields (e.g. ``rank``) written into every later event."""
        self._context.update(fields)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return the record written.

        Args:
            event: the event name (``"save"``, ``"failure"``, ...).
            **fields: JSON-serializable fields of the event.
        """
        t = time.time()
        record: dict[str, Any] = {
            "t": t,
            "time": iso(t),
            "event": event,
            "source": self.source,
            "pid": os.getpid(),
        }
        record.update(self._context)
        record.update(fields)
        line = (json.dumps(record, default=str, allow_nan=True) + "\n").encode()
        with self._lock:
            if self._closed:
                return record
            try:
                if self._fd is None:
                    self._open()
                assert self._fd is not None
                view = memoryview(line)
                while view:  # one line per write(2) (O_APPEND): a torn line only where the disk filled up
                    view = view[os.write(self._fd, view) :]
                if self._fsync:
                    os.fsync(self._fd)
            except OSError as e:  # the log is observability: it never fails the caller
                self._refused(e)
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001, S110 - observers must never break the log or training
                pass
        return record

    def close(self) -> None:
        """Close the file (never raises: every line was handed to the OS when it was written)."""
        with self._lock:
            self._closed = True
            fd, self._fd = self._fd, None
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _open(self) -> None:
        ensure_dir(self.dir, what="event log directory")
        self._fd = open_regular(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, what="event log"
        )

    def _refused(self, e: OSError) -> None:
        """Count a dropped event; warn at the first one."""
        self.dropped += 1
        if not self._warned:
            self._warned = True
            full = " (the disk is full)" if e.errno in FULL_ERRNOS else ""
            log.warning(
                "cannot write the event log %s%s: %s; events are dropped until it can be written "
                "again (training and saves go on)",
                self.path,
                full,
                e.strerror or e,
            )


def is_regular_file(path: Path) -> bool:
    """True when ``path`` is (or links to) a regular file; False for FIFOs, devices, directories, errors."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def iter_events(root: str | os.PathLike[str], *, event: str | None = None) -> Iterator[dict[str, Any]]:
    """Yield every event recorded under ``root`` in time order.

    Files are opened without following symlinks or blocking; a file that is not a regular file or is larger
    than ``MAX_EVENT_FILE_BYTES`` is skipped, as are lines that are not JSON objects with a numeric ``t``.

    Args:
        root: the run root.
        event: only events with this name.
    """
    records: list[dict[str, Any]] = []
    d = Path(root) / EVENTS_DIR
    if not d.is_dir():
        return iter(())
    for f in sorted(d.glob("*.jsonl")):
        try:  # a symlink, a named pipe, /dev/zero or an oversized file is skipped, never followed or read whole
            text = read_bounded(f, MAX_EVENT_FILE_BYTES, what="event log").decode("utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue  # torn line from a killed writer
            if (
                isinstance(rec, dict)
                and event_time(rec) is not None
                and (event is None or rec.get("event") == event)
            ):
                records.append(rec)
    records.sort(key=lambda r: event_time(r) or 0.0)
    return iter(records)


def event_time(rec: dict[str, Any]) -> float | None:
    """The record's ``t`` (seconds since the epoch) when it is a finite number, else None (such a record is
    not an event: readers skip it)."""
    t = rec.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return None
    try:
        t = float(t)
    except OverflowError:
        return None
    return t if math.isfinite(t) else None


def read_events(root: str | os.PathLike[str], *, event: str | None = None) -> list[dict[str, Any]]:
    """Return :func:`iter_events` as a list."""
    return list(iter_events(root, event=event))
