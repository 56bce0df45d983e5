"""Repair across tiers: make a step present and intact on the hot root (``prefetch``, the scrubber, and the
write-behind of a restore).

For each candidate step, newest first (steps committed on the hot root or on any tier): the manifest is read
from the hot root, else from the first tier holding one that parses; every chunk is checked on the hot root
(length and CRC32C, one full read) unless the caller already read it; a chunk missing or corrupt there is
read, in parallel, from the first tier, in order, that holds it with the recorded length and CRC32C
(:func:`fetch_step`; ``prefetch`` streams it straight to its file, :func:`download_chunk`). A step with a
chunk that no tier holds intact is passed over (``prefetch`` then tries an older step). Nothing is ever
written to the hot root from bytes whose CRC32C was not checked.

:func:`write_hot` then writes the fetched chunks to the hot root atomically (a ``tier_repair`` event names the
chunk, the tier it came from and the hot root) and the manifest last. ``prefetch`` writes before returning
(:func:`materialize`). A restore does not come through here first: it reads each chunk from the hot root or a
tier as the loader needs it (:mod:`trainguard.tiers.overlay`), and afterwards hands what it read from tiers to
:func:`fetch_step` (``have=``, not read again) and :func:`write_hot` in the background.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import crc32c

from ..catalog import read_manifest, record_check, stable_committed_steps
from ..errors import StorageFullError, TrainguardError
from ..format import MANIFEST_NAME, Manifest, manifest_from_json, step_dir_name
from ..format.manifest import ChunkRecord
from ..storage.local import atomic_write, fsync_dir, raise_classified
from ..storage.safeio import lstat_regular, read_bounded
from .upload import POOL_WORKERS, TierLink

log = logging.getLogger("trainguard")


def _hot_intact(hot: Path, rec: ChunkRecord) -> bool:
    p = hot / rec.path
    st = lstat_regular(p)
    if st is None or st.st_size != rec.length:
        return False
    try:
        data = read_bounded(p, rec.length, what="chunk")
    except OSError:
        return False
    return crc32c.crc32c(data) == rec.crc32c


def _manifest(hot: Path, links: list[TierLink], step: int) -> tuple[Manifest, bytes | None] | None:
    """The step's manifest and, when it came from a tier, its bytes (to publish on the hot root)."""
    try:
        return read_manifest(hot, step), None
    except TrainguardError:
        pass
    for link in links:
        try:
            data = link.remote.manifest_bytes(step)
            return manifest_from_json(data, root=str(hot), expect_step=step), data
        except (OSError, TrainguardError):
            continue
    return None


@dataclass
class Fetched:
    """A step made intact from the tiers, in memory: what the hot root lacks of it.

    Attributes:
        step: the step.
        files: key -> bytes read from a tier and checked (chunks; the manifest when it came from a tier).
        sources: chunk key -> the tier it was read from.
        manifest: the manifest bytes when the hot root has none (published last), else None.
    """

    step: int
    files: dict[str, bytes] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    manifest: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.files.values())


