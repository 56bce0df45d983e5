"""``FaultyStorage``: any :class:`~trainguard.storage.base.Storage` with injected faults, for fault tests.

Wrap the run root's storage and hand it to trainguard where a root is expected::

    from trainguard.storage import Fault, FaultyStorage, LocalStorage

    disk = FaultyStorage(LocalStorage(root), Fault("write", match="chunks/*", nth=2, errno=errno.ENOSPC))
    with tg.CheckpointManager(disk) as mgr:
        mgr.save(3, state)          # raises StorageFullError at the second chunk write

Faults (:class:`Fault`): fail the Nth matching call with an errno (classified as the backend would:
ENOSPC/EDQUOT raise StorageFullError, a transient errno such as ETIMEDOUT raises TransientStorageError), a disk
that holds N more bytes and then is full (``budget_bytes``), write a truncated object (a torn write the backend
did not report), stall a call until an event is set or for some seconds, flip a bit of what a read returns, or
call a function (a probe of the store at that moment). Every call is counted per operation
(:attr:`FaultyStorage.calls`), every injection is recorded (:attr:`FaultyStorage.injected`), so a test can
assert that its fault fired.

A transient fault that succeeds on retry: ``Fault("read", match="chunks/*", errno=errno.ETIMEDOUT)`` fails the
first matching read only (``times=1``); the reader's retry then succeeds. ``times=None`` makes it persist.
"""

from __future__ import annotations

import errno as errno_codes
import fnmatch
import io
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .base import Entry, ObjectInfo, Staged, Storage
from .local import nbytes_of, raise_classified

OPS = ("write", "flush", "read", "stat", "list", "delete", "move")
"""Operations a fault can target: ``write`` (write_new, stage, publish), ``flush`` (commit_staged, barrier),
``read`` (read, open_read, read_range), ``stat`` (stat, exists), ``list``, ``delete`` (delete,
delete_prefix), ``move``."""


@dataclass
class Fault:
    """One injected fault.

    Args:
        op: the operation it targets (one of :data:`OPS`).
        match: ``fnmatch`` pattern on the key (``"chunks/*"``, ``"*/manifest.json"``; ``*`` matches ``/``).
        nth: the first matching call it affects (1-based).
        times: how many matching calls from the ``nth`` on it affects (None: every one).
        errno: raise ``OSError(errno)`` (ENOSPC/EDQUOT become StorageFullError as a real disk's would).
        exc: raise this exception instead (e.g. a ``RuntimeError`` standing for a bug in a backend).
        truncate_to: ``write`` only: store just the first ``truncate_to`` bytes and report success.
        stall: block the call first: a ``threading.Event`` to wait for, or seconds to sleep.
        flip_byte: ``read`` only: XOR the byte at this offset of the object with ``0x01`` in what is returned.
        budget_bytes: ``write`` only: the store holds this many more bytes of matching writes (every one from
            the ``nth`` on counts, ``times`` is ignored); a write that does not fit stores nothing and raises
            ``errno`` (default ENOSPC, hence StorageFullError). Change it (``math.inf``) to free space.
        call: a function called with the key first (e.g. to look at the store when the Nth write starts).
        staging: ``write`` only: an ``fnmatch`` pattern on the staging prefix of :meth:`Storage.stage` (a
            save's partial directory, ``"step-000000001.partial-*"``): the fault affects only the objects that
            save stages (never ``write_new`` or ``publish``).

    Attributes:
        seen: matching calls so far.
        written: ``budget_bytes`` faults: bytes the matching writes stored so far.
        fired: calls it affected so far (0: it never fired, e.g. fewer than ``nth`` calls matched).

    Raises:
        ValueError: an unknown ``op``, or ``truncate_to``/``flip_byte``/``budget_bytes`` on the wrong operation.
    """

    op: str
    match: str = "*"
    nth: int = 1
    times: int | None = 1
    errno: int | None = None
    exc: BaseException | None = None
    truncate_to: int | None = None
    stall: threading.Event | float | None = None
    flip_byte: int | None = None
    budget_bytes: float | None = None
    call: Callable[[str], None] | None = None
    staging: str | None = None
    enabled: bool = True
    seen: int = field(default=0, init=False)
    written: int = field(default=0, init=False)
    fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"Fault op must be one of {OPS}, got {self.op!r}")
        if self.truncate_to is not None and self.op != "write":
            raise ValueError("truncate_to applies to op='write' only")
        if self.flip_byte is not None and self.op != "read":
            raise ValueError("flip_byte applies to op='read' only")
        if (self.budget_bytes is not None or self.staging is not None) and self.op != "write":
            raise ValueError("budget_bytes and staging apply to op='write' only")

    def hits(self, key: str, size: int = 0, staging: str | None = None) -> bool:
        """Count a call for ``key`` (writing ``size`` bytes, staged under ``staging``); True when this call is
        one the fault affects. Not thread-safe on its own: :class:`FaultyStorage` calls it under its lock."""
        if not self.enabled or not fnmatch.fnmatchcase(key, self.match):
            return False
        if self.staging is not None and (staging is None or not fnmatch.fnmatchcase(staging, self.staging)):
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        if self.budget_bytes is not None:
            if self.written + size <= self.budget_bytes:
                self.written += size  # reserved: parallel writers share the room
                return False
            return True
        return self.times is None or self.seen < self.nth + self.times


