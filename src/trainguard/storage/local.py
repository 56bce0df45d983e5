"""Local POSIX storage (:class:`LocalStorage`) and its primitives, with the durability the commit protocol needs.

Invariants: a file published with :func:`atomic_write` is either absent or complete (tmp + fsync + rename +
directory fsync); ENOSPC surfaces as :class:`~trainguard.errors.StorageFullError` naming the path.

Errors are classified once, here (:func:`classify_error`): ENOSPC/EDQUOT become
:class:`~trainguard.errors.StorageFullError`; the errnos of :data:`TRANSIENT_ERRNOS` (an interrupted or
would-block call, a busy resource, a timeout or a stale handle of a network filesystem, a reset connection)
become :class:`~trainguard.errors.TransientStorageError`, which readers of committed data retry; everything
else (EIO, EACCES, ...) stays the ``OSError`` it was. EIO is not transient here: on a local disk it usually
means a bad medium, and the chunk reader retries any I/O error a bounded number of times anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import secrets
import shutil
import stat
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from ..errors import FULL_ERRNOS, StorageFullError, TransientStorageError
from .base import Entry, ObjectInfo, Staged
from .safeio import open_regular, read_bounded


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so renames and creations inside it survive a machine crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EINTR",
        "EAGAIN",
        "EWOULDBLOCK",
        "EBUSY",
        "ETIMEDOUT",
        "ESTALE",
        "ECONNRESET",
        "ECONNABORTED",
    )
    if hasattr(errno, name)
)
"""Errnos that :func:`classify_error` turns into :class:`~trainguard.errors.TransientStorageError`: the same
call may succeed when retried (interrupted, would block, busy, timed out, a stale NFS handle, a reset
connection of a network filesystem)."""


def classify_error(e: OSError, path: str | os.PathLike[str], step: int | None = None) -> OSError:
    """The exception to raise for ``e``, a failure on ``path``: StorageFullError for ENOSPC/EDQUOT,
    TransientStorageError for :data:`TRANSIENT_ERRNOS`, ``e`` itself otherwise. The new exception keeps
    ``errno``, ``strerror`` and ``filename``; raise it ``from e``.

    Args:
        e: the error.
        path: what was being accessed (for the message).
        step: the step being saved, if any (StorageFullError carries it).
    """
    if isinstance(e, (StorageFullError, TransientStorageError)):
        return e
    if e.errno in FULL_ERRNOS:
        out: OSError = StorageFullError(
            f"no space left on the device while writing {path}: free space or lower retention (keep=...); "
            "no checkpoint was committed and earlier checkpoints are intact",
            step=step,
        )
    elif e.errno in TRANSIENT_ERRNOS:
        out = TransientStorageError(f"{path}: {e.strerror or e} (errno {e.errno}; may succeed when retried)")
    else:
        return e
    out.errno, out.strerror, out.filename = e.errno, e.strerror, str(path)
    return out


def raise_classified(e: OSError, path: str | os.PathLike[str], step: int | None = None) -> NoReturn:
    """Raise :func:`classify_error` of ``e`` (from ``e`` when it is a new exception)."""
    out = classify_error(e, path, step)
    if out is e:
        raise e
    raise out from e


def _fail_write(e: OSError, tmp: Path, path: str | os.PathLike[str]) -> NoReturn:
    """After a failed write: remove the partial file ``tmp`` (best effort), then raise ``e`` (StorageFullError
    for ENOSPC/EDQUOT, naming ``path``)."""
    try:
        tmp.unlink()
    except OSError:
        pass
    raise_classified(e, path)


DIRECT_IO_MIN_BYTES = 1 << 20
"""Objects of at least this many bytes are staged with direct I/O when :class:`LocalStorage`'s ``direct_io``
is on (a smaller write would wait for the device on its own, where the page cache batches it with others)."""

DIRECT_IO_ALIGN = 4096
"""Alignment of a direct write's memory address, length and file offset (bytes): the largest logical block
size of common disks, so it satisfies 512-byte devices too. A filesystem or device that wants more refuses
the write with EINVAL, and the file is finished through the page cache."""

DIRECT_IO_BLOCK_BYTES = 8 << 20
"""Size of each pooled, page-aligned bounce buffer (bytes; one per direct write in progress), and so of each
direct ``write`` call."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): every write is buffered
_BOUNCE_KEPT = 16
"""Bounce buffers kept for reuse between writes (the rest are unmapped when released): more than a save's
writing threads, so every save after the first reuses memory already faulted in."""


