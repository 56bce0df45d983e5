"""Copying committed checkpoints from the hot root to the tiers: async (background) and sync (dual write).

Protocol per (tier, step), the commit protocol of a run root on a store without rename:
1. every chunk the manifest lists that the tier does not already hold with the recorded length is read from
   the hot root, checked against its CRC32C (corrupt bytes are never uploaded), and PUT, by a pool of
   ``POOL_WORKERS`` threads; where the store takes a checksum with the PUT (S3: ``x-amz-checksum-crc32c``,
   :meth:`~trainguard.storage.s3.S3Objects.put_checked`) the chunk's CRC32C goes with it, so the store
   refuses bytes damaged on the way (and the client computes no checksum of its own);
2. the manifest is PUT last, as one object: its presence is the commit on the tier.
Where the store takes a file-like body (S3), a chunk is streamed from the hot root's file in ``BLOCK_BYTES``
blocks (:class:`ChunkBody`: no 64 MiB buffer per request) and its CRC32C is computed over the bytes handed to
the request; the last block is withheld unless the whole chunk matches, so a corrupt chunk never becomes a
complete object (the request fails short of its Content-Length and is not retried).

Async uploads yield to training: while a save is staging (the part of an async save the training thread waits
for; :meth:`StagingGate.staging`, held by ``CheckpointManager.save``), upload workers wait before each block
they read or send (:meth:`StagingGate.yield_to_staging`, at most ``PAUSE_MAX_S`` per save), so the staging copy
does not share the CPU and memory bandwidth with them. Dual-write (sync) tiers do not wait: ``wait()`` waits
for them.
A kill at any instant leaves at most chunks without a manifest: never listed as a checkpoint there, and
re-sent or collected by the next upload. Each request is retried ``ATTEMPTS`` times in all with exponential
backoff (``BACKOFF_S`` doubling, at most ``BACKOFF_MAX_S``); a request that makes no progress for the tier's
``stall_timeout_s`` is aborted (:class:`~trainguard.storage.objects.FsspecObjects`), so nothing hangs.

Per-tier retention runs after each upload, in the tier's own thread (so never beside an upload to the same
tier): it never deletes the newest valid step there, deletes manifests first, and frees a chunk only when no
remaining manifest on that tier references it.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c

from ..errors import CorruptCheckpointError, SaveError, TrainguardError
from ..format import MANIFEST_NAME, manifest_from_json, step_dir_name
from ..format.layout import CHUNKS_DIR
from ..format.manifest import ChunkRecord
from ..retention import KeepAll, select
from ..storage.objects import ObjectStore
from ..storage.safeio import MAX_MANIFEST_BYTES, open_regular, read_bounded, read_full
from . import intent
from .config import Tier
from .remote import CHECK_NAME, RemoteRoot, manifest_name

log = logging.getLogger("trainguard")
ATTEMPTS = 5
BACKOFF_S = 0.5
BACKOFF_MAX_S = 8.0
POOL_WORKERS = 8
BACKGROUND_NICE = 10
"""Nice increment of the threads uploading to async tiers (Linux, per thread): under CPU contention they yield
to the training process's other threads (an async tier must never slow training); idle CPU they still use."""


BLOCK_BYTES = 1 << 20
"""Bytes of a chunk read from the hot root, CRC32C-updated and handed to a request at a time
(:class:`ChunkBody`); an upload worker checks :class:`StagingGate` before each block."""
PAUSE_MAX_S = 5.0
"""Longest an async upload waits for one save's staging to end before going on anyway (a save stuck in
``state_dict()`` must not stop uploads; S3 drops a request body idle for about 20 s)."""


