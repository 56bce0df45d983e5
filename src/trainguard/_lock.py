"""The run root's write lock: one writer per run root (a second one gets RootLockedError, not corruption).

An advisory ``flock`` on ``<root>/.lock`` (opened without following a symlink: only a regular file is ever
locked, truncated and written); the kernel releases it when the last descriptor of the holder is
closed, so a SIGKILLed writer never leaves a stale lock. A process forked after the lock was taken (a
DataLoader worker, say) would inherit the descriptor and keep the lock alive after the writer dies: children
close it right after ``fork`` (``os.register_at_fork``). On network filesystems without flock support this lock
is not reliable; run one writer per run root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import weakref
from pathlib import Path

from .errors import FULL_ERRNOS, ConfigError, RootLockedError, UnsafeFileError
from .storage.safeio import open_regular

_held: weakref.WeakSet[RootLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_held):
        if lock._fd is not None:
            try:
                os.close(lock._fd)
            except OSError:
                pass
            lock._fd = None


os.register_at_fork(after_in_child=_close_in_child)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


NOT_WRITABLE = {
    errno.EROFS: "is on a read-only filesystem",
    errno.EACCES: "is not writable by this user",
    errno.EPERM: "is not writable by this user",
}
"""Why a root cannot be written, by the errno of the failed write (for error messages)."""


class RootLock:
    def __init__(self, root: Path, name: str | None = None) -> None:
        """Args:
        root: the run root (its ``.lock`` file is the lock).
        name: what the user opened, when that is not ``root`` itself (the URL of an object-store run root
            whose local cache ``root`` is): messages name it first, with ``root`` as detail.
        """
        self.path = root / ".lock"
        self.name = name
        self._fd: int | None = None

    def _where(self) -> str:
        root = self.path.parent
        return str(root) if self.name is None else f"{self.name} (its local cache {root})"

    def acquire(self) -> None:
        """Take the lock (non-blocking) and record ``pid N on HOST`` in the lock file.

        Raises:
            RootLockedError: another manager of this process or another process holds it.
            UnsafeFileError: ``.lock`` is a symlink, a directory, a named pipe or another non-regular file
                (never followed, truncated or written).
            ConfigError: the root is on a read-only filesystem or not writable by this user (the OSError is
                its ``__cause__``).
        """
        for lock in list(_held):
            if lock._fd is not None and lock.path.resolve() == self.path.resolve():
                raise RootLockedError(
                    f"this process (pid {os.getpid()}) already has a CheckpointManager writing {self._where()}; "
                    "close() it first, use a different root, or open the second one with read_only=True"
                )
        # Never through a symlink (a link to another file would be truncated below), never a named pipe or a
        # directory: UnsafeFileError naming the path instead.
        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o644, what="lock file")
        except UnsafeFileError:
            raise
        except OSError as e:
            why = NOT_WRITABLE.get(e.errno or 0)
            if why is None:
                raise
            raise ConfigError(
                f"run root {self._where()} {why}: its write lock ({self.path}) cannot be taken, and writing to "
                "the root (saving, gc, import) needs write access. Listing, verifying and restoring work without "
                "it (`trainguard ls`, `trainguard verify`, CheckpointManager(root, read_only=True))"
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            parts = holder.split()
            if (
                len(parts) >= 4
                and parts[0] == "pid"
                and parts[1].isdigit()
                and parts[3] == socket.gethostname()
                and not _alive(int(parts[1]))
            ):
                holder = (
                    f"taken by pid {parts[1]}, which has exited; a process it started still holds the lock "
                    "(e.g. a data-loader worker or a child it forked): stop it"
                )
            raise RootLockedError(
                f"run root {self._where()} is being written by another process ({holder}). Stop that process, "
                "use a different root, or open with CheckpointManager(root, read_only=True) to only list/restore."
            ) from None
        try:  # who holds it, for the next writer's error message: informational, so a full disk is no error
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        except OSError as e:
            if e.errno not in FULL_ERRNOS:
                os.close(fd)
                raise
        self._fd = fd
        _held.add(self)

    def release(self) -> None:
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            finally:
                os.close(self._fd)
                self._fd = None
        _held.discard(self)
