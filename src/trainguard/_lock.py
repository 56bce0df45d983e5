"""The run root's write lock: one writer per run root (a second one gets RootLockedError, not corruption).

An advisory ``flock`` on ``<root>/.lock``; the kernel releases it when the holder dies, so a SIGKILLed writer
never leaves a stale lock. (On network filesystems without flock support, this lock is not reliable; run one
writer per run root.)
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .errors import RootLockedError


class RootLock:
    def __init__(self, root: Path) -> None:
        self.path = root / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise RootLockedError(
                f"run root {self.path.parent} is being written by another process ({holder}). Stop that process, "
                "use a different root, or open with CheckpointManager(root, read_only=True) to only list/restore."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