class StagingGate:
    """Async tier uploads yield to a save's staging copy (the part of an async save the training thread waits
    for; with ``async_save=False``, the whole save).

    A save holds :meth:`staging` while the training thread is inside ``save()``; upload workers call
    :meth:`yield_to_staging` before each block they read or send and wait there while a save is staging: at
    most ``PAUSE_MAX_S`` per save (then they go on until the next save starts), and never after
    :meth:`release`.

    Attributes:
        pauses: how many times a worker found a save staging and waited (a count for tests and events).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._staging = 0
        self._generation = 0  # +1 per save that starts staging
        self._gave_up = -1  # a generation some worker waited PAUSE_MAX_S for: nobody waits on it again
        self._released = False
        self.pauses = 0

    @contextmanager
    def staging(self) -> Iterator[None]:
        """Hold while a save stages: async upload workers wait before their next block until it ends."""
        with self._cond:
            self._staging += 1
            self._generation += 1
        try:
            yield
        finally:
            with self._cond:
                self._staging -= 1
                if not self._staging:
                    self._cond.notify_all()

    def yield_to_staging(self, max_s: float | None = None) -> bool:
        """Return at once when no save is staging; else wait until none is (at most ``max_s``, default
        ``PAUSE_MAX_S``, per save). Returns True when it waited."""
        if not self._staging:  # the common case: no lock taken
            return False
        limit = PAUSE_MAX_S if max_s is None else max_s
        with self._cond:
            if not self._staging or self._released or self._gave_up == self._generation:
                return False
            self.pauses += 1
            generation = self._generation
            deadline = time.monotonic() + limit
            while self._staging and not self._released:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._gave_up = generation
                    return True
                self._cond.wait(left)
            return True

    def release(self) -> None:
        """Wake every waiting worker and never wait again (the uploader is closing)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()


class ChunkBody(io.RawIOBase):
    """A hot-root chunk file as a streamed, CRC32C-checked request body.

    Read in ``BLOCK_BYTES`` blocks into one reused buffer; :meth:`read` hands out views of it (valid until the
    next call: the HTTP client sends each before asking for more). The CRC32C runs over every byte handed out;
    when the last block is read, the whole chunk's CRC32C is compared with the manifest's and, on a mismatch,
    that block is withheld and :attr:`problem` set: the request ends short of its Content-Length and the store
    creates no object. :meth:`seek` to 0 starts over (a signing pass, a retry).

    Args:
        path: the chunk file (opened without following a symlink; a regular file only).
        length: the chunk's length in bytes (the manifest's).
        crc: its CRC32C (unsigned 32-bit int).
        gate: waited on before each block (async tiers), or None.

    Raises:
        CorruptCheckpointError: (at construction) the file is not ``length`` bytes long.
        FileNotFoundError, UnsafeFileError, OSError: as :func:`~trainguard.storage.safeio.open_regular`.
    """

    def __init__(self, path: Path, length: int, crc: int, gate: StagingGate | None = None) -> None:
        super().__init__()
        self._f: io.FileIO | None = None
        fd = open_regular(path, os.O_RDONLY, what="chunk")
        self._f = os.fdopen(fd, "rb", buffering=0)
        self.path, self.length, self.crc, self.gate = path, length, crc, gate
        self.problem: str | None = None
        self.pauses = 0  # times this body waited for a save's staging
        size = os.fstat(fd).st_size
        if size != length or (length == 0 and crc != 0):
            self.close()
            raise CorruptCheckpointError(
                f"chunk {path.name} is {size} bytes long, its manifest says {length}"
            )
        self._buf = bytearray(min(BLOCK_BYTES, max(length, 1)))
        self._view = memoryview(self._buf)
        self._read = self._pos = self._filled = 0  # bytes read from the file; the buffer's read/filled ends
        self._crc = 0  # CRC32C of the bytes read so far

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        """Bytes left to read (botocore's Content-Length)."""
        return self.length - self.tell()

    def tell(self) -> int:
        return self._read - (self._filled - self._pos)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Only to the start (start over), the end, or where it is (what HTTP clients and signers do)."""
        target = {io.SEEK_SET: 0, io.SEEK_CUR: self.tell(), io.SEEK_END: self.length}[whence] + offset
        if target == self.tell():
            return target
        if target == 0:
            assert self._f is not None
            self._f.seek(0)
            self._read = self._pos = self._filled = 0
            self._crc = 0
        elif target == self.length:  # skip to the end: nothing more is read
            self._read, self._pos, self._filled = self.length, 0, 0
        else:
            raise io.UnsupportedOperation("a chunk body seeks only to its start or its end")
        return target

    def read(self, size: int | None = -1) -> memoryview | bytes:  # type: ignore[override]
        if self._pos >= self._filled:
            self._fill()
            if self._pos >= self._filled:
                return b""
        end = self._filled if size is None or size < 0 else min(self._filled, self._pos + size)
        out = self._view[self._pos : end]
        self._pos = end
        return out

    def _fill(self) -> None:
        self._pos = self._filled = 0
        k = min(len(self._buf), self.length - self._read)
        if k <= 0:
            return
        if self.gate is not None and self.gate.yield_to_staging():
            self.pauses += 1
        assert self._f is not None
        got = read_full(self._f, self._view[:k])
        crc = crc32c.crc32c(self._view[:got], self._crc)
        last = self._read + got >= self.length
        if got < k or (last and (crc != self.crc or self._f.read(1))):
            self.problem = "does not match its length or CRC32C"
            raise CorruptCheckpointError(f"chunk {self.path.name} {self.problem}")
        self._crc, self._read, self._filled = crc, self._read + got, got

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        super().close()


def lower_thread_priority(increment: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux: a thread is a task with its own nice
    value). Best effort: a no-op where the platform has no per-thread priority."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except (AttributeError, OSError):  # not Linux / not permitted: priorities stay as they are
        pass


def with_retries(
    what: str, fn: Callable[[], Any], on_failure: Callable[[BaseException, int], None], stop: threading.Event
) -> Any:
    """Call ``fn`` up to ``ATTEMPTS`` times with exponential backoff; OSErrors (TransientStorageError
    included) are retried, anything else is raised at once. ``on_failure(error, attempt)`` sees each failure."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return fn()
        except CorruptCheckpointError:
            raise
        except OSError as e:
            on_failure(e, attempt)
            if attempt == ATTEMPTS or stop.is_set():
                raise
            stop.wait(min(BACKOFF_S * 2 ** (attempt - 1), BACKOFF_MAX_S))
    raise AssertionError(what)  # pragma: no cover


