"""Restore across tiers: make the newest step valid on any tier present and intact on the hot root.

For each candidate step, newest first (steps committed on the hot root or on any tier): the manifest is read
from the hot root, else from the first tier holding one that parses; every chunk is checked on the hot root
(length and CRC32C, one full read); a chunk missing or corrupt there is read, into memory and in parallel,
from the first tier, in order, that holds it with the recorded length and CRC32C (:func:`fetch_step`). A step
with a chunk that no tier holds intact is passed over (``restore_latest`` then falls back to an older step).
Nothing is ever loaded from bytes whose CRC32C was not checked.

:func:`write_hot` then writes the fetched chunks to the hot root atomically (a ``tier_repair`` event names the
chunk, the tier it came from and the hot root) and the manifest last. A restore loads from memory first and
writes behind (:meth:`trainguard.tiers.attach.TierSet.restoring`); ``prefetch`` writes before returning
(:func:`materialize`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import crc32c

from ..catalog import read_manifest, record_check, stable_committed_steps
from ..errors import TrainguardError
from ..format import MANIFEST_NAME, Manifest, manifest_from_json, step_dir_name
from ..format.manifest import ChunkRecord
from ..storage.local import atomic_write, fsync_dir
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


Sink = Callable[[int, str, bytes, str], None]
"""``sink(step, chunk key, bytes, tier key)``: takes a chunk fetched and checked, in the fetching thread."""


def fetch_step(hot: Path, links: list[TierLink], step: int, *, sink: Sink | None = None) -> Fetched | None:
    """Read into memory what the hot root lacks of ``step``: every chunk missing or corrupt there, from the
    first tier (in order) holding it with the recorded length and CRC32C, by a pool of threads. Memory: at
    most the checkpoint's bytes (only chunks the hot root lacks are held); with ``sink``, each chunk is
    handed to it as soon as it is checked and not kept (``prefetch`` writes it to the hot root there).

    Returns:
        The fetched bytes (empty when the hot root holds the step intact), or None when a chunk is intact on
        no tier or no manifest parses.
    """
    got = _manifest(hot, links, step)
    if got is None:
        return None
    m, man_bytes = got
    bad = [rec for rec in m.chunks.values() if not _hot_intact(hot, rec)]
    out = Fetched(step, manifest=man_bytes)

    def fetch(rec: ChunkRecord) -> tuple[ChunkRecord, bytes, str] | None:
        for link in links:
            try:
                data = link.remote.read_chunk(rec)  # length and CRC32C checked
            except (OSError, TrainguardError) as e:
                log.warning("reading chunk %s from %s failed: %s", rec.path, link.key, e)
                continue
            if data is not None:
                if sink is not None:
                    sink(step, rec.path, data, link.key)
                    data = b""
                return rec, data, link.key
        return None

    if bad:
        with ThreadPoolExecutor(min(POOL_WORKERS, len(bad))) as pool:
            results = list(pool.map(fetch, bad))
        if not all(results):
            log.warning("step %d: a chunk is intact on no tier; passing it over", step)
            return None
        for rec, data, key in results:  # type: ignore[misc]  # None excluded just above
            if sink is None:
                out.files[rec.path] = data
            out.sources[rec.path] = key
    if man_bytes is not None:
        out.files[f"{step_dir_name(step)}/{MANIFEST_NAME}"] = man_bytes
    return out


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


def fetch_newest(
    hot: Path, links: list[TierLink], step: int | None = None, *, sink: Sink | None = None
) -> Fetched | None:
    """:func:`fetch_step` of ``step``, or (None) of the newest step restorable from the hot root or a tier."""
    if step is not None:
        return fetch_step(hot, links, step, sink=sink)
    for s in candidates(hot, links):
        got = fetch_step(hot, links, s, sink=sink)
        if got is not None:
            return got
    return None


def materialize(
    hot: Path,
    links: list[TierLink],
    event: Callable[..., None],
    *,
    step: int | None = None,
    fsync: bool = True,
) -> int | None:
    """Make ``step`` (default: the newest step restorable from any tier) intact on the hot root.

    Returns:
        The step made intact, or None when no candidate could be.
    """
    got = fetch_newest(hot, links, step, sink=partial(write_chunk, hot, event, fsync))  # no chunk held
    if got is None:
        return None
    write_hot(hot, got, event, fsync)
    return got.step
