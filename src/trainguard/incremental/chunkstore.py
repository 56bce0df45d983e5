"""Content-addressed chunk store under ``<run root>/chunks/``.

A chunk's name is the xxh3-128 hash of its bytes; its CRC32C and length go into the manifest. Writing a chunk
that already exists with the right length is skipped (identical tensors are written once across checkpoints).
New chunks are written to a temporary file in the save's partial directory, made durable, and renamed into
place, so a chunk file under ``chunks/`` is always complete and durable (deduplication against it is safe after
a machine crash). Durability is batched (each chunk's writeback starts as soon as it is written
(``sync_file_range``), then :meth:`ChunkStore.sync` makes every temporary file of the save durable with one
``syncfs(2)`` of the run root's filesystem, renames them all and syncs again; one journal commit instead of
one per file), per file (``fsync`` of each temporary file in ``put`` and of each touched directory in
``sync``), or auto (the default: staged as batched; ``sync`` uses ``syncfs`` only when the node holds no more
dirty data than the save's own chunks, else fsyncs each temporary file).

Invariants for garbage collection: a chunk referenced by a save in progress is *pinned* from the moment the
save decides to reference it until it commits or fails; :meth:`ChunkStore.collect` never deletes a pinned chunk.

Invariant for deduplication: a save never references stored bytes that this store has not verified since they
were written or since the store was opened. A chunk this store wrote, or read back with a matching CRC32C, is
remembered together with its file's identity (inode, size, mtime, ctime); any other existing chunk, or one whose
file changed since, is re-read and its CRC32C compared with that of the bytes being saved before the save
references it. A mismatch (or an unreadable file) is repaired: the chunk is written anew from the bytes being
saved, which also repairs every older checkpoint that shares it.

Reads retry an I/O error (``READ_ATTEMPTS``) and confirm a CRC32C or length mismatch with a second read; only a
confirmed mismatch is reported as damage (``CorruptCheckpointError.damaged``), an I/O error that persists is
reported as ``unreadable`` and never condemns a chunk.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable
from pathlib import Path
from typing import Any

import crc32c
import xxhash

from .._prefault import populate_for_write, unmapped
from ..errors import CorruptCheckpointError, StateMismatchError, StorageFullError, UnsafeFileError
from ..format import CHUNKS_DIR, ChunkRecord, chunk_relpath
from ..storage.base import ObjectInfo, Staged, Storage
from ..storage.local import DURABILITY_MODES, LocalStorage
from ..storage.retry import READ_ATTEMPTS, READ_RETRY_BACKOFF_S
from ..storage.safeio import read_full
from .codecs import Encoding

log = logging.getLogger("trainguard")
# An I/O error (EACCES, EIO, a TransientStorageError, ...) is retried READ_ATTEMPTS times in all, with a first
# backoff of READ_RETRY_BACKOFF_S doubling each time (as every read of committed data: storage/retry.py); a CRC32C
# or length mismatch is confirmed by one more read before it condemns a chunk.
CRC_BLOCK_BYTES = 1 << 20
"""Bytes per ``readinto`` call of a checked read: each block's CRC32C is computed right after the read, while
the block is still in the CPU's L2 cache, instead of reading a whole chunk back from memory afterwards (a
verify pass copies into one cache-sized buffer: its memory traffic is the page cache's bytes read once)."""


def content_hash(buf: memoryview | bytes, recipe: bytes = b"") -> str:
    """xxh3-128 hex digest (32 hex digits) of ``buf`` followed by ``recipe`` (an encoded chunk's decoding
    recipe, so that one name always means one decoded content; empty for raw chunks)."""
    if not recipe:
        return xxhash.xxh3_128_hexdigest(buf)
    x = xxhash.xxh3_128(buf)
    x.update(recipe)
    return x.hexdigest()


MOVED_ASIDE = "was found corrupt by a restore and moved aside (quarantined)"
"""How a chunk that a restore quarantined is described where it is missing (never just "is missing")."""


