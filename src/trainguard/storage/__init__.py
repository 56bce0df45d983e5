"""Byte stores: the :class:`Storage` protocol (``storage/base.py``) and its backends.

``storage/`` is the only package that touches the bytes of a run root. :class:`LocalStorage` keeps a run root
in a POSIX directory; :class:`ObjectStorage` keeps one on an object store (``s3://``, any fsspec URL; opened by
:func:`open_object_storage`); :class:`FaultyStorage` wraps any backend and injects faults (tests).
:class:`StorageObjects` drives any Storage with the tiers' object-store calls (``tg.Tier(storage)``).
"""

from .base import Entry, ObjectInfo, Staged, Storage, as_storage
from .faulty import Fault, FaultyStorage
from .local import LocalStorage, atomic_write, fsync_dir, remove_tree
from .objectstorage import ObjectStorage, StorageObjects, open_object_storage
from .safeio import open_regular, read_bounded

__all__ = [
    "Entry",
    "Fault",
    "FaultyStorage",
    "LocalStorage",
    "ObjectInfo",
    "ObjectStorage",
    "Staged",
    "Storage",
    "StorageObjects",
    "as_storage",
    "atomic_write",
    "fsync_dir",
    "open_object_storage",
    "open_regular",
    "read_bounded",
    "remove_tree",
]
