"""Restore across tiers: make the newest step valid on any tier present and intact on the hot root.

For each candidate step, newest first (steps committed on the hot root or on any tier): the manifest is read
from the hot root, else from the first tier holding one that parses; every chunk is checked on the hot root
(length and CRC32C, one full read); a chunk missing or corrupt there is read from the first tier, in order,
that holds it with the recorded length and CRC32C, and written to the hot root atomically (a ``tier_repair``
event names the chunk, the tier it came from and the hot root). A step with a chunk that no tier holds
intact is passed over (``restore_latest`` then falls back to an older step). Nothing is ever loaded from
bytes whose CRC32C was not checked.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import crc32c

from ..catalog import read_manifest, record_check, stable_committed_steps
from ..errors import TrainguardError
from ..format import MANIFEST_NAME, Manifest, manifest_from_json, step_dir_name
from ..format.manifest import ChunkRecord
from ..storage.local import atomic_write, fsync_dir
from ..storage.safeio import lstat_regular, read_bounded
from .upload import POOL_WORKERS, TierLink

if TYPE_CHECKING:
    from collections.abc import Callable

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


def repair_step(
    hot: Path, links: list[TierLink], step: int, event: Callable[..., None], fsync: bool = True
) -> bool:
    """Make ``step`` complete and intact on the hot root from the tiers; True when it is."""
    got = _manifest(hot, links, step)
    if got is None:
        return False
    m, man_bytes = got
    bad = [rec for rec in m.chunks.values() if not _hot_intact(hot, rec)]

    def fetch(rec: ChunkRecord) -> bool:
        for link in links:
            try:
                data = link.remote.read_chunk(rec)
            except (OSError, TrainguardError) as e:
                log.warning("reading chunk %s from %s failed: %s", rec.path, link.key, e)
                continue
            if data is None:
                continue
            p = hot / rec.path
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, data, fsync=fsync)
            event("tier_repair", step=step, chunk=rec.path, **{"from": link.key, "to": str(hot)})
            return True
        return False

    if bad:
        with ThreadPoolExecutor(min(POOL_WORKERS, len(bad))) as pool:
            if not all(pool.map(fetch, bad)):
                log.warning("step %d: a chunk is intact on no tier; passing it over", step)
                return False
    d = hot / step_dir_name(step)
    if man_bytes is not None:
        created = not d.exists()
        d.mkdir(parents=True, exist_ok=True)
        if created and fsync:
            fsync_dir(hot)
        record_check(hot, step, by="tier")
        atomic_write(d / MANIFEST_NAME, man_bytes, fsync=fsync)
    else:
        record_check(hot, step, by="verify")  # every chunk was just read and matched
    return True


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
    if step is not None:
        return step if repair_step(hot, links, step, event, fsync) else None
    candidates = set(stable_committed_steps(hot)) if hot.is_dir() else set()
    for link in links:
        try:
            candidates |= set(link.remote.committed_steps())
        except (OSError, TrainguardError) as e:
            log.warning("cannot list tier %s: %s", link.key, e)
    for s in sorted(candidates, reverse=True):
        if repair_step(hot, links, s, event, fsync):
            return s
    return None