def read_chunk_file(path: Path, length: int) -> bytearray | None:
    """The ``length`` bytes of a chunk file, read straight into one buffer (no symlink followed, nothing read
    from anything but a regular file); None when the file is not exactly ``length`` bytes long.

    Raises:
        FileNotFoundError, UnsafeFileError, OSError: as :func:`~trainguard.storage.safeio.open_regular`.
    """
    fd = open_regular(path, os.O_RDONLY, what="chunk")
    try:
        if os.fstat(fd).st_size != length:
            return None
        buf = bytearray(length)
        with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
            if read_full(f, memoryview(buf)) < length or f.read(1):
                return None  # shrank or grew meanwhile
        return buf
    finally:
        os.close(fd)


class TierLink:
    """One tier as seen by a manager: its store, remote view, upload queue and state."""

    def __init__(self, tier: Tier, store: ObjectStore) -> None:
        self.tier = tier
        self.store = store
        self.remote = RemoteRoot(store)
        self.queue: deque[int] = deque()
        self.running: int | None = None
        self.failed: dict[int, str] = {}
        self.chunk_sizes: dict[str, int] | None = (
            None  # what the tier holds (listed once, then kept up to date)
        )
        self.thread: threading.Thread | None = None

    @property
    def key(self) -> str:
        return self.tier.key

    def pending(self) -> set[int]:
        """Steps queued, uploading or failed (waiting for the next retry)."""
        out = set(self.queue) | set(self.failed)
        if self.running is not None:
            out.add(self.running)
        return out


