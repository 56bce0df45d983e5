"""Reading the newest checkpoint into this node's page cache while a (re)launched job starts.

A relaunch spends most of its time-to-resume before the restore: starting Python, importing torch, building the
model (70-95% of TTR measured on a 2-core VM, more on a GPU node: CUDA context, NCCL). The restore then reads
the checkpoint from the disk. :class:`Prefetch` reads the chunk files of the newest committed checkpoint that
is not marked corrupt or suspect during that startup, from the supervisor's process, so the job's restore
finds them in memory. Each file is handed to the kernel with ``posix_fadvise(POSIX_FADV_WILLNEED)``, which
reads the pages not yet cached without copying anything into the supervisor (so a checkpoint still cached
costs almost nothing while the job imports), or read in 8 MiB blocks where that call is missing. Nothing is
checked or trusted here: the restore still checks every chunk it reads
(length, CRC32C) and falls back to an older checkpoint as before; a prefetch only moves disk reads earlier.

Bounds: the bytes read are capped at half of the node's available memory (``MemAvailable``) so the
checkpoint does not evict itself, and at each chunk's recorded length; files are opened without following
symlinks or blocking on a named pipe (:mod:`..storage.safeio`) and only paths a validated manifest names are
read; a manifest over ``MAX_MANIFEST_BYTES`` is not parsed (the parse holds the supervisor's GIL), and a
parsed one is remembered for the next attempts. The reads stop when the attempt ends.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BLOCK_BYTES = 8 << 20
"""Bytes per read call (one reused buffer per reading thread)."""

MEMORY_SHARE = 0.5
"""At most this share of ``MemAvailable`` is read (the rest of the checkpoint is left to the restore)."""

MAX_MANIFEST_BYTES = 1 << 20
"""A checkpoint whose manifest is larger is not prefetched: parsing it holds the supervisor's GIL (about 0.15
s per MB measured: 0.46 s for the 2.2 MB manifest of 10,000 tensors), which would delay its failure detection;
about 4,500 tensor entries fit."""

NO_CHECKPOINT = "no committed checkpoint to read"

MULTI_NODE_LAUNCHERS = frozenset({"srun", "mpirun", "mpiexec", "jsrun", "aprun", "prun"})
"""Commands that start processes on several nodes: prefetch stays off for them by default."""

CANDIDATES = 3
"""Newest committed steps examined (a damaged newest one falls back to the next, as the restore does)."""


@dataclass(frozen=True)
class PrefetchResult:
    """What a prefetch read.

    Attributes:
        status: ``"done"`` (every chunk file requested), ``"partial"`` (some files left out: the memory cap,
            or files missing or refused), ``"stopped"`` (the attempt ended first), ``"skipped"`` (no usable
            checkpoint, or its manifest is over ``MAX_MANIFEST_BYTES``) or ``"failed"``.
        step: the checkpoint read (None when skipped before one was chosen).
        files: chunk files requested whole: handed to the kernel's readahead (which reads them after the call
            returns) or read.
        bytes: bytes of those requests (at most each chunk's recorded length).
        total_bytes: bytes of the checkpoint's chunk files, as its manifest records them.
        seconds: wall time of choosing the checkpoint (listing, parsing its manifest) and issuing the reads.
        reason: why it was skipped, partial or failed (None otherwise).
    """

    status: str
    step: int | None = None
    files: int = 0
    bytes: int = 0
    total_bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def multi_node_command(command: Sequence[str]) -> bool:
    """Whether ``command`` may run on several nodes: it starts with a multi-node launcher
    (``MULTI_NODE_LAUNCHERS``: ``srun``, ``mpirun``, ...), or some word of it (also inside a ``bash -c``
    string, after ``env`` or ``uv run``) is torchrun's ``--nnodes`` (or an abbreviation of it) with another
    value than ``1`` or ``1:1``."""
    words = [w for arg in command for w in str(arg).split()]
    if words and os.path.basename(words[0]) in MULTI_NODE_LAUNCHERS:
        return True
    for i, w in enumerate(words):
        if not w.startswith("--nn"):
            continue
        name, eq, value = w.partition("=")
        if not "--nnodes".startswith(name):
            continue
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        if value.strip() not in ("1", "1:1"):
            return True
    return False


def readahead_bytes(fd: int) -> int:
    """The readahead window of the filesystem holding ``fd`` (``/sys/class/bdi/MAJ:MIN/read_ahead_kb``), in
    bytes; 128 KiB (the Linux default) where it cannot be read."""
    try:
        dev = os.fstat(fd).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb", encoding="ascii") as f:
            kib = int(f.read().strip())
    except (OSError, ValueError):
        return 128 << 10
    return max(4 << 10, kib << 10)


def _advise(fd: int, size: int, stop: threading.Event) -> bool:
    """Ask the kernel to read the whole file into the page cache: ``posix_fadvise(POSIX_FADV_WILLNEED)`` per
    readahead window (Linux reads at most about one window, ``read_ahead_kb``, per call). Each call submits
    the reads of the range's pages not cached and returns without copying anything into this process. False
    where the call is missing or refused (the caller then reads the file itself)."""
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return False
    step = readahead_bytes(fd)
    try:
        for offset in range(0, size, step):
            if stop.is_set():
                return True
            fadvise(fd, offset, min(step, size - offset), os.POSIX_FADV_WILLNEED)
    except OSError:
        return False
    return True


_CACHE: dict[tuple[str, int, tuple[Any, ...]], list[tuple[str, int]]] = {}
"""(root, step, the manifest's ``ObjectInfo.version``: inode, size, mtime, ctime) -> its chunk list: a supervisor restarting a job several times
parses one manifest once."""


class ManifestTooLarge(Exception):
    """The newest usable checkpoint's manifest is over ``MAX_MANIFEST_BYTES`` (not prefetched)."""


def newest_chunks(
    root: str | Path, stop: threading.Event | None = None
) -> tuple[int, list[tuple[str, int]]] | None:
    """``(step, [(chunk path relative to root, stored bytes), ...])`` of the newest committed checkpoint under
    ``root`` whose manifest parses and that carries no corrupt or suspect marker (the one ``restore_latest``
    tries first; the newest ``CANDIDATES`` steps are examined), largest chunk first (the restore's order); None
    when there is none or ``stop`` is set.

    Raises:
        ManifestTooLarge: that checkpoint's manifest is over ``MAX_MANIFEST_BYTES``.
    """
    from ..catalog import committed_split, corrupt_marker, read_manifest, suspect_reason
    from ..errors import TrainguardError
    from ..format import MANIFEST_NAME, step_dir_name
    from ..storage.local import LocalStorage

    storage = LocalStorage(root)
    try:
        committed, _ = committed_split(storage)
    except OSError:
        return None
    for step in list(reversed(committed))[:CANDIDATES]:
        if stop is not None and stop.is_set():
            return None
        if corrupt_marker(storage, step) is not None or suspect_reason(storage, step) is not None:
            continue
        try:
            info = storage.stat(f"{step_dir_name(step)}/{MANIFEST_NAME}")
        except OSError:
            continue
        if info is None:
            continue
        if info.size > MAX_MANIFEST_BYTES:
            raise ManifestTooLarge(
                f"the manifest of step {step} has {info.size} bytes (over {MAX_MANIFEST_BYTES}): parsing it "
                "would stall the supervisor"
            )
        key = (str(root), step, info.version)
        if key not in _CACHE:
            try:
                manifest = read_manifest(storage, step)
            except (TrainguardError, OSError):
                continue
            chunks = {c.path: c.length for c in manifest.chunks.values()}
            _CACHE.clear()  # one entry: the newest checkpoint of the run being supervised
            _CACHE[key] = sorted(chunks.items(), key=lambda pc: -pc[1])
        return step, _CACHE[key]
    return None


class Prefetch:
    """Read the newest checkpoint's chunk files under ``root`` into the page cache, in background threads.

    Args:
        root: the run root (a local or mounted directory).
        threads: reading threads (2: the disk gets two streams while the job's startup keeps a core).
        memory_bytes: bytes available to the page cache (None: ``MemAvailable``); at most
            ``MEMORY_SHARE`` of it is read.
        on_done: called once with the :class:`PrefetchResult` from the prefetch's thread.
        advise: ask the kernel to read each file (``posix_fadvise(POSIX_FADV_WILLNEED)``: no copy into this
            process, pages already cached cost almost nothing) instead of reading it; files where that call is
            missing or refused are read.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        threads: int = 2,
        memory_bytes: int | None = None,
        on_done: Callable[[PrefetchResult], None] | None = None,
        advise: bool = True,
    ) -> None:
        self.root = Path(root)
        self.threads = max(1, threads)
        self.memory_bytes = memory_bytes
        self.on_done = on_done
        self.advise = advise
        self.result: PrefetchResult | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Prefetch:
        self._thread = threading.Thread(target=self._run, name="trainguard-prefetch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> PrefetchResult | None:
        """Stop reading (a read call in flight finishes) and return the result (None if not finished within
        ``timeout`` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> PrefetchResult | None:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    def _run(self) -> None:
        try:
            result = self.read()
        except Exception as e:  # noqa: BLE001 - a prefetch never fails the supervisor: the restore reads anyway
            result = PrefetchResult("failed", reason=f"{type(e).__name__}: {e}")
        self.result = result
        if self.on_done is not None:
            self.on_done(result)

    def read(self) -> PrefetchResult:
        """Choose the checkpoint and read it (in the calling thread, with ``threads`` - 1 helpers)."""
        t0 = time.perf_counter()
        try:
            found = newest_chunks(self.root, self._stop)
        except ManifestTooLarge as e:
            return PrefetchResult("skipped", reason=str(e), seconds=time.perf_counter() - t0)
        if found is None:
            status = "stopped" if self._stop.is_set() else "skipped"
            return PrefetchResult(status, reason=NO_CHECKPOINT if status == "skipped" else None)
        step, chunks = found
        total = sum(n for _, n in chunks)
        if self.memory_bytes is not None:
            memory: int | None = self.memory_bytes
        else:
            from ..storage.local import meminfo

            memory = (meminfo() or {}).get("MemAvailable")
        cap = int(memory * MEMORY_SHARE) if memory is not None else total
        todo: list[tuple[str, int]] = []
        planned = 0
        for path, n in chunks:
            if planned + n > cap:
                continue  # a smaller one may still fit
            todo.append((path, n))
            planned += n
        lock = threading.Lock()
        done = {"files": 0, "bytes": 0}
        left_out: list[str] = []
        queue = list(reversed(todo))  # pop() takes the largest first

        def one(storage: Any, path: str, length: int, buf: memoryview) -> tuple[int, bool]:
            """Bytes requested and whether the whole chunk (its recorded ``length``, never more) was."""
            f, info = storage.open_read(path, what="chunk")
            size = min(info.size, length)
            with f:
                if self.advise and _advise(f.fileno(), size, self._stop):
                    return size, not self._stop.is_set() and info.size >= length
                got = 0
                while got < size and not self._stop.is_set():
                    n = f.readinto(buf[: min(len(buf), size - got)])
                    if not n:
                        break
                    got += n
                return got, got == length

        def worker() -> None:
            from ..storage.local import LocalStorage

            storage = LocalStorage(self.root)
            buf = memoryview(bytearray(BLOCK_BYTES))
            while not self._stop.is_set():
                with lock:
                    if not queue:
                        return
                    path, length = queue.pop()
                try:
                    got, whole = one(storage, path, length, buf)
                except OSError:  # gone (retention), refused (not a regular file), an I/O error
                    got, whole = 0, False
                with lock:
                    done["bytes"] += got
                    done["files"] += whole
                    if not whole and not self._stop.is_set():
                        left_out.append(path)

        helpers = [
            threading.Thread(target=worker, name=f"trainguard-prefetch-{i}", daemon=True)
            for i in range(1, min(self.threads, len(todo)))
        ]
        for h in helpers:
            h.start()
        worker()
        for h in helpers:
            h.join()
        seconds = time.perf_counter() - t0
        reasons = []
        if len(todo) < len(chunks):
            reasons.append(
                f"{total - planned} of {total} bytes left out: over {MEMORY_SHARE:.0%} of the available memory "
                f"({memory} bytes)"
            )
        if left_out:
            reasons.append(
                f"{len(left_out)} chunk file(s) missing, refused, shorter than recorded or unreadable (the "
                f"restore reports them), e.g. {left_out[0]}"
            )
        if self._stop.is_set() and done["files"] + len(left_out) < len(todo):
            status, reason = "stopped", "the attempt ended first"
        elif reasons:
            status, reason = "partial", "; ".join(reasons)
        else:
            status, reason = "done", None
        return PrefetchResult(status, step, done["files"], done["bytes"], total, seconds, reason)
