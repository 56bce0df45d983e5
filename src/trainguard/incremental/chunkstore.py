"""Content-addressed chunk store under ``<run root>/chunks/``.

A chunk's name is the xxh3-128 hash of its bytes; its CRC32C and length go into the manifest. Writing a chunk
that already exists with the right length is skipped (identical tensors are written once across checkpoints).
New chunks are written to a temporary file in the save's partial directory, fsynced, and renamed into place,
so a chunk file under ``chunks/`` is always complete.

Invariants for garbage collection: a chunk referenced by a save in progress is *pinned* from the moment the
save decides to reference it until it commits or fails; :meth:`ChunkStore.collect` never deletes a pinned chunk.
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import crc32c
import xxhash

from ..errors import CorruptCheckpointError
from ..format import CHUNKS_DIR, ChunkRecord, chunk_relpath
from ..storage import local as _local
from ..storage.local import fsync_dir, raise_if_full


def content_hash(buf: memoryview | bytes) -> str:
    """xxh3-128 hex digest (32 hex digits) of ``buf``."""
    return xxhash.xxh3_128_hexdigest(buf)


class ChunkStore:
    """Chunks of one run root.

    Args:
        root: the run root directory.
        fsync: fsync chunk files and directories (default True; False only for tests and benchmarks that
            measure without durability).

    Thread-safe: ``put`` may run from many threads at once.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.dir = self.root / CHUNKS_DIR
        self.fsync = fsync
        self._lock = threading.Lock()
        self._pins: Counter[str] = Counter()
        self._dirty_dirs: set[Path] = set()

    # -- writing ------------------------------------------------------------------------------------------
    def put(
        self, buf: memoryview | bytes, tmp_dir: Path, *, step: int | None = None
    ) -> tuple[ChunkRecord, bool]:
        """Store ``buf`` as a chunk; pins it. Returns ``(record, written)`` (written False when deduplicated).

        Raises:
            StorageFullError: ENOSPC while writing.
        """
        view = memoryview(buf).cast("B")
        h = content_hash(view)
        rel = chunk_relpath(h)
        rec = ChunkRecord(h, rel, len(view), crc32c.crc32c(view), "raw")
        final = self.root / rel
        with self._lock:
            self._pins[h] += 1
        try:
            if final.is_file() and final.stat().st_size == len(view):
                try:
                    os.utime(final)  # "in use": distributed GC spares recently modified chunks
                except OSError:
                    pass
                return rec, False
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = tmp_dir / f"{h}.{threading.get_ident():x}.{secrets.token_hex(3)}.tmp"  # unique per writer
            try:
                _local.write_file(tmp, view, fsync=self.fsync)  # via the module: one seam for fault injection
                os.replace(tmp, final)
            except OSError as e:
                try:
                    tmp.unlink()
                except OSError:
                    pass
                raise_if_full(e, final, step)
            with self._lock:
                self._dirty_dirs.add(final.parent)
            return rec, True
        except BaseException:
            self.unpin([h])
            raise

    def sync(self) -> None:
        """fsync every chunk directory touched since the last call (after all puts, before the commit)."""
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        if not self.fsync:
            return
        for d in dirs:
            fsync_dir(d)
        if dirs:
            fsync_dir(self.dir)

    def unpin(self, hashes: Iterable[str]) -> None:
        with self._lock:
            for h in hashes:
                self._pins[h] -= 1
                if self._pins[h] <= 0:
                    del self._pins[h]

    # -- reading ------------------------------------------------------------------------------------------
    def path(self, rec: ChunkRecord) -> Path:
        return self.root / rec.path

    def check_present(self, rec: ChunkRecord) -> str | None:
        """Cheap check (no read): None if the chunk exists with the right length, else the problem."""
        p = self.root / rec.path
        try:
            st = p.stat()
        except FileNotFoundError:
            return "is missing"
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        if st.st_size != rec.length:
            return f"has the wrong length ({st.st_size} bytes, expected {rec.length})"
        return None

    def read(
        self, rec: ChunkRecord, *, step: int | None = None, owners: list[str] | None = None
    ) -> bytearray:
        """Read a whole chunk and check its length and CRC32C.

        Raises:
            CorruptCheckpointError: missing, unreadable, wrong length or CRC32C mismatch, naming the chunk and
                its tensors.
        """
        bad = self.check_present(rec)  # before allocating: the recorded length could be absurd
        if bad is not None:
            raise self._corrupt(rec, bad, step, owners, damaged="length" in bad)
        buf = bytearray(rec.length)
        self.readinto(rec, memoryview(buf), step=step, owners=owners)
        return buf

    def readinto(
        self, rec: ChunkRecord, out: memoryview, *, step: int | None = None, owners: list[str] | None = None
    ) -> None:
        """Read a whole chunk into ``out`` (exactly ``rec.length`` bytes) and check it."""
        out = out.cast("B") if out.format != "B" else out
        p = self.root / rec.path
        try:
            with open(p, "rb", buffering=0) as f:
                got = 0
                while got < rec.length:
                    n = f.readinto(out[got : rec.length])
                    if not n:
                        break
                    got += n
                extra = f.read(1)
        except FileNotFoundError:
            raise self._corrupt(rec, "is missing", step, owners) from None
        except OSError as e:
            raise self._corrupt(rec, f"cannot be read ({e.strerror or e})", step, owners) from None
        if got != rec.length or extra:
            raise self._corrupt(
                rec, f"has the wrong length (expected {rec.length} bytes)", step, owners, damaged=True
            )
        actual = crc32c.crc32c(out[: rec.length])
        if actual != rec.crc32c:
            raise self._corrupt(
                rec,
                f"fails CRC32C (stored {rec.crc32c:#010x}, read {actual:#010x})",
                step,
                owners,
                damaged=True,
            )

    def verify(
        self,
        rec: ChunkRecord,
        *,
        step: int | None = None,
        owners: list[str] | None = None,
        block_bytes: int = 16 << 20,
    ) -> None:
        """Re-read a chunk in blocks (bounded memory) and check length and CRC32C."""
        p = self.root / rec.path
        crc = 0
        total = 0
        buf = bytearray(min(block_bytes, max(rec.length, 1)))
        view = memoryview(buf)
        try:
            with open(p, "rb", buffering=0) as f:
                while True:
                    n = f.readinto(view)
                    if not n:
                        break
                    crc = crc32c.crc32c(view[:n], crc)
                    total += n
        except FileNotFoundError:
            raise self._corrupt(rec, "is missing", step, owners) from None
        except OSError as e:
            raise self._corrupt(rec, f"cannot be read ({e.strerror or e})", step, owners) from None
        if total != rec.length:
            raise self._corrupt(
                rec,
                f"has the wrong length ({total} bytes, expected {rec.length})",
                step,
                owners,
                damaged=True,
            )
        if crc != rec.crc32c:
            raise self._corrupt(
                rec, f"fails CRC32C (stored {rec.crc32c:#010x}, read {crc:#010x})", step, owners, damaged=True
            )

    @staticmethod
    def _corrupt(
        rec: ChunkRecord, what: str, step: int | None, owners: list[str] | None, *, damaged: bool = False
    ) -> CorruptCheckpointError:
        names = ", ".join((owners or [])[:8]) + (" ..." if owners and len(owners) > 8 else "")
        where = f" of step {step}" if step is not None else ""
        return CorruptCheckpointError(
            f"chunk {rec.path}{where} {what}" + (f"; it holds {names}" if names else ""),
            step=step,
            chunk=rec.path,
            tensors=owners,
            damaged=damaged,
        )

    def quarantine(self, rel: str) -> str | None:
        """Move a chunk found corrupt aside (``<hash>.corrupt-<time>``) so the next save that needs the same
        content writes it anew instead of deduplicating against damaged bytes. Returns the new path."""
        src = self.root / rel
        dst = src.with_name(f"{src.name}.corrupt-{int(time.time())}")
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            return None
        return str(dst.relative_to(self.root))

    # -- garbage collection -------------------------------------------------------------------------------
    def all_hashes(self) -> set[str]:
        out: set[str] = set()
        if not self.dir.is_dir():
            return out
        for sub in self.dir.iterdir():
            if sub.is_dir():
                out.update(f.name for f in sub.iterdir() if len(f.name) == 32)
        return out

    def collect(
        self, candidates: Iterable[str], referenced: set[str], *, protect_newer_than: float | None = None
    ) -> int:
        """Delete chunks in ``candidates`` that are not in ``referenced``, not pinned, and (when
        ``protect_newer_than`` is given, seconds since the epoch) not modified after that time. Returns bytes
        freed. A failed deletion is skipped, never fatal: the chunk is only garbage.
        """
        freed = 0
        for h in set(candidates) - referenced:
            p = self.root / chunk_relpath(h)
            with self._lock:  # a put() pins before it checks existence: check pins and delete atomically
                if h in self._pins:
                    continue
                try:
                    st = p.stat()
                    if protect_newer_than is not None and st.st_mtime > protect_newer_than:
                        continue
                    p.unlink()
                    freed += st.st_size
                except OSError:
                    continue
        return freed
