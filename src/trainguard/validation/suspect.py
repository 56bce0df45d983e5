"""The ``suspect`` status: a checkpoint whose bytes are intact but whose content failed validation.

``step-N/suspect.json`` holds ``{"reason": str, "by": str, "time": ISO 8601, "manifest_crc32c": int}``. It is
published atomically through the run root's :class:`~trainguard.storage.base.Storage` (temporary sibling +
rename on a local root), so an operator may set or clear it while a job runs without the root lock
(``trainguard mark``). It is read like every per-step record: no symlink followed, no blocking open, only a
regular file of at most ``MAX_MARKER_BYTES``; a marker that cannot be read or parsed still counts (the step is
not restored). ``manifest_crc32c`` binds it to the manifest it was written for: a marker left next to another
manifest of the step (a save replaced the checkpoint) is stale and ignored.
"""

from __future__ import annotations

import json
import os

from .._time import iso
from ..errors import UnsafeFileError
from ..format import step_dir_name
from ..format.layout import MANIFEST_NAME
from ..storage.base import Storage, as_storage
from ..storage.safeio import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES

SUSPECT_MARKER = "suspect.json"
Root = str | os.PathLike[str] | Storage


def _key(step: int) -> str:
    return f"{step_dir_name(step)}/{SUSPECT_MARKER}"


def read_suspect(root: Root, step: int) -> dict[str, object] | None:
    """The suspect marker of ``step`` (None when absent). An unreadable or malformed marker counts."""
    try:
        data = json.loads(
            as_storage(root).read(_key(step), limit_bytes=MAX_MARKER_BYTES, what="suspect marker")
        )
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnsafeFileError as e:
        return {"reason": f"suspect (unreadable marker: {e})"}
    except (OSError, ValueError, RecursionError):
        return {"reason": "suspect (unreadable marker)"}
    if not isinstance(data, dict):
        return {"reason": "suspect (malformed marker)"}
    return data


def manifest_crc(root: Root, step: int) -> int | None:
    """CRC32C of the bytes of ``step``'s manifest (None when it cannot be read): what binds a marker or a
    probe record to the checkpoint it was written for."""
    import crc32c

    key = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    try:
        return int(crc32c.crc32c(as_storage(root).read(key, limit_bytes=MAX_MANIFEST_BYTES, what="manifest")))
    except OSError:
        return None


def suspect_reason(root: Root, step: int) -> str | None:
    """Why ``step`` is suspect, or None when it is not. A marker bound to another manifest of the step (left
    by a save that replaced it) is stale and ignored."""
    m = read_suspect(root, step)
    if m is None:
        return None
    bound = m.get("manifest_crc32c")
    if isinstance(bound, int) and not isinstance(bound, bool):
        current = manifest_crc(root, step)
        if current is not None and current != bound:
            return None
    return str(m.get("reason") or "suspect")


def mark_suspect(root: Root, step: int, reason: str, *, by: str = "trainguard", fsync: bool = True) -> bool:
    """Mark ``step`` suspect (atomically replacing an earlier marker). Returns False when the step directory
    is gone or the root is not writable (the marker is advisory: nothing else changes)."""
    storage = as_storage(root)
    try:
        info = storage.stat(step_dir_name(step))
    except OSError:
        return False
    if info is None or (storage.local_path is not None and info.kind != "dir"):
        return False
    body = {"reason": str(reason), "by": by, "time": iso(), "manifest_crc32c": manifest_crc(storage, step)}
    try:
        storage.publish(_key(step), json.dumps(body).encode(), durable=fsync)
    except OSError:
        return False
    return True


def clear_suspect(root: Root, step: int) -> bool:
    """Remove the suspect marker of ``step``. Returns True when one was removed.

    Raises:
        OSError: the marker exists and cannot be removed (a read-only filesystem, permissions).
    """
    storage = as_storage(root)
    try:
        # nothing to remove: no write (a read-only root refuses even the unlink of a missing name)
        if storage.stat(_key(step)) is None:
            return False
        return storage.delete(_key(step))
    except (FileNotFoundError, NotADirectoryError):
        return False
