"""Byte stores. Only the local POSIX store exists so far; object stores arrive with the tiers issue."""

from .local import atomic_write, fsync_dir, remove_tree
from .safeio import open_regular, read_bounded

__all__ = ["atomic_write", "fsync_dir", "open_regular", "read_bounded", "remove_tree"]