class FaultyStorage:
    """A :class:`~trainguard.storage.base.Storage` that forwards to ``inner`` and injects :class:`Fault`\\ s.

    Args:
        inner: the real storage (e.g. ``LocalStorage(root)``).
        *faults: the faults, checked in order; the first that hits a call applies.

    Attributes:
        calls: calls per operation and key pattern ``op`` (a Counter).
        injected: ``(op, key, what)`` of every fault that fired, in order.

    Thread-safe (chunk writers call it in parallel).
    """

    def __init__(self, inner: Storage, *faults: Fault) -> None:
        self.inner = inner
        self.faults: list[Fault] = list(faults)
        self.calls: Counter[str] = Counter()
        self.injected: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r}, {len(self.faults)} fault(s))"

    def __getattr__(self, name: str) -> Any:  # backend extras (LocalStorage.path, .fsync, ...)
        return getattr(self.inner, name)

    def add(self, fault: Fault) -> Fault:
        """Add a fault (checked after the existing ones) and return it."""
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every fault (the storage heals)."""
        with self._lock:
            self.faults.clear()

    def _fault(self, op: str, key: str, size: int, staging: str | None) -> Fault | None:
        with self._lock:
            self.calls[op] += 1
            for f in self.faults:
                if f.op == op and f.hits(key, size, staging):
                    f.fired += 1
                    return f
        return None

    def unfired(self) -> list[Fault]:
        """The faults that never affected a call: a test or an example that expected a failure can check
        ``disk.unfired() == []`` (a fault whose ``match`` or ``nth`` no call reached injects nothing)."""
        with self._lock:
            return [f for f in self.faults if f.fired == 0]

    def _apply(self, op: str, key: str, data: Any = None, staging: str | None = None) -> Fault | None:
        """Call, stall and raise as the fault of this call says; return it (for truncation and bit flips)."""
        f = self._fault(op, key, nbytes_of(data) if data is not None else 0, staging)
        if f is None:
            return None
        if f.call is not None:
            self._record(op, key, "called")
            f.call(key)
        if f.budget_bytes is not None:
            code = f.errno or errno_codes.ENOSPC
            self._record(op, key, f"full (errno {code})")
            where = self.inner.location(key)
            raise_classified(OSError(code, os.strerror(code), where), where)
        if f.stall is not None:
            self._record(op, key, "stall")
            if isinstance(f.stall, threading.Event):
                f.stall.wait()
            else:
                time.sleep(f.stall)
        if f.exc is not None:
            self._record(op, key, f"raised {type(f.exc).__name__}")
            raise f.exc
        if f.errno is not None:
            self._record(op, key, f"errno {f.errno}")
            where = self.inner.location(key)
            raise_classified(OSError(f.errno, os.strerror(f.errno), where), where)
        return f

    def _record(self, op: str, key: str, what: str) -> None:
        with self._lock:
            self.injected.append((op, key, what))

    def _truncated(self, op: str, key: str, f: Fault | None, data: Any) -> Any:
        if f is None or f.truncate_to is None:
            return data
        self._record(op, key, f"truncated to {f.truncate_to}")
        parts = data if isinstance(data, list) else [data]
        whole = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        return whole[: f.truncate_to]

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def local_path(self) -> Path | None:
        return self.inner.local_path

    def location(self, key: str) -> str:
        return self.inner.location(key)

    # -- writing ------------------------------------------------------------------------------------------
    def write_new(self, key: str, data: Any, *, durable: bool = True) -> None:
        f = self._apply("write", key, data)
        self.inner.write_new(key, self._truncated("write", key, f, data), durable=durable)

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        f = self._apply("write", key, data)
        self.inner.publish(key, self._truncated("write", key, f, data), durable=durable)

    def stage(self, key: str, data: Any, *, staging: str) -> Staged:
        f = self._apply("write", key, data, staging)
        return self.inner.stage(key, self._truncated("write", key, f, data), staging=staging)

    def commit_staged(self, staged: list[Staged]) -> None:
        self._apply("flush", staged[0].key if staged else "")
        self.inner.commit_staged(staged)

    def discard_staged(self, staged: list[Staged]) -> None:
        self.inner.discard_staged(staged)

    def staging_prefix(self, partial: str, target_prefix: str) -> str:
        return self.inner.staging_prefix(partial, target_prefix)

    def make_dir(self, prefix: str) -> bool:
        return self.inner.make_dir(prefix)

    def barrier(self, prefix: str = "") -> None:
        self._apply("flush", prefix)
        self.inner.barrier(prefix)

    def touch(self, key: str) -> None:
        self.inner.touch(key)

    def move(self, src: str, dst: str) -> bool:
        self._apply("move", src)
        return self.inner.move(src, dst)

    # -- reading ------------------------------------------------------------------------------------------
    def _flipped(self, key: str, f: Fault | None, data: bytes, offset: int = 0) -> bytes:
        if f is None or f.flip_byte is None or not offset <= f.flip_byte < offset + len(data):
            return data
        self._record("read", key, f"flipped byte {f.flip_byte}")
        out = bytearray(data)
        out[f.flip_byte - offset] ^= 0x01
        return bytes(out)

    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        f = self._apply("read", key)
        return self._flipped(key, f, self.inner.read(key, limit_bytes=limit_bytes, what=what))

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        f = self._apply("read", key)
        fh, info = self.inner.open_read(key, what=what)
        if f is None or f.flip_byte is None:
            return fh, info
        with fh:
            data = fh.read()
        return io.BytesIO(self._flipped(key, f, data)), info

    def read_range(self, key: str, offset: int, out: memoryview) -> int:
        f = self._apply("read", key)
        n = self.inner.read_range(key, offset, out)
        if f is not None and f.flip_byte is not None:
            out[:n] = self._flipped(key, f, bytes(out[:n]), offset)
        return n

    def stat(self, key: str) -> ObjectInfo | None:
        self._apply("stat", key)
        return self.inner.stat(key)

    def exists(self, key: str) -> bool:
        self._apply("stat", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> list[Entry]:
        self._apply("list", prefix)
        return self.inner.list(prefix)

    # -- deleting -----------------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        self._apply("delete", key)
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._apply("delete", prefix)
        self.inner.delete_prefix(prefix)


__all__ = ["OPS", "Fault", "FaultyStorage"]