def fetch_step(
    hot: Path,
    links: list[TierLink],
    step: int,
    *,
    have: dict[str, tuple[bytes, str]] | None = None,
    hot_ok: set[str] | None = None,
    manifest: bytes | None = None,
    download: Callable[[int, ChunkRecord], str | None] | None = None,
) -> Fetched | None:
    """Read into memory what the hot root lacks of ``step``: every chunk missing or corrupt there, from the
    first tier (in order) holding it with the recorded length and CRC32C, by a pool of threads. Memory: at
    most the checkpoint's bytes (only chunks the hot root lacks are held); none with ``download``.

    Args:
        hot: the hot root.
        links: the tiers, in order.
        step: the step.
        have: chunk key -> (bytes, tier key) already read from a tier and checked (a restore's reads): kept,
            not read again.
        hot_ok: chunk keys already read from the hot root and found intact: not read again.
        manifest: the manifest's bytes when the caller read them from a tier (the hot root lacks it).
        download: ``download(step, rec) -> tier key | None`` writes a chunk the hot root lacks to it directly
            (:func:`download_chunk`) instead of reading it into memory.

    Returns:
        The fetched bytes (empty when the hot root holds the step intact), or None when a chunk is intact on
        no tier or no manifest parses.
    """
    if manifest is not None:
        try:
            got: tuple[Manifest, bytes | None] | None = (
                manifest_from_json(manifest, root=str(hot), expect_step=step),
                manifest,
            )
        except TrainguardError:
            got = None
    else:
        got = _manifest(hot, links, step)
    if got is None:
        return None
    m, man_bytes = got
    have = have or {}
    hot_ok = hot_ok or set()
    out = Fetched(step, manifest=man_bytes)
    bad = []
    for rec in m.chunks.values():
        if rec.path in have:
            out.files[rec.path], out.sources[rec.path] = have[rec.path]
        elif rec.path not in hot_ok and not _hot_intact(hot, rec):
            bad.append(rec)

    def fetch(rec: ChunkRecord) -> tuple[ChunkRecord, bytes, str] | None:
        if download is not None:
            key = download(step, rec)
            return None if key is None else (rec, b"", key)
        for link in links:
            try:
                data = link.remote.read_chunk(rec)  # length and CRC32C checked
            except (OSError, TrainguardError) as e:
                log.warning("reading chunk %s from %s failed: %s", rec.path, link.key, e)
                continue
            if data is not None:
                return rec, data, link.key
        return None

    if bad:
        with ThreadPoolExecutor(min(POOL_WORKERS, len(bad))) as pool:
            results = list(pool.map(fetch, bad))
        if not all(results):
            log.warning("step %d: a chunk is intact on no tier; passing it over", step)
            return None
        for rec, data, key in results:  # type: ignore[misc]  # None excluded just above
            if download is None:
                out.files[rec.path] = data
            out.sources[rec.path] = key
    if man_bytes is not None:
        out.files[f"{step_dir_name(step)}/{MANIFEST_NAME}"] = man_bytes
    return out


STREAM_BLOCK = 8 << 20
"""Bytes a download writes at a time (:func:`stream_chunk`)."""


