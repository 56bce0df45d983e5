"""The ``Storage`` protocol: the one seam between trainguard and the bytes of a run root.

Everything above ``storage/`` (the chunk store, the catalog, the commit, retention, verify) names objects by
*key*: a ``/``-separated path relative to the run root (``chunks/ab/ab12...``, ``step-000000010/manifest.json``),
never an absolute path, never ``..``. A backend maps keys onto its medium:

- :class:`~trainguard.storage.local.LocalStorage`: a POSIX directory (tmp + fsync + rename + directory fsync;
  ``syncfs(2)`` and ``sync_file_range(2)`` for batched durability; ``O_NOFOLLOW`` opens, see
  :mod:`trainguard.storage.safeio`).
- object stores (fsspec: s3fs, ``memory://``) implement the same calls: a PUT is atomic there, so
  :meth:`Storage.publish` needs no rename and :meth:`Storage.stage` may write the final key directly.
- :class:`~trainguard.storage.faulty.FaultyStorage` wraps any backend and injects faults (tests).

Call sequence of a save (per rank; rank 0 publishes)::

    staged = [storage.stage(key, bytes, staging=partial_key) for each new chunk]  # invisible or complete
    storage.commit_staged(staged)        # durability barrier: every staged object durable and visible
    storage.publish("step-N/manifest.json", manifest)   # rank 0: atomic, durable; its presence is the commit

Backends only move bytes: none knows about tensors or manifests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

Buffers = "list[memoryview] | memoryview | bytes | bytearray"


@dataclass(frozen=True)
class ObjectInfo:
    """What :meth:`Storage.stat` knows about one key.

    Attributes:
        key: the key.
        kind: ``"file"`` (a regular file / object), ``"dir"`` (a directory / common prefix), ``"symlink"``
            (never followed), or ``"other"`` (named pipe, device, socket).
        size: bytes (0 for anything but ``"file"``).
        mtime: modification time, seconds since the epoch.
        version: identity of this object's current bytes (local: inode, size, mtime_ns, ctime_ns; object
            stores: ETag and size); it changes whenever the object is rewritten.
    """

    key: str
    kind: str
    size: int
    mtime: float
    version: tuple[Any, ...]

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


@dataclass(frozen=True)
class Entry:
    """One name directly under a prefix (:meth:`Storage.list`): ``name`` and whether it is a directory
    (a common prefix on object stores); a symlink is never a directory here."""

    name: str
    is_dir: bool


@dataclass(frozen=True)
class Staged:
    """A write made by :meth:`Storage.stage` that :meth:`Storage.commit_staged` makes durable and visible.

    Attributes:
        key: the final key.
        token: backend-specific (local: the temporary file's key); None when the object is already visible.
        staging: the staging prefix given to ``stage``.
    """

    key: str
    token: str | None
    staging: str


@runtime_checkable
class Storage(Protocol):
    """Bytes of one run root, addressed by ``/``-separated relative keys.

    Thread-safety: every method may be called from several threads at once (chunk writers run in parallel).
    Errors: a missing key raises ``FileNotFoundError``; ENOSPC/EDQUOT raise
    :class:`~trainguard.errors.StorageFullError`; a key that is a symlink or not a regular file is refused with
    :class:`~trainguard.errors.UnsafeFileError`; other failures raise ``OSError`` (a backend may raise
    :class:`~trainguard.errors.TransientStorageError` for ones worth retrying).
    """

    @property
    def url(self) -> str:
        """Where the root is, for messages (a directory path or a URL)."""
        ...

    @property
    def local_path(self) -> Path | None:
        """The root as a local directory (the lock and the event log live there), or None for object stores."""
        ...

    def location(self, key: str) -> str:
        """``key`` as a user would name it (a path or a URL), for messages."""
        ...

    # -- writing ------------------------------------------------------------------------------------------
    def write_new(self, key: str, data: Any, *, durable: bool = True) -> None:
        """Create a new object ``key`` holding ``data`` (bytes, a memoryview or a list of them).

        Args:
            key: the key; must not exist yet.
            data: the bytes (a list of buffers is written in order).
            durable: flush the object to stable storage before returning.

        Raises:
            FileExistsError: ``key`` exists.
            StorageFullError: no space left (ENOSPC/EDQUOT); nothing is left at ``key`` then.
            OSError: any other write failure.
        """
        ...

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        """Atomically make ``key`` hold ``data``: a reader sees the old object (or none) or all of ``data``,
        never a part. Replaces an existing object. Local: tmp + fsync + rename + directory fsync; object
        stores: one PUT.

        Raises:
            StorageFullError: no space left; the old object is intact.
            OSError: any other failure; the old object is intact.
        """
        ...

    def stage(self, key: str, data: Any, *, staging: str) -> Staged:
        """Write ``data`` for ``key`` so that :meth:`commit_staged` can make it durable and visible later.

        Until then ``key`` is either absent or complete (object stores write it directly: a PUT is atomic;
        local storage writes a temporary file under ``staging``). Data is written whole before returning.

        Args:
            key: the final key.
            data: the bytes.
            staging: a key prefix this save owns (its partial directory), deleted with it.

        Returns:
            A :class:`Staged` handle for :meth:`commit_staged` / :meth:`discard_staged`.

        Raises:
            StorageFullError: no space left; nothing is left at ``key``.
            OSError: any other write failure.
        """
        ...

    def commit_staged(self, staged: list[Staged]) -> None:
        """The durability barrier of a save: every staged object durable and visible at its key.

        Raises:
            StorageFullError: no space left while flushing.
            OSError: the flush failed (e.g. EIO); staged local objects are then not made visible.
        """
        ...

    def discard_staged(self, staged: list[Staged]) -> None:
        """Forget staged writes of a failed save (their temporary objects go with the staging prefix)."""
        ...

    def staging_prefix(self, partial: str, target_prefix: str) -> str:
        """The staging prefix to use for objects that will live under ``target_prefix`` (local: ``partial``,
        or a sibling under ``target_prefix`` when that is on another filesystem; created here)."""
        ...

    def make_dir(self, prefix: str) -> bool:
        """Create the directory ``prefix`` (no-op on object stores). Returns True if it was created."""
        ...

    def barrier(self, prefix: str = "") -> None:
        """Make the creation of ``prefix``'s entries (e.g. a new step directory) durable (local: fsync of the
        directory; object stores: nothing to do)."""
        ...

    def touch(self, key: str) -> None:
        """Mark ``key`` as in use now (its mtime; distributed garbage collection spares recent chunks)."""
        ...

    def move(self, src: str, dst: str) -> bool:
        """Move ``src`` to ``dst`` (quarantine of a corrupt chunk). Returns False when ``src`` is missing."""
        ...

    # -- reading ------------------------------------------------------------------------------------------
    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        """Read a whole object of at most ``limit_bytes`` bytes.

        Raises:
            FileNotFoundError: missing.
            UnsafeFileError: a symlink, not a regular file, or larger than ``limit_bytes``.
            OSError: the read failed.
        """
        ...

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        """Open ``key`` for reading: a binary file object (``readinto``, ``read``, ``close``, context manager)
        and the :class:`ObjectInfo` of the object opened (taken from the open object: nothing swapped in).

        Raises:
            FileNotFoundError: missing.
            UnsafeFileError: a symlink or not a regular file.
            OSError: the open failed.
        """
        ...

    def read_range(self, key: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes of ``key`` starting at byte ``offset`` into ``out``.

        Returns:
            The number of bytes read (less than ``len(out)`` only at the end of the object).

        Raises:
            FileNotFoundError, UnsafeFileError, OSError: as :meth:`open_read`.
        """
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """What ``key`` is (symlinks are not followed), or None when missing.

        Raises:
            OSError: the stat failed for another reason than a missing key (EACCES, EIO).
        """
        ...

    def exists(self, key: str) -> bool:
        """True when ``key`` exists (any kind)."""
        ...

    def list(self, prefix: str = "") -> list[Entry]:
        """The names directly under ``prefix`` (``""``: the root), unsorted; empty when ``prefix`` is missing."""
        ...

    # -- deleting -----------------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Delete one object. Returns False when it was missing.

        Raises:
            OSError: the deletion failed.
        """
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Delete everything under ``prefix`` (a directory tree); missing is fine, failures are ignored."""
        ...


def as_storage(root: str | os.PathLike[str] | Storage) -> Storage:
    """``root`` when it already is a :class:`Storage`, else a :class:`LocalStorage` of that directory."""
    if isinstance(root, (str, os.PathLike)):
        from .local import LocalStorage

        return LocalStorage(root)
    return root
