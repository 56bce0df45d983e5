"""``RootContext``: what the save path, the restore path, retention and lineage work with, instead of the manager.

The manager builds one per run root and hands it to its collaborators (``_persist``, ``_restore``,
``retention.apply``, ``lineage``); none of them imports the manager. Each field is an explicit dependency:
the storage and the chunk store on it, the distributed context, the run's identity, retention's policy and
cache, the event log (``event``), and the few callbacks into the async engine, the validation and the tiers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .distributed.context import DistContext
from .distributed.options import WriterOptions
from .format.run import RunInfo
from .incremental.auto import CompressionChooser
from .incremental.chunkstore import ChunkStore
from .incremental.delta import IncrementalState
from .results import RestoreTimings, SaveResult
from .retention import RetentionPolicy
from .retention.collector import BackgroundCollection
from .retention.refs import ManifestCache
from .storage.base import Storage
from .validation.attach import Validation


class TierHooks(Protocol):
    """What the save, restore and retention paths use of a manager's tiers
    (:class:`trainguard.tiers.attach.TierSet`)."""

    def after_commit(self, step: int) -> BaseException | None:
        """Dual write / queue the uploads of a committed step; an error to raise after retention, or None."""

    def protected(self) -> set[int]:
        """Hot steps retention must keep (still to be sent to some tier)."""
        ...

    def staging(self) -> AbstractContextManager[None]:
        """Held while the training thread is inside ``save()``: async tier uploads pause meanwhile."""
        ...

    def restoring(self, ctx: Any, step: int | None = None) -> Any:
        """A context manager around a restore that reads what the hot root lacks from the tiers."""


def _no_event(name: str, **fields: Any) -> None:
    return None


@dataclass(eq=False)
class RootContext:
    """Everything one run root's save, restore and retention need (built and owned by the manager).

    Attributes:
        root: the run root directory.
        storage: its storage; ``store``: the chunk store on it.
        dist: the distributed context (rank, world size, collectives).
        options: chunking options of the writer.
        retention: the preservation policy; ``refs``: retention's cache of committed steps; ``collection``:
            the background deletion of unreferenced chunks (waited for before the chunk store is written).
        fsync: make saves durable. read_only: no writes (restore records no quarantine).
        new_run: the manager was opened with ``new_run=True``.
        run: this manager's run identity (replaced when a restore resumes a lineage).
        resumed: a restore resumed a lineage.
        event: writes one event to the run root's event log (a no-op for read-only managers).
        in_flight_since: wall time the oldest save still in flight began (now when none).
        staging_bytes: host memory held by staging buffers, in bytes.
        saves: the most recent committed saves, in commit order.
        last_restore: timings of the last restore.
        compression: decides per save whether chunks are compressed (:class:`~trainguard.incremental.auto.CompressionChooser`).
        incremental: the previous save's pieces, the delta bases (:class:`~trainguard.incremental.delta.IncrementalState`).
        validation: the validation settings and state (:class:`~trainguard.validation.attach.Validation`;
            None: no checks).
        tiers: the manager's tiers (:class:`TierHooks`; None: the hot root only).
        verify_before_load: check every needed chunk's CRC32C before a single-process restore loads any.
    """

    root: Path
    storage: Storage
    store: ChunkStore
    dist: DistContext
    options: WriterOptions
    retention: RetentionPolicy
    run: RunInfo
    fsync: bool = True
    verify_before_load: bool = True
    read_only: bool = False
    new_run: bool = False
    resumed: bool = False
    refs: ManifestCache = field(default_factory=ManifestCache)
    collection: BackgroundCollection = field(default_factory=BackgroundCollection)
    event: Callable[..., None] = _no_event
    in_flight_since: Callable[[], float] = time.time
    staging_bytes: Callable[[], int] = lambda: 0
    saves: deque[SaveResult] = field(default_factory=lambda: deque(maxlen=1000))
    last_restore: RestoreTimings = field(default_factory=RestoreTimings)
    compression: CompressionChooser | None = None
    incremental: IncrementalState | None = None
    validation: Validation | None = None
    tiers: TierHooks | None = None
