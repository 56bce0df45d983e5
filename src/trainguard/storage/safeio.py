"""Opening and reading files under a run root: never through a symlink, never blocking, never unbounded.

Every file trainguard opens or reads under a run root (manifests, chunks, the ``corrupt.json`` marker, the
event log, the write lock) goes through :func:`open_regular` or :func:`read_bounded`, so that an odd file put
there (by a tester, a mistake or an attacker) is refused with :class:`~trainguard.errors.UnsafeFileError`
instead of being followed, hanging the reader, or filling memory:

- a symlink as the last path component is not followed (``O_NOFOLLOW``): a lock file linked to a system file
  is never truncated, a marker linked to ``/dev/zero`` is never read;
- the open never blocks (``O_NONBLOCK``): a named pipe is opened and refused at once instead of waiting for a
  writer;
- only regular files are accepted (``fstat`` after the open, so nothing can be swapped in between a check and
  the open): a directory, named pipe, device or socket is refused;
- reads are bounded: each kind of file has a size limit, checked with ``fstat`` before reading and enforced
  while reading.

Symlinked *directories* above the file are the business of the manifest path check
(:func:`trainguard.format.layout.validate_relpath`), which resolves them and refuses paths leaving the root.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import Any

from ..errors import UnsafeFileError

KIB = 1 << 10
MIB = 1 << 20

MAX_MANIFEST_BYTES = 1 << 30
"""Largest ``manifest.json`` read (1 GiB; a manifest of a million tensors is ~200 MiB)."""
MAX_MARKER_BYTES = 1 * MIB
"""Largest ``corrupt.json`` marker read (a real one is under 4 KiB)."""
MAX_EVENT_FILE_BYTES = 256 * MIB
"""Largest event-log file read whole by ``read_events`` (a line is ~300 bytes: ~900k events per process)."""

_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refuse(path: str | os.PathLike[str], what: str, why: str) -> UnsafeFileError:
    err = UnsafeFileError(
        f"{what} {os.fspath(path)} is {why}; trainguard opens only regular files under a run root and never "
        f"follows a symlink there: remove it or replace it with the real file"
    )
    err.filename = os.fspath(path)
    return err


def open_regular(
    path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o644, *, what: str = "file"
) -> int:
    """Open ``path`` without following a symlink and without blocking, and return the descriptor of a regular
    file (``O_NONBLOCK`` is cleared again once it is known to be one).

    Args:
        path: the file (its last component must not be a symlink).
        flags: ``os.O_*`` access flags (``O_RDONLY``, ``O_RDWR | O_CREAT``, ...).
        mode: permission bits for a file ``O_CREAT`` creates.
        what: what the file is, for the error message (``"manifest"``, ``"lock file"``, ...).

    Returns:
        An open file descriptor; the caller closes it.

    Raises:
        UnsafeFileError: the path is a symlink, a directory, a named pipe, a device or a socket.
        FileNotFoundError, PermissionError, OSError: as ``os.open`` raises them (missing, no access, ...).
    """
    try:
        fd = os.open(path, flags | _FLAGS, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, what, "a symlink") from None
        if e.errno == errno.EISDIR:
            raise _refuse(path, what, "a directory") from None
        if e.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # FIFO without a reader, device, socket
            try:
                kind = _kind(os.lstat(path).st_mode)
            except OSError:
                kind = "not a regular file"
            raise _refuse(path, what, kind) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, what, _kind(st.st_mode))
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path: str | os.PathLike[str], limit_bytes: int, *, what: str = "file") -> bytes:
    """Read a whole regular file of at most ``limit_bytes`` bytes (opened with :func:`open_regular`).

    Args:
        path: the file.
        limit_bytes: the largest size this kind of file may have, in bytes.
        what: what the file is, for error messages.

    Returns:
        The file's bytes.

    Raises:
        UnsafeFileError: not a regular file, a symlink, or larger than ``limit_bytes`` (nothing is read then).
        FileNotFoundError, PermissionError, OSError: as ``os.open``/``os.read`` raise them.
    """
    fd = open_regular(path, os.O_RDONLY, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > limit_bytes:
            raise _refuse(path, what, f"{size} bytes, more than the {limit_bytes} bytes a {what} may have")
        parts: list[bytes] = []
        got = 0
        while got <= limit_bytes:  # the file may grow after the fstat: read at most limit + 1 bytes
            data = os.read(fd, min(limit_bytes + 1 - got, 16 * MIB))
            if not data:
                break
            parts.append(data)
            got += len(data)
        if got > limit_bytes:
            raise _refuse(path, what, f"more than the {limit_bytes} bytes a {what} may have")
        return b"".join(parts)
    finally:
        os.close(fd)


def read_full(f: Any, view: memoryview) -> int:
    """Fill ``view`` from the raw file ``f`` (``readinto`` returns short counts on pipes, signals, network
    filesystems): read until ``view`` is full or the file ends.

    Returns:
        The bytes read: ``len(view)``, or fewer when the file ended first.

    Raises:
        OSError: as ``f.readinto`` raises it.
    """
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def lstat_regular(path: str | os.PathLike[str]) -> os.stat_result | None:
    """``os.lstat`` of ``path`` when it is a regular file (not a symlink), else None (missing included)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def ensure_dir(path: str | os.PathLike[str], *, what: str = "directory") -> None:
    """Create the directory ``path`` if missing (parents included); refuse one that is a symlink or not a
    directory.

    Raises:
        UnsafeFileError: ``path`` exists as a symlink, a file, a named pipe, ...
        OSError: the directory cannot be created (read-only filesystem, permissions, ...).
    """
    try:
        os.makedirs(path, exist_ok=False)
        return
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(
            f"{what} {os.fspath(path)} is {'a file' if stat.S_ISREG(mode) else _kind(mode)}, not a directory: "
            "remove or rename it "
            "(trainguard creates the directory itself)"
        )
