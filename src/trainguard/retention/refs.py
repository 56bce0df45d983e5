"""``ManifestCache``: what retention needs to know of each committed checkpoint, kept between saves.

For every committed step the writer knows: the set of chunk hashes its manifest references, the run that wrote
it and the metrics it recorded, plus a reference count per chunk over all of them. Filled once from the
manifests under the root (at open), then kept up to date by the commits and deletions of this writer, so a save
costs retention O(its own chunks), not O(checkpoints x chunks).

Invariant: a chunk counted here is referenced by a committed manifest this writer knows; a step committed
under the root that is not in the cache yet (copied in by hand) is read before any chunk is collected
(:func:`trainguard.retention.apply.referenced_chunks` lists the root, a cheap directory listing, each time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..catalog import ParsedManifest


class ManifestCache:
    """Chunk sets, run ids and metrics of committed checkpoints, with a reference count per chunk.

    Not thread-safe: used by the writer's retention and save path, one save at a time.
    """

    def __init__(self) -> None:
        self.chunks: dict[int, frozenset[str]] = {}
        self.runs: dict[int, str] = {}  # step -> id of the run that wrote it (lineage.run_of's cache)
        self.metrics: dict[int, dict[str, Any]] = {}
        self._counts: Counter[str] = Counter()
        # Steps a full scan found usable (valid or unverified), plus the commits since; None: scan again.
        self.usable: set[int] | None = None
        self.repairs_seen = 0  # ChunkStore.repaired entries already accounted for
        # The manifest of the highest step read at open, until restore_latest takes it (the checkpoint it
        # usually loads: not parsed a second time), or restore(step), a commit or close drops it.
        self.newest: ParsedManifest | None = None

    def take_newest(self) -> ParsedManifest | None:
        """The manifest :attr:`newest` held (None if none), forgetting it."""
        parsed, self.newest = self.newest, None
        return parsed

    def add(
        self,
        step: int,
        chunks: Iterable[str],
        *,
        run_id: str | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        """Record the committed checkpoint of ``step`` (replacing what was known of that step)."""
        self.drop(step)
        hashes = frozenset(chunks)
        self.chunks[step] = hashes
        self._counts.update(hashes)
        if run_id is not None:
            self.runs[step] = run_id
        if metrics is not None:
            self.metrics[step] = dict(metrics)

    def drop(self, step: int) -> None:
        """Forget ``step`` (deleted); its chunks lose one reference each."""
        old = self.chunks.pop(step, None)
        if old:
            self._counts.subtract(old)
            for h in old:
                if self._counts[h] <= 0:
                    del self._counts[h]
        self.runs.pop(step, None)
        self.metrics.pop(step, None)
        if self.usable is not None:
            self.usable.discard(step)

    def committed(self, step: int) -> None:
        """``step`` was just committed by this writer (its bytes written or verified by the save)."""
        self.newest = None  # no longer the newest; restore_latest is over by now
        if self.usable is not None:
            self.usable.add(step)

    def invalidate(self) -> None:
        """Statuses may have changed (a restore condemned a step or moved a chunk aside, a save repaired a
        chunk): the next retention pass scans the root again."""
        self.usable = None

    def referenced(self) -> Mapping[str, int]:
        """Chunk hash -> number of known committed checkpoints referencing it (supports ``in``)."""
        return self._counts

    def steps(self) -> set[int]:
        return set(self.chunks)
