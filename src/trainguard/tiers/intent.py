"""Upload intent: a small marker per (tier, step) in the hot root, so that any process sees ``"uploading"``.

``<hot>/tier-uploads/<tier id>-step-NNNNNNNNN.json`` (``tier id``: the first 12 hex digits of the SHA-256 of
the tier's key) holds ``{"tier", "step", "host", "pid", "time"}``. It is written (atomically, durably, no
symlink followed) when a step is queued for a tier, before anything is sent, and removed once the tier's
manifest is committed. ``trainguard ls HOT --json`` in another process reads it: a step whose manifest the
tier does not hold yet shows ``"uploading"`` while the marker names a live writer (a writer on another host is
taken as live), ``"missing"`` once that writer is gone (a new manager with the same tiers sends it again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path

from ..format import step_dir_name
from ..format.layout import parse_step_dir
from ..storage.local import atomic_write
from ..storage.safeio import ensure_dir, read_bounded

log = logging.getLogger("trainguard")
INTENT_DIR = "tier-uploads"
MAX_INTENT_BYTES = 4096


def tier_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _path(hot: Path, key: str, step: int) -> Path:
    return hot / INTENT_DIR / f"{tier_id(key)}-{step_dir_name(step)}.json"


def mark(hot: Path, key: str, step: int, *, fsync: bool = True) -> None:
    """Record that ``step`` is to be sent to the tier ``key`` (best effort: a read-only hot root logs)."""
    body = {"tier": key, "step": step, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    try:
        ensure_dir(hot / INTENT_DIR, what="upload intent directory")
        atomic_write(_path(hot, key, step), json.dumps(body).encode(), fsync=fsync)
    except OSError as e:
        log.warning("cannot record the upload of step %d to %s in %s: %s", step, key, hot, e)


def clear(hot: Path, key: str, step: int) -> None:
    """Remove the marker once the tier's manifest of ``step`` is committed."""
    try:
        _path(hot, key, step).unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove the upload marker of step %d for %s: %s", step, key, e)


def _writer_alive(body: dict[str, object]) -> bool:
    if body.get("host") != socket.gethostname():
        return True  # another host's process cannot be checked from here
    pid = body.get("pid")
    if not isinstance(pid, int):
        return False
    from .._lock import _alive

    return _alive(pid)


def uploading(hot: Path, key: str) -> set[int]:
    """Steps the tier ``key`` is recorded as receiving from a live writer (markers of dead writers: not)."""
    prefix = f"{tier_id(key)}-"
    try:
        names = os.listdir(hot / INTENT_DIR)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    out: set[int] = set()
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".json")):
            continue
        parsed = parse_step_dir(name[len(prefix) : -len(".json")])
        if parsed is None or parsed[1]:
            continue
        try:
            body = json.loads(read_bounded(hot / INTENT_DIR / name, MAX_INTENT_BYTES, what="upload marker"))
        except (OSError, ValueError):
            continue  # a marker being replaced, or not ours
        if isinstance(body, dict) and body.get("tier") == key and _writer_alive(body):
            out.add(parsed[0])
    return out
