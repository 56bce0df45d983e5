"""Object stores behind the :class:`~trainguard.storage.base.Storage` protocol, and back.

Two thin adapters join the two byte interfaces of trainguard:

- :class:`ObjectStorage`: the ``Storage`` protocol on an :class:`~trainguard.storage.objects.ObjectStore`
  (``s3://`` through boto3, any fsspec URL through fsspec, a shared directory). A PUT is atomic on an object
  store, so :meth:`ObjectStorage.publish` is one PUT, :meth:`ObjectStorage.stage` writes the final key
  directly and :meth:`ObjectStorage.commit_staged` has nothing left to do; :meth:`ObjectStorage.write_new` is a
  conditional create (If-None-Match) where the store has one. :func:`open_object_storage` opens one from a URL
  with the construction checks of :func:`~trainguard.storage.objects.open_objects`.
- :class:`StorageObjects`: the ``ObjectStore`` interface the tiers use, on any ``Storage``. With it a
  :class:`~trainguard.storage.faulty.FaultyStorage` wraps a tier's store: ``tg.Tier(storage)`` accepts a
  ``Storage`` in place of a URL, so tier fault tests inject through the same seam as the hot root's::

      from trainguard.storage import Fault, FaultyStorage, open_object_storage

      s3 = FaultyStorage(open_object_storage("s3://bucket/run1"), Fault("write", match="chunks/*", nth=2,
                                                                          errno=errno.EIO))
      mgr = tg.CheckpointManager(hot, tiers=[tg.Tier(s3)])   # the 2nd chunk PUT fails, is retried

Names are the same ``/``-separated keys on both sides (``chunks/ab/<hash>``, ``step-000000010/manifest.json``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from ..errors import UnsafeFileError
from .base import Entry, ObjectInfo, Staged, Storage
from .objects import MAX_OBJECT_BYTES, ObjectStore, open_objects


def _joined(data: Any) -> bytes:
    """``data`` (bytes, a memoryview or a list of them) as one bytes object (one PUT)."""
    if isinstance(data, (list, tuple)):
        return b"".join(bytes(memoryview(p).cast("B")) for p in data)
    return bytes(memoryview(data).cast("B")) if not isinstance(data, bytes) else data


def _check_key(key: str) -> str:
    """Keys are relative and never climb: refuse ``..`` and absolute keys (a manifest is never trusted)."""
    if key.startswith("/") or ".." in key.split("/"):
        raise UnsafeFileError(f"refusing the key {key!r}: keys are relative to the run root, without '..'")
    return key


class ObjectStorage:
    """The :class:`~trainguard.storage.base.Storage` protocol on an object store.

    Args:
        store: the store (names relative to the run root), e.g. from
            :func:`~trainguard.storage.objects.open_objects`.

    Differences from :class:`~trainguard.storage.local.LocalStorage`, all inherent to object stores:
    directories are key prefixes (:meth:`make_dir` and :meth:`barrier` do nothing; a prefix "exists" while an
    object lies under it); every write is durable when the PUT returns; :meth:`touch` does not change an
    object (stores keep no writable mtime), :meth:`move` is a copy and a delete; :meth:`read_range` and
    :meth:`open_read` read the whole object (the tiers read whole chunks anyway); :class:`ObjectInfo` carries
    the size as ``version`` and ``mtime`` 0 (the ``ObjectStore`` interface lists sizes only).

    Thread-safe as its store (boto3's client and fsspec's filesystems are).
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def __repr__(self) -> str:
        return f"ObjectStorage({self.store.url!r})"

    # -- identity -----------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.store.url

    @property
    def local_path(self) -> Path | None:
        return None

    @property
    def supports_conditional_create(self) -> bool:
        return bool(self.store.supports_conditional_create)

    @property
    def unreachable(self) -> str | None:
        return getattr(self.store, "unreachable", None)

    def location(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    # -- writing ------------------------------------------------------------------------------------------
    def write_new(self, key: str, data: Any, *, durable: bool = True) -> None:
        if not self.store.create(_check_key(key), _joined(data)):
            raise FileExistsError(f"{self.location(key)} exists")

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        self.store.put(_check_key(key), _joined(data))

    def stage(self, key: str, data: Any, *, staging: str) -> Staged:
        self.store.put(_check_key(key), _joined(data))  # a PUT is atomic: the key is absent or complete
        return Staged(key, None, staging)

    def commit_staged(self, staged: list[Staged]) -> None:
        """Nothing to do: each object was durable and visible when its PUT returned."""

    def discard_staged(self, staged: list[Staged]) -> None:
        """Nothing to do: staged objects are already at their (content-addressed) keys; garbage collection
        frees the ones no manifest references, as on a local root in ``per_file`` durability."""

    def staging_prefix(self, partial: str, target_prefix: str) -> str:
        return partial

    def make_dir(self, prefix: str) -> bool:
        return False

    def barrier(self, prefix: str = "") -> None:
        """Nothing to do: a prefix comes into being with its first object."""

    def touch(self, key: str) -> None:
        """Nothing to do (an object's time cannot be changed without rewriting it)."""

    def move(self, src: str, dst: str) -> bool:
        try:
            data = self.read(src, limit_bytes=MAX_OBJECT_BYTES)
        except FileNotFoundError:
            return False
        self.store.put(_check_key(dst), data)
        self.store.delete(src)
        return True

    # -- reading ------------------------------------------------------------------------------------------
    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        size = self.store.size(_check_key(key))
        if size is None:
            raise FileNotFoundError(f"{self.location(key)}: no such {what}")
        if size > limit_bytes:
            raise UnsafeFileError(
                f"refusing {what} {self.location(key)}: {size} bytes, more than the {limit_bytes} bytes a "
                f"{what} may have"
            )
        data = self.store.get(key)
        if len(data) > limit_bytes:  # rewritten between the HEAD and the GET
            raise UnsafeFileError(
                f"refusing {what} {self.location(key)}: {len(data)} bytes, more than the {limit_bytes} bytes "
                f"a {what} may have"
            )
        return data

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        data = self.read(key, limit_bytes=MAX_OBJECT_BYTES, what=what)
        return io.BytesIO(data), ObjectInfo(key, "file", len(data), 0.0, ("size", len(data)))

    def read_range(self, key: str, offset: int, out: memoryview) -> int:
        data = memoryview(self.read(key, limit_bytes=MAX_OBJECT_BYTES))[offset : offset + len(out)]
        out[: len(data)] = data
        return len(data)

    def stat(self, key: str) -> ObjectInfo | None:
        size = self.store.size(_check_key(key)) if key else None
        if size is not None:
            return ObjectInfo(key, "file", size, 0.0, ("size", size))
        if self.walk(key.rstrip("/") + "/" if key else ""):
            return ObjectInfo(key.rstrip("/"), "dir", 0, 0.0, ("prefix",))
        return None

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def walk(self, prefix: str = "") -> dict[str, int]:
        """name -> size of every object whose name starts with ``prefix`` (recursive; one listing)."""
        return self.store.list(prefix)

    def list(self, prefix: str = "") -> list[Entry]:
        base = prefix.rstrip("/") + "/" if prefix else ""
        out: dict[str, Entry] = {}
        for name in self.walk(base):
            head, sep, _ = name[len(base) :].partition("/")
            if head and head not in out:
                out[head] = Entry(head, bool(sep))
        return list(out.values())

    # -- deleting -----------------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        existed = self.store.size(_check_key(key)) is not None
        self.store.delete(key)
        return existed

    def delete_prefix(self, prefix: str) -> None:
        try:
            names = self.walk(prefix.rstrip("/") + "/")
        except OSError:
            return
        for name in names:
            try:
                self.store.delete(name)
            except OSError:
                pass


class StorageObjects:
    """The :class:`~trainguard.storage.objects.ObjectStore` interface on any
    :class:`~trainguard.storage.base.Storage`: how a tier given as a ``Storage`` (``tg.Tier(storage)``, e.g. a
    :class:`~trainguard.storage.faulty.FaultyStorage`) is driven by the tier code.

    Args:
        storage: the storage; every call goes through its protocol methods (so a FaultyStorage sees each PUT
            as a ``write``, each GET as a ``read``, each listing as a ``list``).

    Mapping: ``put`` -> :meth:`~Storage.publish`, ``create`` -> :meth:`~Storage.write_new`, ``get`` ->
    :meth:`~Storage.read`, ``size`` -> :meth:`~Storage.stat`, ``list`` -> :meth:`~Storage.list` (plus one
    recursive listing where the storage has ``walk``, else a walk of :meth:`~Storage.list` and
    :meth:`~Storage.stat`), ``delete`` -> :meth:`~Storage.delete`.
    """

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.url = storage.url.rstrip("/") or "/"
        self.supports_conditional_create = bool(getattr(storage, "supports_conditional_create", True))
        self.unreachable: str | None = getattr(storage, "unreachable", None)

    def __repr__(self) -> str:
        return f"StorageObjects({self.storage!r})"

    def put(self, name: str, data: bytes | memoryview) -> None:
        self.storage.make_dir(name.rpartition("/")[0])
        self.storage.publish(name, bytes(data))

    def create(self, name: str, data: bytes) -> bool:
        self.storage.make_dir(name.rpartition("/")[0])
        try:
            self.storage.write_new(name, data)
        except FileExistsError:
            return False
        return True

    def get(self, name: str) -> bytes:
        return self.storage.read(name, limit_bytes=MAX_OBJECT_BYTES, what="object")

    def size(self, name: str) -> int | None:
        info = self.storage.stat(name)
        return info.size if info is not None and info.is_file else None

    def list(self, prefix: str = "") -> dict[str, int]:
        head = prefix.rpartition("/")[0]
        top = self.storage.list(head)  # the listing a fault on ``list`` sees (and the only one locally)
        walk = getattr(self.storage, "walk", None)
        if callable(walk):
            return {k: v for k, v in walk(prefix).items() if k.startswith(prefix)}
        out: dict[str, int] = {}
        todo = [(head, top)]
        while todo:
            where, entries = todo.pop()
            for e in entries:
                key = f"{where}/{e.name}" if where else e.name
                if e.is_dir:
                    if key.startswith(prefix) or prefix.startswith(key + "/"):
                        todo.append((key, self.storage.list(key)))
                elif key.startswith(prefix) and not (e.name.startswith(".") and ".tmp" in e.name):
                    info = self.storage.stat(key)
                    if info is not None and info.is_file:
                        out[key] = info.size
        return out

    def delete(self, name: str) -> None:
        self.storage.delete(name)


def open_object_storage(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    stall_timeout_s: float = 60.0,
) -> ObjectStorage:
    """The ``Storage`` of a URL (or a shared directory seen as an object store): :class:`ObjectStorage` on
    :func:`~trainguard.storage.objects.open_objects`.

    Args:
        url: ``s3://bucket/prefix``, any fsspec URL, or a local path.
        storage_options: passed to the store (fsspec/s3fs names); they override the AWS environment.
        stall_timeout_s: a request making no progress for this many seconds fails (TransientStorageError).

    Raises:
        ConfigError: unknown scheme, missing credentials, a missing bucket, access denied.
        MissingDependencyError: the scheme's backend package is not installed.
    """
    return ObjectStorage(open_objects(url, storage_options, stall_timeout_s=stall_timeout_s))


__all__ = ["ObjectStorage", "StorageObjects", "open_object_storage"]