class Uploader:
    """Uploads committed checkpoints of ``hot_root`` to its tiers.

    Args:
        hot_root: the local run root checkpoints commit to first.
        links: the tiers, in order.
        event: ``event(name, **fields)`` writes to the hot root's event log.
        fsync: make the upload markers (:mod:`.intent`) durable.

    Thread safety: :meth:`submit`, :meth:`pending`, :meth:`wait` are called from the training thread (or the
    persist worker); each async tier has one upload thread; chunk PUTs run in a shared pool.
    """

    def __init__(
        self, hot_root: Path, links: list[TierLink], event: Callable[..., None], *, fsync: bool = True
    ) -> None:
        self.hot = Path(hot_root)
        self.fsync = fsync
        self.links = links
        self.event = event
        self.cond = threading.Condition()
        self.stop = threading.Event()
        # async tiers: background priority; sync tiers (dual write, ``wait()`` waits for them): normal
        self.pool = ThreadPoolExecutor(
            POOL_WORKERS, thread_name_prefix="trainguard-tier-put", initializer=lower_thread_priority
        )
        self.sync_pool = ThreadPoolExecutor(POOL_WORKERS, thread_name_prefix="trainguard-tier-sync-put")
        self.gate = StagingGate()  # async uploads wait while a save stages

    # -- caller side ----------------------------------------------------------------------------------------
    def after_commit(self, step: int) -> SaveError | None:
        """Called once ``step`` committed on the hot root: dual-write to sync tiers (now, in this thread) and
        queue the async ones. Returns a SaveError when a sync tier failed (the hot checkpoint stays; the step
        is queued to be sent again in the background)."""
        err: SaveError | None = None
        for link in self.links:
            if link.tier.sync:
                intent.mark(self.hot, link.key, step, fsync=self.fsync)
                try:
                    self.upload(link, step)
                except (OSError, TrainguardError) as e:
                    with self.cond:
                        link.failed[step] = f"{type(e).__name__}: {e}"
                    err = err or SaveError(
                        f"step {step} committed on the hot root but its replica on {link.key} failed: "
                        f"{type(e).__name__}: {e}; the hot checkpoint is intact and is sent again in the "
                        "background",
                        step=step,
                    )
        self.submit(step)
        return err

    def submit(self, step: int | None) -> None:
        """Queue ``step`` for the async tiers, and every step whose upload failed earlier for every tier."""
        with self.cond:
            for link in self.links:
                for s in sorted(link.failed):
                    if s not in link.queue and self._committed(s):
                        link.queue.append(s)
                        intent.mark(self.hot, link.key, s, fsync=self.fsync)
                link.failed.clear()
                if step is not None and not link.tier.sync and step not in link.queue:
                    intent.mark(self.hot, link.key, step, fsync=self.fsync)  # before anything is sent
                    link.queue.append(step)
                if link.queue and (link.thread is None or not link.thread.is_alive()):
                    link.thread = threading.Thread(
                        target=self._run, args=(link,), name="trainguard-tier-upload", daemon=True
                    )
                    link.thread.start()
            self.cond.notify_all()

    def pending(self) -> set[int]:
        """Steps some tier still has to receive (hot retention keeps them)."""
        with self.cond:
            out: set[int] = set()
            for link in self.links:
                out |= link.pending()
            return out

    def uploading(self, link: TierLink) -> set[int]:
        with self.cond:
            out = set(link.queue)
            if link.running is not None:
                out.add(link.running)
            return out

    def wait(self, timeout_s: float) -> dict[str, list[int]]:
        """Wait until every queue is empty (at most ``timeout_s``); return tier -> steps not uploaded."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while any(link.queue or link.running is not None for link in self.links):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.5))
            return {link.key: sorted(link.pending()) for link in self.links if link.pending()}

    def close(self) -> None:
        self.stop.set()
        self.gate.release()
        with self.cond:
            self.cond.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sync_pool.shutdown(wait=False, cancel_futures=True)

    # -- upload thread -----------------------------------------------------------------------------------
    def _committed(self, step: int) -> bool:
        return (self.hot / step_dir_name(step) / MANIFEST_NAME).exists()

    def _run(self, link: TierLink) -> None:
        lower_thread_priority()
        while not self.stop.is_set():
            with self.cond:
                if not link.queue:
                    link.thread = None
                    self.cond.notify_all()
                    return
                step = link.queue.popleft()
                link.running = step
            try:
                if self._committed(step):
                    self.upload(link, step)
                else:  # deleted from the hot root meanwhile: nothing left to send
                    intent.clear(self.hot, link.key, step)
            except BaseException as e:  # noqa: BLE001 - one failed upload must not kill the tier's thread
                with self.cond:
                    link.failed[step] = f"{type(e).__name__}: {e}"
                log.warning("upload of step %d to %s failed: %s", step, link.key, e)
            finally:
                with self.cond:
                    link.running = None
                    self.cond.notify_all()

    def upload(self, link: TierLink, step: int) -> None:
        """Send ``step`` to ``link``'s tier: missing chunks (in parallel), then the manifest, then retention.

        Raises:
            OSError / TransientStorageError: the store failed every attempt.
            CorruptCheckpointError: the hot copy of a chunk does not match its CRC32C (nothing is sent).
        """
        t0 = time.perf_counter()
        d = self.hot / step_dir_name(step)
        man = read_bounded(d / MANIFEST_NAME, MAX_MANIFEST_BYTES, what="manifest")
        m = manifest_from_json(man, root=str(self.hot), expect_step=step)

        def failed(e: BaseException, attempt: int) -> None:
            self.event(
                "tier_upload_failed",
                step=step,
                tier=link.key,
                error=f"{type(e).__name__}: {e}",
                attempt=attempt,
            )

        if link.chunk_sizes is None:
            link.chunk_sizes = with_retries(
                "list", lambda: link.store.list(CHUNKS_DIR + "/"), failed, self.stop
            )
        have = link.chunk_sizes
        todo = [rec for rec in m.chunks.values() if have.get(rec.path) != rec.length]

        # a method of the store's class only: a wrapper that forwards unknown names (a fault injector) is not
        # bypassed
        store: Any = link.store
        put_checked = store.put_checked if hasattr(type(store), "put_checked") else None

        gate = None if link.tier.sync else self.gate

        def corrupt(rec: ChunkRecord) -> CorruptCheckpointError:
            return CorruptCheckpointError(
                f"chunk {rec.path} of step {step} on the hot root does not match its length or CRC32C; "
                "not uploaded",
                step=step,
            )

        def put(rec: ChunkRecord) -> tuple[int, int]:
            """Send one chunk; returns (bytes, pauses for a save's staging)."""
            if put_checked is not None:  # streamed from the file; the store checks our CRC32C too
                try:
                    body = ChunkBody(self.hot / rec.path, rec.length, rec.crc32c, gate)  # no symlink followed
                except CorruptCheckpointError:
                    raise corrupt(rec) from None
                with body:

                    def send() -> None:
                        body.seek(0)
                        try:
                            put_checked(rec.path, body, rec.crc32c)
                        except (OSError, TrainguardError):
                            if body.problem is not None:  # withheld the last block: no object was created
                                raise corrupt(rec) from None
                            raise

                    with_retries(rec.path, send, failed, self.stop)
                pauses = body.pauses
            else:
                pauses = int(gate is not None and gate.yield_to_staging())
                data = read_chunk_file(self.hot / rec.path, rec.length)  # no symlink followed
                if data is None or crc32c.crc32c(data) != rec.crc32c:
                    raise corrupt(rec)
                pauses += int(gate is not None and gate.yield_to_staging())
                with_retries(rec.path, lambda: link.store.put(rec.path, memoryview(data)), failed, self.stop)
            have[rec.path] = rec.length
            return rec.length, pauses

        pool = self.sync_pool if link.tier.sync else self.pool
        done = [f.result() for f in [pool.submit(put, rec) for rec in todo]]
        sent, paused = sum(n for n, _ in done), sum(p for _, p in done)
        with_retries("manifest", lambda: link.store.put(manifest_name(step), man), failed, self.stop)
        intent.clear(self.hot, link.key, step)  # committed on the tier
        link.remote.forget(step)
        link.failed.pop(step, None)
        self.event(
            "tier_upload",
            step=step,
            tier=link.key,
            bytes=sent,
            chunks=len(todo),
            seconds=round(time.perf_counter() - t0, 6),
            paused=paused,
        )
        try:
            self.retain(link)
        except (OSError, TrainguardError) as e:  # retention is retried after the next upload
            log.warning("retention on %s failed: %s", link.key, e)

    def retain(self, link: TierLink) -> list[int]:
        """Apply the tier's ``keep``: never the newest valid step; manifests first, then unreferenced chunks."""
        policy = link.tier.retention
        if policy is None or isinstance(policy, KeepAll):
            return []
        chunks = link.store.list(CHUNKS_DIR + "/")
        statuses = [link.remote.status(s, chunks) for s in link.remote.committed_steps()]
        valid = [s.step for s in statuses if s.status == "valid"]
        if not valid:
            return []
        keep = select(policy, valid, {}) | {max(valid)}
        doomed = [s for s in valid if s not in keep]
        if not doomed:
            return []
        for s in doomed:
            link.store.delete(manifest_name(s))  # uncommit first
            link.store.delete(f"{step_dir_name(s)}/{CHECK_NAME}")
            link.remote.forget(s)
            self.event("tier_retention_delete", step=s, tier=link.key)
        referenced: set[str] = set()
        for st in statuses:
            if st.step in doomed:
                continue
            try:
                referenced |= {rec.path for rec in link.remote.manifest(st.step).chunks.values()}
            except (OSError, TrainguardError):
                return doomed  # an unreadable manifest: its chunks are unknown, free nothing
        for name in chunks:
            if name not in referenced:
                link.store.delete(name)
                if link.chunk_sizes is not None:
                    link.chunk_sizes.pop(name, None)
        return doomed