def stream_chunk(hot: Path, link: TierLink, rec: ChunkRecord, fsync: bool) -> bool:
    """Download one chunk from ``link``'s tier to the hot root, writing each block as it arrives (the write of
    one block overlaps the transfer of the next) into a temporary sibling, checked against the recorded length
    and CRC32C on the bytes written, then renamed into place (atomic). A tier without a block-wise read (no
    ``stream`` method) is read whole.

    Returns:
        True when the chunk is in place; False when the tier's copy is missing or does not match (nothing is
        left behind on the hot root).

    Raises:
        OSError: the hot root could not be written (StorageFullError on ENOSPC); the tier's errors propagate
            (TransientStorageError) after the temporary file is removed.
    """
    # a method of the store's class only: a wrapper that forwards unknown names (a fault injector) is not bypassed
    store: Any = link.store
    stream = store.stream if hasattr(type(store), "stream") else None
    path = hot / rec.path
    path.parent.mkdir(parents=True, exist_ok=True)
    if stream is None:
        data = link.remote.read_chunk(rec)
        if data is None:
            return False
        atomic_write(path, data, fsync=fsync)
        return True
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    crc, n, ok = 0, 0, False
    try:
        try:
            for block in stream(rec.path, STREAM_BLOCK):
                n += len(block)
                if n > rec.length:
                    break
                crc = crc32c.crc32c(block, crc)
                view = memoryview(block)
                while len(view):
                    view = view[os.write(fd, view) :]
            ok = n == rec.length and crc == rec.crc32c
            if ok and fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        tmp.unlink(missing_ok=True)
        return False
    except TrainguardError:  # the tier's (TransientStorageError): the caller tries the next tier
        tmp.unlink(missing_ok=True)
        raise
    except OSError as e:  # the hot root's disk: StorageFullError for ENOSPC
        tmp.unlink(missing_ok=True)
        raise_classified(e, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if not ok:
        tmp.unlink(missing_ok=True)
        return False
    try:
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise_classified(e, path)
    if fsync:
        fsync_dir(path.parent)
    return True


def download_chunk(
    hot: Path, links: list[TierLink], event: Callable[..., None], fsync: bool, step: int, rec: ChunkRecord
) -> str | None:
    """Download ``rec`` to the hot root from the first tier holding it intact (:func:`stream_chunk`) and emit
    ``tier_repair``; returns the tier's key, or None when no tier holds it intact."""
    for link in links:
        try:
            done = stream_chunk(hot, link, rec, fsync)
        except StorageFullError:
            raise  # the hot root is full: no tier helps
        except (OSError, TrainguardError) as e:
            log.warning("reading chunk %s from %s failed: %s", rec.path, link.key, e)
            continue
        if done:
            event("tier_repair", step=step, chunk=rec.path, **{"from": link.key, "to": str(hot)})
            return link.key
        log.warning("chunk %s on %s is missing or does not match its CRC32C", rec.path, link.key)
    return None


def write_chunk(
    hot: Path, event: Callable[..., None], fsync: bool, step: int, key: str, data: bytes, src: str
) -> None:
    """Write one checked chunk to the hot root atomically and emit ``tier_repair``."""
    p = hot / key
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, data, fsync=fsync)
    event("tier_repair", step=step, chunk=key, **{"from": src, "to": str(hot)})


def write_hot(hot: Path, got: Fetched, event: Callable[..., None], fsync: bool = True) -> None:
    """Write what :func:`fetch_step` read to the hot root: chunks first (atomic each, in parallel, a
    ``tier_repair`` event per chunk), the manifest last (the commit), with the check record before it."""
    step = got.step
    todo = [(key, src) for key, src in got.sources.items() if key in got.files]
    if todo:
        with ThreadPoolExecutor(min(POOL_WORKERS, len(todo))) as pool:
            list(
                pool.map(
                    lambda ks: write_chunk(hot, event, fsync, step, ks[0], got.files[ks[0]], ks[1]), todo
                )
            )
    d = hot / step_dir_name(step)
    if got.manifest is not None:
        created = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        if created and fsync:
            fsync_dir(hot)
        record_check(hot, step, by="tier")
        atomic_write(d / MANIFEST_NAME, got.manifest, fsync=fsync)
    else:
        record_check(hot, step, by="verify")  # every chunk was just read and matched


def candidates(hot: Path, links: list[TierLink]) -> list[int]:
    """Steps committed on the hot root or on any tier, newest first."""
    found = set(stable_committed_steps(hot)) if hot.is_dir() else set()
    for link in links:
        try:
            found |= set(link.remote.committed_steps())
        except (OSError, TrainguardError) as e:
            log.warning("cannot list tier %s: %s", link.key, e)
    return sorted(found, reverse=True)


def materialize(
    hot: Path,
    links: list[TierLink],
    event: Callable[..., None],
    *,
    step: int | None = None,
    fsync: bool = True,
) -> int | None:
    """Make ``step`` (default: the newest step restorable from any tier) intact on the hot root: each chunk the
    hot root lacks is downloaded straight to its file (:func:`download_chunk`, by a pool of threads; no chunk
    held in memory), then the manifest is published.

    Returns:
        The step made intact, or None when no candidate could be.
    """
    for s in [step] if step is not None else candidates(hot, links):
        got = fetch_step(hot, links, s, download=partial(download_chunk, hot, links, event, fsync))
        if got is not None:
            write_hot(hot, got, event, fsync)
            return got.step
    return None