class _BouncePool:
    """Page-aligned ``DIRECT_IO_BLOCK_BYTES`` buffers, one per direct write in progress, reused by later
    writes (a save's writer threads are new threads each save). Private anonymous mappings: a forked child
    gets copies, never the parent's memory, and starts with an empty pool (``os.register_at_fork``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[memoryview, Any]] = []

    def acquire(self) -> tuple[memoryview, Any]:
        """A buffer as a memoryview and a NumPy uint8 array of the same memory."""
        with self._lock:
            if self._free:
                return self._free.pop()
        import mmap

        import numpy as np

        mem = mmap.mmap(-1, DIRECT_IO_BLOCK_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return memoryview(mem), np.frombuffer(mem, dtype=np.uint8)

    def release(self, buf: tuple[memoryview, Any]) -> None:
        with self._lock:
            if len(self._free) < _BOUNCE_KEPT:
                self._free.append(buf)

    def reset(self) -> None:
        """In a forked child: a new lock (another thread may have held the parent's) and no buffers."""
        self._lock = threading.Lock()
        self._free = []


_BOUNCE = _BouncePool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BOUNCE.reset)


def aligned_empty(nbytes: int) -> Any:
    """A new, uninitialized ``uint8`` NumPy array of ``nbytes`` (>= 1) bytes whose first byte sits on a
    ``DIRECT_IO_ALIGN`` boundary (``DIRECT_IO_ALIGN - 1`` bytes more are allocated; the array keeps them alive).

    A buffer written with direct I/O from such memory (:func:`write_file` with ``direct=True``) is written as
    it is, without the bounce copy: staging buffers and packed chunks are allocated so.
    """
    import numpy as np

    raw = np.empty(nbytes + DIRECT_IO_ALIGN - 1, dtype=np.uint8)
    off = -raw.ctypes.data % DIRECT_IO_ALIGN
    return raw[off : off + nbytes]