class ChunkStore:
    """Chunks of one run root, stored through a :class:`~trainguard.storage.base.Storage`.

    Args:
        root: the run root directory, or the :class:`~trainguard.storage.base.Storage` of the run root.
        fsync: make chunk files and directories durable (default True; False only for tests and benchmarks
            that measure without durability). Used when ``root`` is a directory.
        durability: ``"auto"`` (default) or ``"batched"``: new chunks become visible under ``chunks/``
            only in :meth:`sync`, made durable by one ``syncfs(2)`` (``"auto"``: only when the node holds
            no more dirty data than the size of the save's own chunks, else an fsync per chunk file);
            ``"per_file"``: each chunk fsynced and renamed into place by ``put``. ``syncfs`` also flushes
            other processes' dirty data on the same filesystem. See
            :class:`~trainguard.storage.local.LocalStorage`. Used when ``root`` is a directory.
        direct_io: write chunk files of at least 1 MiB around the page cache (``O_DIRECT``; default True).
            See :class:`~trainguard.storage.local.LocalStorage`. Used when ``root`` is a directory.

    Raises:
        ValueError: an unknown ``durability``, or a ``direct_io`` that is not a bool.

    Thread-safe: ``put`` may run from many threads at once.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        fsync: bool = True,
        durability: str = "auto",
        direct_io: bool = True,
    ) -> None:
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        if isinstance(root, (str, os.PathLike)):
            self.storage: Storage = LocalStorage(
                root, fsync=fsync, durability=durability, direct_io=direct_io
            )
        else:
            self.storage = root
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._staged: list[Staged] = []  # written by put, made durable and visible by sync
        self._verified: dict[str, tuple[Any, ...]] = {}  # hash -> object version when verified
        self.repaired: list[str] = []  # chunks found damaged or unreadable by a save and written anew
        self.last_progress = time.monotonic()  # a chunk stored or deleted, a flush finished (stall watchdog)
        self._io_streak = 0  # chunks in a row that could not be read: then no more retries (bounded scrubs)

    # -- verified-bytes memory ----------------------------------------------------------------------------
    def _remember(self, h: str, info: ObjectInfo | None) -> None:
        if info is None:
            return
        with self._lock:
            self._verified[h] = info.version

    def _forget(self, h: str) -> None:
        with self._lock:
            self._verified.pop(h, None)

    def is_verified(self, h: str, info: ObjectInfo) -> bool:
        """True when this store wrote or read back chunk ``h`` with matching bytes and its object is unchanged
        (same :attr:`ObjectInfo.version`)."""
        with self._lock:
            return self._verified.get(h) == info.version

    def _stat(self, key: str) -> ObjectInfo | None:
        try:
            return self.storage.stat(key)
        except OSError:
            return None

    def _reusable(self, rec: ChunkRecord) -> bool:
        """Whether the stored chunk holds exactly ``rec``'s bytes (verified now if not remembered)."""
        info = self._stat(rec.path)  # a symlink or an odd file there is no copy of this content
        if info is None or not info.is_file or info.size != rec.length:
            return False
        if not self.is_verified(rec.hash, info):
            try:
                self.verify(rec, attempts=1)
            except CorruptCheckpointError as e:
                log.warning(
                    "chunk %s under %s %s; writing it anew from the bytes being saved (this also repairs the "
                    "older checkpoints that share it)",
                    rec.path,
                    self.storage.url,
                    str(e).split(f"chunk {rec.path} ", 1)[-1],
                )
                with self._lock:
                    self.repaired.append(rec.path)
                return False
        try:
            self.storage.touch(rec.path)  # "in use": distributed GC spares recently modified chunks
            self._remember(rec.hash, self.storage.stat(rec.path))
        except OSError:
            pass
        return True

    def layout_problem(self) -> str | None:
        """Why chunks saved here would be refused by restore (checked before a manager's first save), else None:
        ``chunks`` itself may be a symlink to a directory anywhere, but a ``chunks/<2 hex>`` directory that
        leads out of it would hold chunks whose paths resolve outside the chunk store."""
        local = self.storage.local_path
        if local is None:
            return None
        d = local / CHUNKS_DIR
        if d.is_symlink() and not d.exists():
            return f"{d} is a symlink to {os.readlink(d)!r}, which does not exist"
        if d.exists() and not d.is_dir():
            return f"{d} exists but is not a directory"
        if not d.is_dir():
            return None
        d_real = Path(os.path.realpath(d))
        for sub in d.iterdir():
            if sub.is_symlink():
                real = Path(os.path.realpath(sub))
                if d_real not in real.parents:
                    return (
                        f"{sub} is a symlink to {real}, outside {d_real}: restore would refuse every "
                        "chunk saved there; move the whole chunks directory instead (a symlink at chunks/ is "
                        "supported)"
                    )
        return None

    # -- writing ------------------------------------------------------------------------------------------
    def staging_for(self, partial: str) -> str:
        """The staging prefix (a key) where a save whose partial directory is ``partial`` writes its new
        chunks before :meth:`sync`: ``partial`` itself, or a sibling under ``chunks/`` when that lives on
        another filesystem (a rename cannot cross filesystems)."""
        return self.storage.staging_prefix(partial, CHUNKS_DIR)

    def pin(self, hashes: Iterable[str]) -> None:
        """Pin chunks a save references without writing them (e.g. delta bases); undo with :meth:`unpin`."""
        with self._lock:
            for h in hashes:
                self._pins[h] += 1

    def reuse(self, rec: ChunkRecord) -> bool:
        """Pin ``rec`` and return True when its stored object holds exactly its bytes (verified as for
        deduplication), else unpin it and return False (the caller writes the content anew)."""
        self.pin([rec.hash])
        try:
            ok = self._reusable(rec)
        except BaseException:
            self.unpin([rec.hash])
            raise
        if not ok:
            self.unpin([rec.hash])
        return ok

    def put(
        self,
        buf: memoryview | bytes,
        staging: str,
        *,
        step: int | None = None,
        encoding: Encoding | None = None,
        raw_hash: str | None = None,
    ) -> tuple[ChunkRecord, bool]:
        """Store ``buf`` as a chunk; pins it. Returns ``(record, written)`` (written False when deduplicated).

        Args:
            buf: the chunk's stored bytes.
            staging: the staging prefix of the save (:meth:`staging_for`).
            step: the step being saved, for error messages.
            encoding: how ``buf`` decodes (None: raw bytes).
            raw_hash: :func:`content_hash` of ``buf`` when the caller already computed it (raw chunks only:
                ignored for an encoded one), so the bytes are hashed once.

        Raises:
            StorageFullError: ENOSPC while writing.
        """
        view = memoryview(buf).cast("B")
        enc = encoding or Encoding(size=len(view))
        recipe = enc.recipe()
        h = raw_hash if raw_hash and not recipe else content_hash(view, recipe)
        rel = chunk_relpath(h)
        if recipe:
            rec = ChunkRecord(
                h, rel, len(view), crc32c.crc32c(view), enc.codec, enc.size, enc.base, enc.delta, enc.word
            )
        else:
            rec = ChunkRecord(h, rel, len(view), crc32c.crc32c(view), "raw")
        with self._lock:
            self._pins[h] += 1
        try:
            if self._reusable(rec):
                self.last_progress = time.monotonic()
                return rec, False
            try:
                staged = self.storage.stage(rel, view, staging=staging)
            except StorageFullError as e:
                if e.step is None:
                    e.step = step
                raise
            if staged.token is None:  # already visible (per-file durability, object stores)
                self._remember(h, self._stat(rel))
            with self._lock:
                self._staged.append(staged)
            self.last_progress = time.monotonic()
            return rec, True
        except BaseException:
            self.unpin([h])
            raise

    def sync(self, *, step: int | None = None) -> None:
        """Make every chunk written since the last call durable and visible under ``chunks/`` (after all
        puts, before the commit): :meth:`Storage.commit_staged <trainguard.storage.base.Storage.commit_staged>`.

        Raises:
            StorageFullError: ENOSPC or EDQUOT while flushing.
            OSError: the flush failed (e.g. EIO); nothing of this save is renamed into ``chunks/`` then.
        """
        with self._lock:
            staged, self._staged = self._staged, []
        self.last_progress = time.monotonic()
        try:
            self.storage.commit_staged(staged)
        except StorageFullError as e:
            if e.step is None:
                e.step = step
            raise
        for s in staged:
            if s.token is not None:
                self._remember(s.key.rsplit("/", 1)[-1], self._stat(s.key))

    def drop_unpublished(self, staging: str) -> None:
        """Forget the staged chunks written under ``staging`` by a save that failed before :meth:`sync`
        (their temporary files go with the save's partial directory)."""
        with self._lock:
            dropped = [s for s in self._staged if s.staging == staging]
            self._staged = [s for s in self._staged if s.staging != staging]
        self.storage.discard_staged(dropped)

    def unpin(self, hashes: Iterable[str]) -> None:
        with self._lock:
            for h in hashes:
                self._pins[h] -= 1
                if self._pins[h] <= 0:
                    del self._pins[h]

    # -- reading ------------------------------------------------------------------------------------------
    def check_present(self, rec: ChunkRecord) -> str | None:
        """Cheap check (no read): None if the chunk exists as a regular file (not a symlink) with the right
        length, else the problem."""
        try:
            info = self.storage.stat(rec.path)
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if info is None:
            return self.missing(rec.path)
        if info.kind == "symlink":
            return "is a symlink (chunks are never read through one)"
        if not info.is_file:
            return "is not a regular file"
        if info.size != rec.length:
            return f"has the wrong length ({info.size} bytes, expected {rec.length})"
        return None

    def missing(self, path: str) -> str:
        """Why the chunk ``path`` is not there: ``"is missing"``, or, when a restore quarantined it
        (``<path>.corrupt-<time>``, :meth:`quarantine`), that it was found corrupt and where its bytes are.
        One listing of the chunk's directory, only for a chunk already missing."""
        d, _, name = path.rpartition("/")
        try:
            copies = sorted(e.name for e in self.storage.list(d) if e.name.startswith(f"{name}.corrupt-"))
        except OSError:
            copies = []
        if not copies:
            return "is missing"
        where = self.storage.location(f"{d}/{copies[-1]}")
        return f"{MOVED_ASIDE} to {where}"

    def read(
        self,
        rec: ChunkRecord,
        *,
        step: int | None = None,
        owners: list[str] | None = None,
        checked: tuple[Any, ...] | None = None,
    ) -> bytearray:
        """Read a whole chunk and check its length and CRC32C (``checked``: as :meth:`readinto`).

        Raises:
            CorruptCheckpointError: missing, unreadable, not a regular file, wrong length or CRC32C mismatch,
                naming the chunk and its tensors.
        """
        bad = self.check_present(rec)  # before allocating: the recorded length could be absurd
        if bad is not None:
            raise self._corrupt(
                rec, bad, step, owners, damaged="length" in bad, unreadable=bad.startswith("cannot be read")
            )
        buf = bytearray(rec.length)
        self.readinto(rec, memoryview(buf), step=step, owners=owners, checked=checked)
        return buf

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
        """Read a whole chunk into ``out`` (exactly ``rec.length`` bytes) and check it (retries and
        confirmation as :meth:`verify`).

        The chunk is read in blocks of ``CRC_BLOCK_BYTES``; each block's CRC32C (and ``scan``) runs right after
        its read, while the block is still in the CPU cache. When ``out`` is fresh memory (its first whole page
        not resident: a relaunched job's new tensors), each block's pages are mapped with one
        ``madvise(MADV_POPULATE_WRITE)`` right before its read (:mod:`trainguard._prefault`). A chunk checked
        moments ago (``checked``) with nothing to scan is read in one call instead, unless ``out`` is fresh.

        Args:
            rec: the chunk.
            out: where its bytes go (at least ``rec.length`` bytes).
            step, owners: name the checkpoint and the tensors in an error.
            scan: called with each full block (``CRC_BLOCK_BYTES``) and the chunk's last block as they are
                read; its results are summed (a NaN/Inf count, say).
            checked: the :attr:`ObjectInfo.version` that :meth:`verify` returned for this chunk moments ago
                (the pass before a load). When the file opened now is that same object (same inode, size,
                mtime and ctime), its CRC32C is not computed a second time; the length is still checked.
                Any other file (replaced, rewritten, a tier's copy) is checked in full.

        Returns:
            The sum of ``scan``'s results over the read that passed the check (a retried read's blocks are not
            counted twice); None when ``scan`` is None.

        Raises:
            CorruptCheckpointError: as :meth:`verify`.
        """
        out = out.cast("B") if out.format != "B" else out
        scanned = 0
        fresh = unmapped(out[: rec.length])  # a relaunched job's new tensors: no page of them exists yet

        def once(f: Any, same: bool) -> tuple[int | None, int]:
            nonlocal scanned
            got = crc = scanned = 0
            if same and scan is None and not fresh:  # checked moments ago, nothing to scan: one read
                got = read_full(f, out[: rec.length])
            while got < rec.length:  # block by block: the CRC32C and the scan read it from the cache
                start, end = got, min(rec.length, got + CRC_BLOCK_BYTES)
                if fresh:  # its pages mapped in one call per block, not one fault per page in the read
                    populate_for_write(out[start:end])
                got += read_full(f, out[start:end])
                if got < end:  # shorter than recorded: the length check below reports it
                    break
                block = out[start:end]
                if not same:
                    crc = crc32c.crc32c(block, crc)
                if scan is not None:
                    scanned += scan(block)
            if got != rec.length or f.read(1):
                return None, 0
            return got, rec.crc32c if same else crc

        self._checked_read(rec, once, step, owners, READ_ATTEMPTS, checked=checked, into_memory=True)
        return scanned if scan is not None else None

    def verify(
        self,
        rec: ChunkRecord,
        *,
        step: int | None = None,
        owners: list[str] | None = None,
        block_bytes: int | None = None,
        attempts: int = READ_ATTEMPTS,
        on_block: Callable[[int], None] | None = None,
        scan: Callable[[memoryview], int] | None = None,
        scanned: list[int] | None = None,
    ) -> tuple[Any, ...] | None:
        """Re-read a chunk in blocks (bounded memory) and check length and CRC32C.

        An I/O error is retried (``attempts`` reads in all, with a doubling backoff); a length or CRC32C
        mismatch is confirmed by a second read before it is reported as damage. A chunk that passes is
        remembered as verified (deduplication against it needs no further read while its file is unchanged).

        Args:
            scan: called with each block as it is read (full blocks except the last, as :meth:`readinto`);
                the sum over the read that passed is appended to ``scanned``.

        Returns:
            The :attr:`ObjectInfo.version` of the file that passed (see ``readinto(checked=...)``).

        Raises:
            CorruptCheckpointError: ``damaged`` for a confirmed mismatch, ``unreadable`` for a persisting I/O
                error, neither for a missing chunk or one that is not a regular file.
        """
        buf = bytearray(min(block_bytes or CRC_BLOCK_BYTES, max(rec.length, 1)))
        view = memoryview(buf)

        found = 0

        def once(f: Any, _same: bool) -> tuple[int | None, int]:
            nonlocal found
            crc = total = found = 0
            while True:
                n = f.readinto(view) if scan is None else read_full(f, view)  # a scan needs whole elements
                if not n:
                    break
                crc = crc32c.crc32c(view[:n], crc)
                if scan is not None:
                    found += scan(view[:n])
                total += n
                if on_block is not None:
                    on_block(n)  # a rate cap (``verify --max-bandwidth``) sleeps here
            return total, crc

        version = self._checked_read(rec, once, step, owners, attempts)
        if scan is not None and scanned is not None:
            scanned.append(found)
        return version

    def _checked_read(
        self,
        rec: ChunkRecord,
        once: Any,
        step: int | None,
        owners: list[str] | None,
        attempts: int,
        *,
        checked: tuple[Any, ...] | None = None,
        into_memory: bool = False,
    ) -> tuple[Any, ...]:
        """Run ``once(file, same) -> (length read or None, crc32c)`` on the chunk's file until it matches
        ``rec``, retrying I/O errors and confirming a mismatch by one more read; ``same``: the file is the
        object version ``checked`` (its CRC32C was checked by this process moments ago). Returns the version
        of the file that matched. ``into_memory``: ``once`` reads into the caller's memory (:meth:`readinto`),
        so EFAULT is that memory's problem (StateMismatchError), not the storage's."""
        io_errors = 0
        mismatches = 0
        if self._io_streak >= 3:  # the storage is unreadable, not this chunk: one attempt is enough
            attempts = 1
        while True:
            try:
                # no symlink followed, no blocking open (a named pipe), and the size checked before reading
                f, info = self.storage.open_read(rec.path, what="chunk")
                with f:
                    if info.size != rec.length:  # a sparse 64 GiB file is never read
                        total, crc = info.size, 0
                    else:
                        total, crc = once(
                            f, checked is not None and info.version == checked and not mismatches
                        )
            except FileNotFoundError:
                raise self._corrupt(rec, self.missing(rec.path), step, owners) from None
            except UnsafeFileError as e:
                raise self._corrupt(rec, f"is refused ({e})", step, owners) from None
            except OSError as e:
                if e.errno == errno.EFAULT and into_memory:  # the kernel could not write into ``out``
                    raise StateMismatchError(
                        f"chunk {rec.path}{f' of step {step}' if step is not None else ''} could not be read into "
                        f"its destination ({', '.join(owners) if owners else 'a tensor of the state'}): the "
                        "kernel could not write to that memory (EFAULT: a read-only mapping the restore's check "
                        "did not see, or memory that could not be allocated). The checkpoint is fine; restore "
                        "into writable tensors (.clone() them) or into an empty dict; other tensors of the state "
                        "may already hold its values"
                    ) from None
                io_errors += 1
                if io_errors >= max(1, attempts):
                    self._io_streak += 1
                    raise self._corrupt(
                        rec,
                        f"cannot be read ({e.strerror or e}; {io_errors} attempt(s)); not a checksum mismatch: "
                        "fix access to the storage and retry",
                        step,
                        owners,
                        unreadable=True,
                    ) from None
                time.sleep(READ_RETRY_BACKOFF_S * 2 ** (io_errors - 1))
                continue
            if total != rec.length:
                what = (
                    f"has the wrong length ({total} bytes, expected {rec.length})"
                    if total is not None
                    else f"has the wrong length (expected {rec.length} bytes)"
                )
            elif crc != rec.crc32c:
                what = f"fails CRC32C (stored {rec.crc32c:#010x}, read {crc:#010x})"
            else:
                self._io_streak = 0
                self._remember(rec.hash, info)
                return info.version
            mismatches += 1
            if mismatches >= 2:  # confirmed by a second read: the bytes on storage are wrong
                self._forget(rec.hash)
                raise self._corrupt(rec, what, step, owners, damaged=True)

    @staticmethod
    def _corrupt(
        rec: ChunkRecord,
        what: str,
        step: int | None,
        owners: list[str] | None,
        *,
        damaged: bool = False,
        unreadable: bool = False,
    ) -> CorruptCheckpointError:
        names = ", ".join((owners or [])[:8]) + (" ..." if owners and len(owners) > 8 else "")
        where = f" of step {step}" if step is not None else ""
        return CorruptCheckpointError(
            f"chunk {rec.path}{where} {what}" + (f"; it holds {names}" if names else ""),
            step=step,
            chunk=rec.path,
            tensors=owners,
            damaged=damaged,
            unreadable=unreadable,
        )

    def quarantine(self, rel: str) -> str | None:
        """Move a chunk found corrupt aside (``<hash>.corrupt-<time>``) so the next save that needs the same
        content writes it anew instead of deduplicating against damaged bytes. Returns the new key."""
        self._forget(rel.rsplit("/", 1)[-1])
        dst = f"{rel}.corrupt-{int(time.time())}"
        return dst if self.storage.move(rel, dst) else None

    # -- garbage collection -------------------------------------------------------------------------------
    def all_hashes(self) -> set[str]:
        """Every chunk hash stored under ``chunks/`` (one listing per ``chunks/<2 hex>`` directory)."""
        out: set[str] = set()
        for sub in self.storage.list(CHUNKS_DIR):
            if sub.is_dir:
                out.update(e.name for e in self.storage.list(f"{CHUNKS_DIR}/{sub.name}") if len(e.name) == 32)
        return out

    def collect(
        self,
        candidates: Iterable[str],
        referenced: Container[str],
        *,
        protect_newer_than: float | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> int:
        """Delete chunks in ``candidates`` that are not in ``referenced``, not pinned, and (when
        ``protect_newer_than`` is given, seconds since the epoch) not modified after that time. Returns bytes
        freed. A failed deletion is skipped, never fatal: the chunk is only garbage.

        ``referenced`` is asked again under the store's lock right before each deletion, after the pins: a
        save pins its chunks, then records its manifest's chunks where ``referenced`` sees them, then unpins,
        so a pass running beside it (in the background) never deletes one of them. ``stop``: checked before
        each chunk; True ends the pass there.
        """
        freed = 0
        for h in {h for h in candidates if h not in referenced}:
            key = chunk_relpath(h)
            with self._lock:  # a put() pins before it checks existence: check pins and delete atomically
                if stop is not None and stop():
                    break
                if h in self._pins or h in referenced:
                    continue
                try:
                    info = self.storage.stat(key)
                    if info is None or (protect_newer_than is not None and info.mtime > protect_newer_than):
                        continue
                    self.storage.delete(key)
                    self._verified.pop(h, None)
                    freed += info.size
                    # progress for the stall watchdog: the next save waits for this (background) pass
                    self.last_progress = time.monotonic()
                except OSError:
                    continue
        return freed
