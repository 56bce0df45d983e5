"""Byte stores: the :class:`Storage` protocol (``storage/base.py``) and its backends.

``storage/`` is the only package that touches the bytes of a run root. :class:`LocalStorage` keeps a run root
in a POSIX directory; :class:`FaultyStorage` wraps any backend and injects faults (tests). Object stores arrive
with the tiers issue, behind the same protocol.
"""

from .base import Entry, ObjectInfo, Staged, Storage, as_storage
from .faulty import Fault, FaultyStorage
from .local import LocalStorage, atomic_write, fsync_dir, remove_tree
from .safeio import open_regular, read_bounded

__all__ = [
    "Entry",
    "Fault",
    "FaultyStorage",
    "LocalStorage",
    "ObjectInfo",
    "Staged",
    "Storage",
    "as_storage",
    "atomic_write",
    "fsync_dir",
    "open_regular",
    "read_bounded",
    "remove_tree",
]
