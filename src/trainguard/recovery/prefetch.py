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
checkpoint does not evict itself; files are opened without following symlinks (:mod:`..storage.safeio`) and
only paths a validated manifest names are read. The reads stop when the attempt ends.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BLOCK_BYTES = 8 << 20
"""Bytes per read call (one reused buffer per reading thread)."""

MEMORY_SHARE = 0.5
"""At most this share of ``MemAvailable`` is read (the rest of the checkpoint is left to the restore)."""


@dataclass(frozen=True)
class PrefetchResult:
    """What a prefetch read.

    Attributes:
        status: ``"done"`` (every chunk file read), ``"partial"`` (stopped at the memory cap), ``"stopped"``
            (the attempt ended first), ``"skipped"`` (nothing to read: no usable checkpoint) or ``"failed"``.
        step: the checkpoint read (None when skipped before one was chosen).
        files: chunk files read whole.
        bytes: bytes read.
        total_bytes: bytes of the checkpoint's chunk files.
        seconds: wall time of the reads.
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


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes, or None where the kernel does not report it."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


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


def newest_chunks(root: str | Path) -> tuple[int, list[tuple[str, int]]] | None:
    """``(step, [(chunk path relative to root, stored bytes), ...])`` of the newest committed checkpoint under
    ``root`` whose manifest parses and that carries no corrupt or suspect marker (the one ``restore_latest``
    tries first), largest chunk first (the restore's order); None when there is none."""
    from ..catalog import committed_split, corrupt_marker, read_manifest, suspect_reason
    from ..errors import TrainguardError
    from ..storage.local import LocalStorage

    storage = LocalStorage(root)
    try:
        committed, _ = committed_split(storage)
    except OSError:
        return None
    for step in reversed(committed):
        if corrupt_marker(storage, step) is not None or suspect_reason(storage, step) is not None:
            continue
        try:
            manifest = read_manifest(storage, step)
        except (TrainguardError, OSError):
            continue
        chunks = {c.path: c.length for c in manifest.chunks.values()}
        return step, sorted(chunks.items(), key=lambda pc: -pc[1])
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
        found = newest_chunks(self.root)
        if found is None:
            return PrefetchResult("skipped", reason="no committed checkpoint to read")
        step, chunks = found
        total = sum(n for _, n in chunks)
        memory = self.memory_bytes if self.memory_bytes is not None else available_memory()
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
        queue = list(reversed(todo))  # pop() takes the largest first

        def worker() -> None:
            from ..storage.local import LocalStorage

            storage = LocalStorage(self.root)
            buf = memoryview(bytearray(BLOCK_BYTES))
            while not self._stop.is_set():
                with lock:
                    if not queue:
                        return
                    path, _ = queue.pop()
                got, whole = 0, False
                try:
                    f, info = storage.open_read(path, what="chunk")
                except OSError:
                    continue  # gone (retention) or refused: the restore reports what matters
                with f:
                    if self.advise and _advise(f.fileno(), info.size, self._stop):
                        # the kernel reads it (no copy, cached pages skipped)
                        got, whole = info.size, not self._stop.is_set()
                    while not whole and not self._stop.is_set():
                        n = f.readinto(buf)
                        if not n:
                            whole = True
                            break
                        got += n
                with lock:
                    done["bytes"] += got
                    done["files"] += whole

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
        if self._stop.is_set() and done["files"] < len(todo):
            status, reason = "stopped", "the attempt ended first"
        elif len(todo) < len(chunks):
            status = "partial"
            reason = (
                f"read {planned} of {total} bytes: the rest exceeds {MEMORY_SHARE:.0%} of the available memory "
                f"({memory} bytes)"
            )
        else:
            status, reason = "done", None
        return PrefetchResult(status, step, done["files"], done["bytes"], total, seconds, reason)
