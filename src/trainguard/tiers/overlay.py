"""What a restore with tiers reads through: the hot root with the tiers' checkpoints laid over it.

A restore with tiers reads each chunk as the loader asks for it, straight into the destination tensor's memory:
from the hot root when the hot root holds it with the recorded length and CRC32C, else from the first tier (in
order) that does (:class:`TierChunkStore`). Every byte loaded is checked against its CRC32C exactly once, where
it was read; nothing is fetched ahead and then read again, so the fetch and the load overlap (a chunk is in its
tensor while the next ones are still on the wire).

:class:`TierOverlay` is the hot root's :class:`~trainguard.storage.Storage` with the steps committed on a tier
listed beside the hot root's own: the manifest of a step the hot root lacks is read from the first tier where
it parses. The restore's own loop (:func:`trainguard._restore.restore_latest`) then walks every step of the hot
root and of the tiers, newest first, and falls back to an older one when a chunk is intact nowhere. Writes go to
the hot root, except advisory records (check, corrupt marker) of a step the hot root does not hold.

The chunks read from a tier are kept (bytes, tier) and written to the hot root in the background once the
restore returned (:func:`trainguard.tiers.repair.write_hot`): the hot root's disk is not on the critical path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import crc32c

from ..errors import CorruptCheckpointError, TrainguardError
from ..format import MANIFEST_NAME, manifest_from_json, step_dir_name
from ..format.layout import parse_step_dir
from ..format.manifest import ChunkRecord
from ..incremental.chunkstore import ChunkStore
from ..storage.base import Entry, ObjectInfo, Storage
from .upload import POOL_WORKERS, TierLink

log = logging.getLogger("trainguard")


class TierOverlay:
    """``base`` (the hot root) with the steps committed on ``links`` (and not on the hot root) listed too.

    Args:
        base: the hot root's storage (every write and every other key goes there).
        tier_steps: step -> ``(tier, size of the manifest there)`` for every tier, in restore order, that lists
            its manifest (from one listing per tier).
    """

    def __init__(self, base: Storage, tier_steps: dict[int, list[tuple[TierLink, int]]]) -> None:
        self.base = base
        self.tier_steps = tier_steps
        self.dirs = {step_dir_name(s): s for s in tier_steps}
        self.manifests: dict[int, bytes] = {}  # tier manifests read (bytes as published on the tier)
        self._lock = threading.Lock()
        self._t = time.time()

    def __getattr__(self, name: str) -> Any:  # every method not overridden: the hot root's
        return getattr(self.base, name)

    # -- the tiers' manifests ------------------------------------------------------------------------------
    def _manifest_step(self, key: str) -> int | None:
        """The step whose manifest ``key`` names when a tier holds it, else None."""
        d, _, leaf = key.partition("/")
        step = self.dirs.get(d)
        return step if step is not None and leaf == MANIFEST_NAME else None

    def _hot_has(self, key: str) -> bool:
        try:
            info = self.base.stat(key)
        except OSError:
            return False
        return info is not None

    def tier_manifest(self, step: int) -> bytes | None:
        """The manifest of ``step`` from the first tier where it parses (or, when none parses, the first one
        read: the loader then reports it corrupt); None when no tier can be read."""
        with self._lock:
            if step in self.manifests:
                return self.manifests[step]
        first: bytes | None = None
        for link, size in self.tier_steps.get(step, []):
            try:
                data = link.remote.manifest_bytes(step, size)
            except (OSError, TrainguardError) as e:
                log.warning("reading the manifest of step %d from %s failed: %s", step, link.key, e)
                continue
            first = data if first is None else first
            try:
                manifest_from_json(data, expect_step=step)
            except TrainguardError:
                continue
            first = data
            break
        if first is not None:
            with self._lock:
                self.manifests[step] = first
        return first

    def _served(self, key: str) -> bytes | None:
        """The bytes this overlay serves for ``key`` (a tier manifest the hot root lacks), else None."""
        step = self._manifest_step(key)
        if step is None or self._hot_has(key):
            return None
        return self.tier_manifest(step)

    # -- Storage reads ----------------------------------------------------------------------------------------
    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        data = self._served(key)
        if data is None:
            return self.base.read(key, limit_bytes=limit_bytes, what=what)
        if len(data) > limit_bytes:
            from ..errors import UnsafeFileError

            raise UnsafeFileError(f"{what} {key} is {len(data)} bytes, more than {limit_bytes}")
        return data

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        data = self._served(key)
        if data is None:
            return self.base.open_read(key, what=what)
        import io

        return io.BytesIO(data), self._info(key, data)

    def _info(self, key: str, data: bytes) -> ObjectInfo:
        return ObjectInfo(key, "file", len(data), self._t, ("tier", id(data), len(data)))

    def stat(self, key: str) -> ObjectInfo | None:
        info = self.base.stat(key)
        if info is not None:
            return info
        if key.rstrip("/") in self.dirs:
            return ObjectInfo(key.rstrip("/"), "dir", 0, self._t, ("tier",))
        data = self._served(key)
        return None if data is None else self._info(key, data)

    def exists(self, key: str) -> bool:
        return self.base.exists(key) or key.rstrip("/") in self.dirs or self._manifest_step(key) is not None

    def list(self, prefix: str = "") -> list[Entry]:
        out = {e.name: e for e in self.base.list(prefix)}
        p = prefix.rstrip("/")
        if not p:
            for d in self.dirs:
                out.setdefault(d, Entry(d, True))
        elif p in self.dirs:
            out.setdefault(MANIFEST_NAME, Entry(MANIFEST_NAME, False))
        return list(out.values())

    # -- Storage writes: advisory records of a step only a tier holds are not written --------------------------
    def _virtual(self, key: str) -> bool:
        d = key.partition("/")[0]
        parsed = parse_step_dir(d)
        return d in self.dirs and parsed is not None and not self._hot_has(d)

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        if self._virtual(key):
            return  # a record of a step only a tier holds: the hot root gets the step (and a check) later
        self.base.publish(key, data, durable=durable)


class TierChunkStore(ChunkStore):
    """A chunk store that reads each chunk from the hot root, else from the first tier holding it intact.

    Every read is checked (length, CRC32C) once, on the bytes read; a chunk intact on no source raises the
    CorruptCheckpointError of the hot root's copy (or "missing on every tier"), so the restore falls back to
    an older step. The chunks read from a tier are kept in :attr:`fetched` for the hot root's repair.

    Args:
        storage: the overlay (the hot root underneath).
        links: the tiers, in order.

    Attributes:
        fetched: chunk key -> (bytes read from a tier and checked, the tier's key).
        hot_ok: chunk keys read from the hot root and found intact.
        read_threads: threads the loader reads chunks with (a GET waits on the network: more than a disk).
    """

    read_threads = POOL_WORKERS

    def __init__(self, storage: Storage, links: list[TierLink]) -> None:
        super().__init__(storage)
        self.links = links
        self.fetched: dict[str, tuple[bytes, str]] = {}
        self.hot_ok: set[str] = set()

    def taken(self) -> tuple[dict[str, tuple[bytes, str]], set[str]]:
        """A snapshot of ``(fetched, hot_ok)``."""
        with self._lock:
            return dict(self.fetched), set(self.hot_ok)

    def check_present(self, rec: ChunkRecord) -> str | None:
        bad = super().check_present(rec)
        if bad is not None and self.links and not bad.startswith("cannot be read"):
            return None  # a tier may hold it: the read checks (a chunk intact nowhere fails the load there)
        return bad

    def verify(
        self, rec: ChunkRecord, *, step: int | None = None, owners: list[str] | None = None, **kw: Any
    ) -> tuple[Any, ...] | None:
        """Check the chunk where the load will read it (``verify_before_load``): on the hot root (returns the
        version checked, as :meth:`ChunkStore.verify`), else read from the first tier holding it intact and
        kept in :attr:`fetched` (the load then copies it, not read again; returns None)."""
        version: list[tuple[Any, ...] | None] = [None]

        def hot() -> None:
            version[0] = ChunkStore.verify(self, rec, step=step, owners=owners, **kw)

        intact, hot_err = self._on_hot(rec, hot)
        if not intact:
            self._from_tiers(rec, step, owners, hot_err)
            return None
        return version[0]

    def readinto(
        self,
        rec: ChunkRecord,
        out: memoryview,
        *,
        step: int | None = None,
        owners: list[str] | None = None,
        scan: Callable[[memoryview], int] | None = None,
        checked: tuple[Any, ...] | None = None,
    ) -> int | None:
        """As :meth:`ChunkStore.readinto`; ``scan`` runs only on the hot root's read (None is returned for a
        chunk copied from a tier: the caller scans it whole)."""
        out = out.cast("B") if out.format != "B" else out
        with self._lock:
            kept = self.fetched.get(rec.path)
        if kept is not None:  # read and checked before (verify_before_load, or a chunk shared by two regions)
            out[: rec.length] = kept[0]
            return None
        scanned: list[int | None] = [None]

        def hot() -> None:
            scanned[0] = ChunkStore.readinto(
                self, rec, out, step=step, owners=owners, scan=scan, checked=checked
            )

        intact, hot_err = self._on_hot(rec, hot)
        if not intact:
            out[: rec.length] = self._from_tiers(rec, step, owners, hot_err)
            return None
        return scanned[0]

    def _on_hot(
        self, rec: ChunkRecord, read: Callable[[], None]
    ) -> tuple[bool, CorruptCheckpointError | None]:
        """Run ``read`` (a checked read of ``rec`` from the hot root) when the hot root holds the chunk.

        Returns:
            ``(True, None)``: read and intact (recorded in :attr:`hot_ok`); ``(False, error)``: the hot copy is
            corrupt; ``(False, None)``: the hot root does not hold it.
        """
        if ChunkStore.check_present(self, rec) is not None:
            return False, None
        try:
            read()
        except CorruptCheckpointError as e:
            return False, e
        with self._lock:
            self.hot_ok.add(rec.path)
        return True, None

    def _from_tiers(
        self,
        rec: ChunkRecord,
        step: int | None,
        owners: list[str] | None,
        hot_err: CorruptCheckpointError | None,
    ) -> bytes:
        """The chunk's bytes from the first tier holding it with the recorded length and CRC32C (kept in
        :attr:`fetched`); raises ``hot_err`` (the hot root's problem) or "intact on no tier" when none does."""
        problems = []
        for link in self.links:
            try:
                data = link.store.get(rec.path)
            except FileNotFoundError:
                problems.append(f"missing on {link.key}")
                continue
            except (OSError, TrainguardError) as e:
                log.warning("reading chunk %s from %s failed: %s", rec.path, link.key, e)
                problems.append(f"unreadable on {link.key}")
                continue
            if len(data) != rec.length:
                problems.append(f"corrupt on {link.key}: {len(data)} bytes, expected {rec.length}")
            elif crc32c.crc32c(data) != rec.crc32c:
                problems.append(f"corrupt on {link.key}: fails CRC32C")
            else:
                with self._lock:
                    self.fetched[rec.path] = (data, link.key)
                return data
            log.warning("chunk %s: %s", rec.path, problems[-1])
        if hot_err is not None:
            raise hot_err
        damaged = any(p.startswith("corrupt") for p in problems)
        raise self._corrupt(
            rec,
            f"is intact on no tier ({', '.join(problems) or 'no tier'}) and not on the hot root",
            step,
            owners,
            damaged=damaged,
        )
