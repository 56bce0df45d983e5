"""Local POSIX byte-store primitives with the durability the commit protocol needs.

Invariants: a file published with :func:`atomic_write` is either absent or complete (tmp + fsync + rename +
directory fsync); ENOSPC surfaces as :class:`~trainguard.errors.StorageFullError` naming the path.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path

from ..errors import StorageFullError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so renames and creations inside it survive a machine crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raise_if_full(e: OSError, path: str | os.PathLike[str], step: int | None = None) -> None:
    """Turn ENOSPC/EDQUOT into StorageFullError (with the fix in the message); re-raise anything else."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        full = StorageFullError(
            f"no space left on the device while writing {path}: free space or lower retention (keep=...); "
            "no checkpoint was committed and earlier checkpoints are intact",
            step=step,
        )
        full.errno, full.strerror, full.filename = e.errno, e.strerror, str(path)
        raise full from e
    raise e


def write_file(path: Path, buffers: list[memoryview] | memoryview | bytes, *, fsync: bool = True) -> None:
    """Write ``buffers`` to a new file ``path`` (must not exist) and fsync it."""
    if not isinstance(buffers, list):
        buffers = [memoryview(buffers)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            while len(view):
                n = os.write(fd, view[: 1 << 30])
                view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Publish ``data`` at ``path`` atomically: write a temporary sibling, fsync, rename, fsync the directory.

    Replaces an existing file atomically. Raises StorageFullError on ENOSPC (the old file stays as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write_file(tmp, data, fsync=fsync)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise_if_full(e, path)
    if fsync:
        fsync_dir(path.parent)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree; missing is fine."""
    shutil.rmtree(path, ignore_errors=True)
