"""The ``suspect`` status: a checkpoint whose bytes are intact but whose content failed validation.

``step-N/suspect.json`` holds ``{"reason": str, "by": str, "time": ISO 8601}``. It is written atomically
(temporary sibling + rename), so an operator may set or clear it while a job runs without the root lock
(``trainguard mark``). It is read like every per-step record: opened without following a symlink, without
blocking, and only when it is a regular file of at most ``MAX_MARKER_BYTES``; a marker that cannot be read or
parsed still counts (the step is not restored). A checkpoint committed anew for the same step removes it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .._time import iso
from ..errors import UnsafeFileError
from ..format import step_dir_name
from ..format.layout import MANIFEST_NAME
from ..storage.local import atomic_write
from ..storage.safeio import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, read_bounded

SUSPECT_MARKER = "suspect.json"


def marker_path(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / step_dir_name(step) / SUSPECT_MARKER


def read_suspect(root: str | os.PathLike[str], step: int) -> dict[str, object] | None:
    """The suspect marker of ``step`` (None when absent). An unreadable or malformed marker counts."""
    try:
        data = json.loads(read_bounded(marker_path(root, step), MAX_MARKER_BYTES, what="suspect marker"))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except UnsafeFileError as e:
        return {"reason": f"suspect (unreadable marker: {e})"}
    except (OSError, ValueError, RecursionError):
        return {"reason": "suspect (unreadable marker)"}
    if not isinstance(data, dict):
        return {"reason": "suspect (malformed marker)"}
    return data


def manifest_crc(root: str | os.PathLike[str], step: int) -> int | None:
    """CRC32C of the bytes of ``step``'s manifest file (None when it cannot be read): what binds a marker or a
    probe record to the checkpoint it was written for."""
    import crc32c

    p = Path(root) / step_dir_name(step) / MANIFEST_NAME
    try:
        return int(crc32c.crc32c(read_bounded(p, MAX_MANIFEST_BYTES, what="manifest")))
    except OSError:
        return None


def suspect_reason(root: str | os.PathLike[str], step: int) -> str | None:
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


def mark_suspect(
    root: str | os.PathLike[str], step: int, reason: str, *, by: str = "trainguard", fsync: bool = True
) -> bool:
    """Mark ``step`` suspect (atomically replacing an earlier marker). Returns False when the step directory
    is gone or the root is not writable (the marker is advisory: nothing else changes)."""
    p = marker_path(root, step)
    if not p.parent.is_dir():
        return False
    body = {"reason": str(reason), "by": by, "time": iso(), "manifest_crc32c": manifest_crc(root, step)}
    try:
        atomic_write(p, json.dumps(body).encode(), fsync=fsync)
    except OSError:
        return False
    return True


def clear_suspect(root: str | os.PathLike[str], step: int) -> bool:
    """Remove the suspect marker of ``step``. Returns True when one was removed."""
    try:
        os.unlink(marker_path(root, step))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True
