"""A hot root's :class:`~trainguard.storage.Storage` with a checkpoint fetched from a tier laid over it in memory.

Restore from a tier (or a URL run root) reads the chunks the hot root lacks straight from the store into memory
(in parallel, each checked against its CRC32C), and the loader reads them from there through this overlay:
the hot root's disk is not on the restore's critical path. The same bytes are written to the hot root in the
background afterwards (chunks first, the manifest last: the hot root's commit protocol), see
:mod:`trainguard.tiers.repair`.

Reads of a key held in memory are served from memory; every other call (writes included) goes to the hot root.
Listings show the union of both, so the step fetched lists as committed while its manifest is only in memory.
"""

from __future__ import annotations

import io
import time
from typing import Any

from ..errors import UnsafeFileError
from ..storage.base import Entry, ObjectInfo, Storage


class MemoryOverlay:
    """``base`` with ``files`` (key -> bytes, checked by the caller) laid over it, read-only.

    Args:
        base: the hot root's storage (every write and every other key goes there).
        files: keys (``chunks/ab/<hash>``, ``step-N/manifest.json``) -> their bytes.
    """

    def __init__(self, base: Storage, files: dict[str, bytes]) -> None:
        self.base = base
        self.files = files
        self._t = time.time()

    def __getattr__(self, name: str) -> Any:  # every method not overridden: the hot root's
        return getattr(self.base, name)

    def _info(self, key: str) -> ObjectInfo:
        data = self.files[key]
        return ObjectInfo(key, "file", len(data), self._t, ("memory", id(data), len(data)))

    def _is_dir(self, key: str) -> bool:
        p = key.rstrip("/") + "/"
        return any(k.startswith(p) for k in self.files)

    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        if key not in self.files:
            return self.base.read(key, limit_bytes=limit_bytes, what=what)
        data = self.files[key]
        if len(data) > limit_bytes:
            raise UnsafeFileError(f"{what} {key} is {len(data)} bytes, more than {limit_bytes}")
        return data

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        if key not in self.files:
            return self.base.open_read(key, what=what)
        return io.BytesIO(self.files[key]), self._info(key)

    def read_range(self, key: str, offset: int, out: memoryview) -> int:
        if key not in self.files:
            return self.base.read_range(key, offset, out)
        part = memoryview(self.files[key])[offset : offset + len(out)]
        out[: len(part)] = part
        return len(part)

    def stat(self, key: str) -> ObjectInfo | None:
        if key in self.files:
            return self._info(key)
        info = self.base.stat(key)
        if info is None and self._is_dir(key):
            return ObjectInfo(key.rstrip("/"), "dir", 0, self._t, ("memory",))
        return info

    def exists(self, key: str) -> bool:
        return key in self.files or self._is_dir(key) or self.base.exists(key)

    def list(self, prefix: str = "") -> list[Entry]:
        out = {e.name: e for e in self.base.list(prefix)}
        p = prefix.rstrip("/") + "/" if prefix else ""
        for k in self.files:
            if k.startswith(p):
                name, sep, _ = k[len(p) :].partition("/")
                if name not in out:
                    out[name] = Entry(name, bool(sep))
        return list(out.values())