def _write_direct(fd: int, buffers: list[Any]) -> None:
    """Write ``buffers`` in order to ``fd``, a new file with ``O_DIRECT`` set, in ``DIRECT_IO_BLOCK_BYTES``
    calls.

    A buffer whose memory starts on a ``DIRECT_IO_ALIGN`` boundary, at an aligned file offset, is written from
    its own memory (a staging buffer, a packed chunk: :func:`aligned_empty`), all but its last partial block;
    where the kernel refuses that memory for direct I/O (EFAULT: device-mapped host memory such as a
    ``VM_PFNMAP`` mapping), the rest of the buffer is copied. Other bytes are copied into an aligned bounce
    buffer first (``_BOUNCE``; the copy releases the GIL).
    The last partial block is written padded with zeros to ``DIRECT_IO_ALIGN`` and the file cut back to the
    data's length (``ftruncate``). A write refused with EINVAL (a filesystem without direct I/O, one wanting a
    larger alignment, or a write at an unaligned offset after a short write) clears ``O_DIRECT`` on ``fd`` and
    the same bytes go through the page cache, from there to the end of the file (without the padding).
    Durability still needs an fsync (or ``syncfs``): it flushes the file's metadata and the device's write
    cache.
    """
    import numpy as np

    bounce: tuple[memoryview, Any] | None = None  # taken at the first byte that needs a copy
    direct = True
    total = fill = 0

    def write(view: memoryview, data: int) -> None:
        """Write ``view`` at the end of the file; its first ``data`` bytes are the file's (the rest is the last
        block's padding, dropped once the file is written through the page cache)."""
        nonlocal direct, total
        done = 0
        try:
            while done < (len(view) if direct else data):
                try:
                    done += os.write(fd, view[done : len(view) if direct else data])
                except OSError as e:
                    if e.errno != errno.EINVAL or not direct:
                        raise
                    _set_direct(fd, on=False)
                    direct = False
        finally:
            total += min(done, data)  # the file's bytes written, also when a write failed part-way

    try:
        for buf in buffers:
            own = memoryview(buf).cast("B")
            src = np.frombuffer(own, dtype=np.uint8)
            pos = 0
            if direct and not fill and src.ctypes.data % DIRECT_IO_ALIGN == 0:
                whole, start = len(src) - len(src) % DIRECT_IO_ALIGN, total
                try:
                    while pos < whole:
                        n = min(DIRECT_IO_BLOCK_BYTES, whole - pos)
                        write(own[pos : pos + n], n)
                        pos += n
                except OSError as e:
                    if e.errno != errno.EFAULT:
                        raise
                    pos = total - start  # memory the kernel cannot use for direct I/O: copied from here on
            while pos < len(src):
                if bounce is None:
                    bounce = _BOUNCE.acquire()
                n = min(DIRECT_IO_BLOCK_BYTES - fill, len(src) - pos)
                np.copyto(bounce[1][fill : fill + n], src[pos : pos + n])
                fill += n
                pos += n
                if fill == DIRECT_IO_BLOCK_BYTES:
                    write(bounce[0][:fill], fill)
                    fill = 0
        if fill and bounce is not None:
            padded = -(-fill // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN if direct else fill
            bounce[1][fill:padded] = 0
            write(bounce[0][:padded], fill)
            if os.fstat(fd).st_size != total:  # the padding reached the file
                os.ftruncate(fd, total)
    finally:
        if bounce is not None:
            _BOUNCE.release(bounce)


def nbytes_of(data: Any) -> int:
    """Bytes in ``data`` (a buffer, or a list of buffers, as :func:`write_file` and ``Storage.stage`` take)."""
    parts = data if isinstance(data, list) else [data]
    return sum(memoryview(p).nbytes for p in parts)


def _set_direct(fd: int, on: bool = True) -> bool:
    """Turn ``O_DIRECT`` on (or off) for ``fd``; False where the platform has none or the filesystem refuses
    it (EINVAL)."""
    if not _O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return False
    return True


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` take ``O_DIRECT`` (an overlay or FUSE mount may refuse it); probed with a
    temporary file, removed again."""
    probe = Path(directory) / f".direct-io-probe-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        return _set_direct(fd)
    finally:
        os.close(fd)
        probe.unlink()


def write_file(
    path: Path, buffers: list[memoryview] | memoryview | bytes, *, fsync: bool = True, direct: bool = False
) -> None:
    """Write ``buffers`` to a new file ``path`` (must not exist) and fsync it.

    Args:
        direct: write around the page cache (``O_DIRECT``, see :func:`_write_direct`); the file is written
            through the page cache where the platform or the filesystem has no direct I/O (``O_DIRECT``
            refused with EINVAL when set after the open, or a write refused with EINVAL).
    """
    if not isinstance(buffers, list):
        buffers = [memoryview(buffers)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # O_DIRECT set after the open: an open with it creates the file before a filesystem without direct
        # I/O refuses it (EINVAL), and O_EXCL would then refuse the second open
        if direct and not _set_direct(fd):
            direct = False
        if direct:
            _write_direct(fd, buffers)
        else:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                while len(view):
                    n = os.write(fd, view[: 1 << 30])
                    view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = True) -> None:
    """Publish ``data`` at ``path`` atomically: write a temporary sibling, fsync, rename, fsync the directory.

    Replaces an existing file atomically. Raises StorageFullError on ENOSPC (the old file stays as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        write_file(tmp, data, fsync=fsync)
        os.replace(tmp, path)
    except OSError as e:
        _fail_write(e, tmp, path)
    if fsync:
        fsync_dir(path.parent)


def remove_tree(path: str | os.PathLike[str]) -> None:
    """Remove a directory tree; missing is fine."""
    shutil.rmtree(path, ignore_errors=True)


# -- Linux flush primitives (batched durability) ------------------------------------------------------------
def _load_libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:  # pragma: no cover - no loadable C library
        return None


_LIBC = _load_libc()


def _libc_function(name: str, argtypes: list[Any]) -> Any:
    """``name`` from the C library (Linux only; errno kept for error reports), or None where missing."""
    fn = getattr(_LIBC, name, None) if _LIBC is not None else None
    if fn is not None:
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return fn


_SYNCFS = _libc_function("syncfs", [ctypes.c_int])
_SYNC_FILE_RANGE = _libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(path: str | os.PathLike[str]) -> None:
    """Start writing ``path``'s dirty pages to disk without waiting (Linux ``sync_file_range(2)`` with
    ``SYNC_FILE_RANGE_WRITE``), so that the flush at the end of a save overlaps with writing the next chunks.
    Durability still comes from the later ``syncfs``. A no-op where unavailable; errors are ignored (the
    ``syncfs`` reports them)."""
    if _SYNC_FILE_RANGE is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)


def syncfs(path: str | os.PathLike[str]) -> bool:
    """Flush every dirty page and metadata change of the filesystem holding ``path`` (Linux ``syncfs(2)``;
    it reports writeback errors since Linux 5.8). Returns False where ``syncfs`` is unavailable.

    Raises:
        OSError: the flush failed (e.g. EIO, ENOSPC).
    """
    if _SYNCFS is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)
    return True


def _fsync_all(paths: list[Path], threads: int = 4) -> None:
    """fsync every file of ``paths``, from up to ``threads`` threads (concurrent fsyncs share journal
    commits).

    Raises:
        OSError: the first fsync that failed.
    """

    def one(p: Path) -> None:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    if len(paths) <= 1 or threads <= 1:
        for p in paths:
            one(p)
        return
    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="trainguard-fsync") as pool:
        for f in [pool.submit(one, p) for p in paths]:
            f.result()


def meminfo(path: str | os.PathLike[str] = "/proc/meminfo") -> dict[str, int] | None:
    """The fields of ``/proc/meminfo`` in bytes (its kB figures times 1024; a line that does not parse is left
    out), or None where the file cannot be read (not Linux)."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = {}
    for line in lines:
        name, _, rest = line.partition(b":")
        try:
            found[name.decode("ascii")] = int(rest.split()[0]) * 1024
        except (IndexError, ValueError, UnicodeDecodeError):
            continue
    return found


def dirty_bytes(meminfo_path: str | os.PathLike[str] = "/proc/meminfo") -> int | None:
    """Bytes of the node's page cache that are dirty or being written back (``Dirty`` + ``Writeback`` of
    ``/proc/meminfo``, every filesystem together), or None where that is unknown (not Linux)."""
    info = meminfo(meminfo_path)
    if info is None or "Dirty" not in info or "Writeback" not in info:
        return None
    return info["Dirty"] + info["Writeback"]


DURABILITY_MODES = ("auto", "batched", "per_file")
"""``durability`` values of :class:`LocalStorage` (and ``CheckpointManager``); ``"auto"`` is the default."""
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    kind = _KINDS.get(stat.S_IFMT(st.st_mode), "other")
    return ObjectInfo(
        key,
        kind,
        st.st_size if kind == "file" else 0,
        st.st_mtime,
        (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
    )


class _Classified:
    """A file opened by :meth:`LocalStorage.open_read` whose read errors are classified (:func:`classify_error`)."""

    def __init__(self, f: Any, path: Path) -> None:
        self._f = f
        self._path = path

    def readinto(self, buf: Any) -> int:
        try:
            return int(self._f.readinto(buf))
        except OSError as e:
            raise_classified(e, self._path)

    def read(self, n: int = -1) -> bytes:
        try:
            return bytes(self._f.read(n))
        except OSError as e:
            raise_classified(e, self._path)

    def fileno(self) -> int:
        return int(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _Classified:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


class LocalStorage:
    """A run root in a local (or mounted) POSIX directory: the :class:`~trainguard.storage.base.Storage`
    protocol on files.

    Args:
        root: the run root directory (not created here).
        fsync: make writes durable (False only for tests and benchmarks that measure without durability).
        durability: how :meth:`stage`/:meth:`commit_staged` make a save's objects durable. ``"auto"``
            (default): temporary files whose writeback starts at once (``sync_file_range``), then, at the
            flush, one ``syncfs(2)`` when the node holds no more dirty page-cache data than the size of the
            save's own files (:func:`dirty_bytes`; files written with ``direct_io`` count at their size too,
            though they leave no dirty pages: the flush waits for at most as much foreign data as the save
            wrote), else an fsync of each file (from a few threads); then the renames
            and one more ``syncfs`` or the directories' fsyncs. ``syncfs`` flushes every process's dirty data
            on the filesystem: beside another job's unflushed writes it would make the save wait for them.
            ``"batched"``: always ``syncfs`` (per-file fsyncs where it is missing). ``"per_file"``: each object
            fsynced and renamed into place by :meth:`stage`, its directories fsynced by
            :meth:`commit_staged`.
        direct_io: :meth:`stage` writes objects of at least ``DIRECT_IO_MIN_BYTES`` around the page cache
            (``O_DIRECT``, through pooled, page-aligned 8 MiB buffers; see :func:`write_file`), so a
            save neither allocates page-cache memory for its bytes nor evicts the job's cached data, and no
            dirty pages wait for writeback. The durability above is unchanged. Where the filesystem has no
            direct I/O the file is written through the page cache. False: every write goes through the
            page cache (a restore right after a save then reads memory instead of the disk).

    Attributes:
        node_writers: processes of one job that save to this root from this node together (the ranks of a
            torch.distributed job on one node; set by ``CheckpointManager``; default 1). ``"auto"`` counts
            their dirty data as the save's own: it must reach the disk before the commit anyway, and each
            rank's files are about a ``node_writers``-th of it.

    Raises:
        ValueError: an unknown ``durability``, or a ``direct_io`` that is not a bool.

    Files are opened without following a symlink and without blocking (:mod:`trainguard.storage.safeio`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        durability: str = "auto",
        direct_io: bool = True,
    ) -> None:
        if durability not in DURABILITY_MODES:
            raise ValueError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
        if not isinstance(direct_io, bool):  # "no" from a config file must not mean yes
            raise ValueError(f"direct_io must be True or False, got {direct_io!r}")
        self.root = Path(root)
        self.fsync = fsync
        self.durability = durability
        self.direct_io = direct_io
        self.node_writers = 1

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def local_path(self) -> Path:
        return self.root

    def path(self, key: str) -> Path:
        """The local path of ``key``."""
        return self.root / key if key else self.root

    def location(self, key: str) -> str:
        return str(self.path(key))

    # -- writing ------------------------------------------------------------------------------------------
    def write_new(self, key: str, data: Any, *, durable: bool = True) -> None:
        p = self.path(key)
        try:
            write_file(p, data, fsync=durable and self.fsync)
        except FileExistsError:
            raise
        except OSError as e:
            _fail_write(e, p, p)

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        atomic_write(self.path(key), data, fsync=durable and self.fsync)

    def staging_prefix(self, partial: str, target_prefix: str) -> str:
        target = self.path(target_prefix)
        try:
            other_fs = target.is_dir() and os.stat(target).st_dev != os.stat(self.path(partial)).st_dev
        except OSError:
            other_fs = False
        if not other_fs:
            return partial
        name = partial.rsplit("/", 1)[-1]
        key = f"{target_prefix}/.{name}"
        self.path(key).mkdir(exist_ok=True)
        return key

    def stage(self, key: str, data: Any, *, staging: str) -> Staged:
        final = self.path(key)
        name = key.rsplit("/", 1)[-1]
        tmp_key = (
            f"{staging}/{name}.{threading.get_ident():x}.{secrets.token_hex(3)}.tmp"  # unique per writer
        )
        tmp = self.path(tmp_key)
        batched = self.durability != "per_file"  # "auto" stages as "batched" does and decides at the flush
        direct = self.direct_io and nbytes_of(data) >= DIRECT_IO_MIN_BYTES
        try:
            # the module's write_file: one seam for fault tests
            write_file(tmp, data, fsync=self.fsync and not batched, **({"direct": True} if direct else {}))
            if batched and self.fsync and not direct:  # a direct write leaves no dirty pages to start on
                start_writeback(tmp)
            if not batched:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, final)
        except OSError as e:
            _fail_write(e, tmp, final)
        return Staged(key, tmp_key if batched else None, staging)

    def commit_staged(self, staged: list[Staged]) -> None:
        pending = [s for s in staged if s.token is not None]
        dirs = {self.path(s.key).parent for s in staged if s.token is None}
        top = {self.path(s.key.split("/", 1)[0]) for s in staged if "/" in s.key}
        fs = next(iter(top)) if top else self.root  # the objects' filesystem (chunks/ may be another disk)
        if not fs.is_dir():
            fs = self.root
        try:
            if pending:
                use_syncfs = self.fsync and self._flush_with_syncfs(pending)
                if self.fsync and not (use_syncfs and syncfs(fs)):  # one fsync per file
                    _fsync_all([self.path(s.token or "") for s in pending])
                for s in pending:
                    final = self.path(s.key)
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(self.path(s.token or ""), final)
                    dirs.add(final.parent)
                if use_syncfs and syncfs(fs):
                    return  # the renames and the new directories are durable
        except OSError as e:
            raise_classified(e, fs)
        if not self.fsync:
            return
        for d in dirs:
            fsync_dir(d)
        for t in top if dirs else ():
            fsync_dir(t)

    def _flush_with_syncfs(self, pending: list[Staged]) -> bool:
        """Whether the flush of ``pending`` (staged temporary files) uses ``syncfs``: always for
        ``"batched"``; for ``"auto"`` only when the node's dirty and under-writeback bytes are at most the
        pending files' own size times :attr:`node_writers` (the job's ranks on this node write their shares of
        the same save at once: ``syncfs`` waits for at most as much foreign data as the save's own)."""
        if self.durability != "auto":
            return self.durability == "batched"
        dirty = dirty_bytes()
        if dirty is None or _SYNCFS is None:
            return False
        own = 0
        for s in pending:
            try:
                own += os.stat(self.path(s.token or "")).st_size
            except OSError:
                pass
        return dirty <= own * max(1, self.node_writers)

    def discard_staged(self, staged: list[Staged]) -> None:
        for s in staged:
            if s.token is not None:
                try:
                    self.path(s.token).unlink()
                except OSError:
                    pass

    def make_dir(self, prefix: str) -> bool:
        p = self.path(prefix)
        created = not p.exists()
        p.mkdir(parents=True, exist_ok=True)
        return created

    def barrier(self, prefix: str = "") -> None:
        if self.fsync:
            fsync_dir(self.path(prefix))

    def touch(self, key: str) -> None:
        os.utime(self.path(key))

    def move(self, src: str, dst: str) -> bool:
        try:
            os.replace(self.path(src), self.path(dst))
        except FileNotFoundError:
            return False
        return True

    # -- reading ------------------------------------------------------------------------------------------
    def read(self, key: str, *, limit_bytes: int, what: str = "file") -> bytes:
        try:
            return read_bounded(self.path(key), limit_bytes, what=what)
        except OSError as e:
            raise_classified(e, self.path(key))

    def open_read(self, key: str, *, what: str = "file") -> tuple[Any, ObjectInfo]:
        try:
            f = os.fdopen(open_regular(self.path(key), what=what), "rb", buffering=0)
        except OSError as e:
            raise_classified(e, self.path(key))
        try:
            return _Classified(f, self.path(key)), _info(key, os.fstat(f.fileno()))
        except BaseException:
            f.close()
            raise

    def read_range(self, key: str, offset: int, out: memoryview) -> int:
        try:
            fd = open_regular(self.path(key))
            try:
                got = 0
                while got < len(out):
                    n = os.preadv(fd, [out[got:]], offset + got)
                    if not n:
                        break
                    got += n
                return got
            finally:
                os.close(fd)
        except OSError as e:
            raise_classified(e, self.path(key))

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            return _info(key, os.lstat(self.path(key)))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise_classified(e, self.path(key))

    def exists(self, key: str) -> bool:
        return os.path.lexists(self.path(key))

    def list(self, prefix: str = "") -> list[Entry]:
        try:
            with os.scandir(self.path(prefix)) as it:
                return [Entry(e.name, e.is_dir(follow_symlinks=False)) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise_classified(e, self.path(prefix))

    # -- deleting -----------------------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            return False
        return True

    def delete_prefix(self, prefix: str) -> None:
        remove_tree(self.path(prefix))
