"""``CheckpointManager``: the one place that wires the pieces together (DESIGN.md section 2).

Typical use (DESIGN.md section 1)::

    mgr = tg.CheckpointManager("ckpts/run1", save_policy=tg.EveryNSteps(100), keep=3)
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
    start = mgr.restore_latest(state)          # newest VALID step loaded in place, or None
    for step in range((start or 0) + 1, total_steps + 1):
        loss = train_step(...)
        mgr.maybe_save(step, state, metrics={"loss": loss})
    mgr.close()
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _persist, _restore, _statefn, lineage
from ._config import (
    check_distributed_options,
    check_options,
    open_root,
    open_storage,
    root_problem,
    validation_options,
)
from ._context import RootContext
from ._lock import RootLock
from .catalog import CheckpointInfo, inspect_step, is_committed, scan
from .distributed.context import DistContext
from .distributed.options import WriterOptions
from .errors import (
    CheckpointExistsError,
    ConfigError,
    ManagerClosedError,
    NoValidCheckpointError,
    ReadOnlyManagerError,
    RootLockedError,
    SaveError,
    TrainguardError,
)
from .eventlog import OWN_EVENTS, EventLog
from .format import step_dir_name
from .format.run import RunInfo, new_run_id
from .incremental.auto import CompressionChooser
from .incremental.chunkstore import ChunkStore
from .incremental.delta import IncrementalState
from .policies import SavePolicy
from .results import RestoreTimings, SaveResult
from .retention import RetentionPolicy, as_retention
from .retention.apply import apply_retention, cleanup_after_crash
from .staging import PendingSave, Stager
from .staging.persister import AsyncPersister, SaveRequest, register_exit_flush
from .state import per_rank
from .storage.base import Storage

if TYPE_CHECKING:
    from .validation.scrub import Scrubber
    from .validation.trajectory import Recorder

log = logging.getLogger("trainguard")
SAVES_KEPT = 1000  # results kept in CheckpointManager.saves (the most recent ones)

PROGRESS_INTERVAL_S = 10.0
"""``maybe_save`` logs a ``progress`` event (rank 0 only) at most this often: the step over wall time that
``trainguard report`` plots between checkpoints (about 45 MB of event log per 30 days of training)."""


class CheckpointManager:
    """Saves and restores the whole training state under one run root.

    Args:
        root: the run root directory (created if missing), or its :class:`~trainguard.storage.Storage`
            (e.g. a :class:`~trainguard.storage.FaultyStorage` in fault tests; ``fsync`` and ``durability``
            are then the storage's own).
        save_policy: decides the steps ``maybe_save`` saves at (default: every 1000 steps).
        keep: retention: an int N keeps the newest N valid checkpoints, a RetentionPolicy, or None to keep all.
            Applied only after a new checkpoint commits; the newest valid checkpoint is never deleted.
        read_only: open without the write lock (list, verify and restore only); local by default (no
            collective, see ``collective``).
        fsync: make every save durable (default True).
        durability: how chunk files are made durable: ``"batched"`` (default: one ``syncfs(2)`` of the run
            root's filesystem per rank per save, after all chunks are written, then the renames into
            ``chunks/``; per-file fsyncs where ``syncfs`` is missing) or ``"per_file"`` (fsync every chunk
            file and directory). ``syncfs`` also flushes other processes' dirty data on that filesystem.
        chunk_size_bytes: largest chunk, in bytes (default 64 MiB).
        save_on_preemption: on SIGTERM, save at the next ``maybe_save`` and exit cleanly.
        async_save: persist in a background thread; the caller blocks only for the copy into staging buffers
            (default True).
        staging_buffers: staging buffer sets (2: double-buffered; host memory up to 2x the state's tensors).
        when_busy: what ``maybe_save`` does when every buffer set is still persisting earlier saves:
            ``"wait"`` (block until one is free, default) or ``"skip"`` (skip this save, logging a
            ``save_skipped`` event). ``save`` always waits.
        save_timeout_s: a background save that makes no progress (no chunk written or deduplicated, no flush
            finished) for this many seconds is abandoned: it fails with a SaveError naming its step (raised by
            the next ``save``/``maybe_save``/``wait``/``close``), commits nothing, and its staging buffers
            are replaced so that the next save can run; ``close()`` returns after at most this long per
            stuck save. None (default) waits forever. Single process only.
        new_run: start a new run on a root that holds another run's checkpoints without resuming it: the old
            run's checkpoints stay (retention never orders them against the new run's, ``restore_latest``
            follows the run that committed last). Without it, the first save of a manager that did not
            restore refuses with RunConflictError when the root holds another run's checkpoint at or after
            that step (a first save after every existing checkpoint continues the root's newest run).
        collective: take part in torch.distributed collectives (default: True for a writer, False for
            ``read_only``). A collective manager must be constructed on every rank; a local one may be opened
            on one rank alone and never calls a collective (each rank then chooses its step on its own).
        dist_timeout_s: timeout of trainguard's own process groups, in seconds (default: the timeout given to
            ``init_process_group``), so a dead rank fails a save or restore in the time the user chose.
        metrics_registry: the prometheus-client registry that receives this manager's save metrics
            (``trainguard_save_block_seconds``, ``trainguard_save_persist_seconds``,
            ``trainguard_checkpoint_bytes``, ``trainguard_save_failures_total``); None: a private one, see
            :attr:`metrics_registry`. Pass ``prometheus_client.REGISTRY`` to export through the default one.
        check_finite: ``"error"`` (default): a save whose floating tensors hold NaN/Inf is rejected in the persist
            path (NonFiniteStateError, nothing committed, retention not run) and a restored checkpoint holding
            NaN/Inf is suspect (``restore_latest`` falls back); ``"warn"``: log and go on; ``"off"``.
        probe: ``fn() -> tensor | dict[str, tensor]`` computed from the live training objects on a fixed probe
            batch (model in eval mode, under no_grad; it must not change any state). Run in the caller at each
            save and stored with the checkpoint; after a restore it runs again and must match, else the
            checkpoint is suspect and ``restore_latest`` falls back to an older one.
        probe_rtol: relative tolerance of the probe comparison (0 with ``probe_atol`` 0: bitwise, the
            default; set both for another device, dtype or world size).
        probe_atol: absolute tolerance of the probe comparison.
        trajectory_steps: after a restore, the losses given to ``maybe_save(metrics={"loss": ...})`` for this
            many steps are compared with those logged before the failure; a divergence raises
            ResumeDivergedError and marks the checkpoints suspect (0: off).
        scrub_interval_s: re-verify the committed checkpoints in a background thread every this many seconds
            (None: off); damage found is recorded (``corrupt``) and logged before a restore needs it. With
            ``tiers``, a chunk found corrupt or missing on the hot root is re-fetched from the first tier
            holding it with the recorded CRC32C and rewritten (``tier_repair`` event); the step is re-verified
            and its ``corrupt`` marker cleared only when every damaged chunk was repaired.
        scrub_max_bandwidth: cap on the background scrubber's read rate, in bytes per second (a number) or a
            rate with a unit as ``trainguard verify --max-bandwidth`` takes it (``"200MB/s"``, ``"1GiB/s"``,
            ``"800Mbps"``); None (default): uncapped.
        compression: ``"auto"`` (default: compress a save's chunks, byte shuffle + zstd-1 via blosc2, only when
            that measured faster on this storage: the write time of this manager's own saves both ways; before
            compression was measured, a model of bandwidth, codec speed and ratio decides whether to try it;
            the decision and its inputs are logged and in each ``save`` event), ``"zstd"`` (always: space over
            time) or ``"off"``.
        delta: write each changed tensor piece as a delta (integer difference) against the same piece of the
            previous save when that is smaller than compressing it alone; only in compressed saves. Holds one
            host copy of the last saved tensors (default False).
        max_chain: a save writes no new delta at least every ``max_chain`` saves, and no chunk's chain of
            delta bases reaches ``max_chain`` links (default 10), bounding what a restore reads.

    Raises:
        RootLockedError: another process holds the write lock of ``root``.
        ConfigError: an invalid argument, or a root that is not usable: a file, a dangling symlink, on a
            read-only filesystem or without write permission (for writers).
        UnsafeFileError: ``root/.lock`` or ``root/events`` is a symlink or the wrong kind of file.

    Collective calls (every rank, same order, when torch.distributed is initialized and the manager is
    collective): the constructor, ``save``, ``maybe_save``, ``restore``, ``restore_latest``, ``close``.
    Local: ``checkpoints``, ``latest_step``, ``wait`` and every call of a local (read-only) manager.

    Not thread-safe: call it from the training loop's thread.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | Storage,
        *,
        save_policy: SavePolicy | None = None,
        keep: int | RetentionPolicy | None = None,
        read_only: bool = False,
        fsync: bool = True,
        durability: str = "batched",
        chunk_size_bytes: int = 64 << 20,
        save_on_preemption: bool = False,
        async_save: bool = True,
        staging_buffers: int = 2,
        when_busy: str = "wait",
        save_timeout_s: float | None = None,
        new_run: bool = False,
        collective: bool | None = None,
        dist_timeout_s: float | None = None,
        metrics_registry: Any = None,
        check_finite: str = "error",
        probe: Any = None,
        probe_rtol: float = 0.0,
        probe_atol: float = 0.0,
        trajectory_steps: int = 50,
        scrub_interval_s: float | None = None,
        scrub_max_bandwidth: float | str | None = None,
        tiers: list[Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        compression: str = "auto",
        delta: bool = False,
        max_chain: int = 10,
    ) -> None:
        from .policies import EveryNSteps
        from .storage.objects import is_url

        self.url: str | None = None
        self._tiers: Any = None
        self._store_lock: Any = None
        tiers = list(tiers or [])
        if is_url(root):  # an object-store run root: a local cache as the hot root, the URL as a sync replica
            from .tiers.config import Tier

            self.url = str(root).rstrip("/")
            tiers.insert(0, Tier(self.url, keep=keep, sync=True, storage_options=storage_options))
            root = _cache_root(self.url)
            keep = 1 if keep is not None else None  # the cache keeps the newest; the store keeps ``keep``
        elif storage_options is not None:
            raise ConfigError(
                "storage_options applies to a URL run root; give a tier's options in tg.Tier(...)"
            )
        self.storage = open_storage(root, fsync=fsync, durability=durability)
        self.root: Path = self.storage.local_path  # type: ignore[assignment]  # open_storage checked it
        self.read_only = read_only
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(1000)
        collective = check_options(
            save_policy=self.save_policy,
            when_busy=when_busy,
            dist_timeout_s=dist_timeout_s,
            collective=collective,
            read_only=read_only,
            staging_buffers=staging_buffers,
            save_timeout_s=save_timeout_s,
        )
        self.retention = as_retention(keep)
        self.scrub_max_bandwidth: float | None = validation_options(
            check_finite=check_finite,
            probe=probe,
            probe_rtol=probe_rtol,
            probe_atol=probe_atol,
            trajectory_steps=trajectory_steps,
            scrub_interval_s=scrub_interval_s,
            scrub_max_bandwidth=scrub_max_bandwidth,
        )
        self.check_finite: str = check_finite
        self.probe: Callable[[], Any] | None = probe
        self.probe_rtol = float(probe_rtol)
        self.probe_atol = float(probe_atol)
        self.trajectory_steps: int = trajectory_steps
        self.scrub_interval_s = None if scrub_interval_s is None else float(scrub_interval_s)
        # step -> (probe outputs, seconds the probe took), until the save of that step commits or fails
        self._probes: dict[int, tuple[dict[str, Any], float]] = {}
        self._validate_s = 0.0  # the non-finite scan of the last load, in seconds
        self._trajectory: Recorder | None = None  # set for a writer (below)
        self._scrubber: Scrubber | None = None
        # with deltas, tensors of 64 KiB and more get chunks of their own (a delta needs the same piece in the
        # previous save; a shared pack of many small tensors changes whenever any of them does)
        self.options = WriterOptions(
            chunk_size_bytes=chunk_size_bytes,
            pack_threshold_bytes=min((64 << 10) if delta else (1 << 20), chunk_size_bytes),
        )
        try:
            self.compression = CompressionChooser(compression, threads=self.options.threads)
            if isinstance(max_chain, bool) or not isinstance(max_chain, int):
                raise ValueError(f"max_chain must be an int >= 1, got {max_chain!r}")
            self.incremental = IncrementalState(delta=bool(delta), max_chain=max_chain)
        except ValueError as e:
            raise ConfigError(f"{e}; see the compression, delta and max_chain arguments") from None
        if delta and compression == "off":
            raise ConfigError("delta=True needs compressed saves; pass compression='auto' or 'zstd'")
        self.store = ChunkStore(self.storage)
        self.fsync = fsync
        self.dist = DistContext(collective=collective, timeout_s=dist_timeout_s)
        self.new_run = bool(new_run)
        # Run identity: rank 0 draws the id, every rank records the same one.
        run = RunInfo(self.dist.broadcast_bytes(new_run_id().encode()).decode())
        self.ctx = RootContext(
            root=self.root,
            storage=self.storage,
            store=self.store,
            dist=self.dist,
            options=self.options,
            retention=self.retention,
            run=run,
            fsync=fsync,
            read_only=read_only,
            new_run=self.new_run,
            event=self._event,
            in_flight_since=lambda: self._persister.in_flight_since() if self._persister else time.time(),
            staging_bytes=lambda: self.staging_bytes,
            saves=deque(maxlen=SAVES_KEPT),  # the most recent committed saves of this manager, in order
            compression=self.compression,
            incremental=self.incremental,
            host=self,  # validation (issue 11) reads its settings and state from the manager
        )
        self._run_checked = read_only
        check_distributed_options(
            dist_enabled=self.dist.enabled, when_busy=when_busy, save_timeout_s=save_timeout_s
        )
        self.save_timeout_s = None if save_timeout_s is None else float(save_timeout_s)
        self.async_save = bool(async_save)
        self.when_busy = when_busy
        self._stager: Stager | None = Stager(staging_buffers) if async_save and not read_only else None
        self._persister: AsyncPersister | None = None
        if (
            self._stager is not None
        ):  # the async engine: queue, worker thread, in-flight saves, stall watchdog
            self._persister = AsyncPersister(
                self._persist_request,
                self._stager,
                save_timeout_s=self.save_timeout_s,
                last_progress=lambda: self.store.last_progress,
                event=self._event,
                on_persisted=lambda step, staging_s, result: self.save_policy.record_save(
                    step, now_s=time.monotonic(), block_s=staging_s, persist_s=result.persist_s
                ),
                rank=self.dist.rank,
                where=str(self.root),
            )
        self._exit_flush: Any = None
        self._closed = False
        self._lock: RootLock | None = None
        self._events: EventLog | None = None
        self._first_step_logged = False
        self._progress_t: float | None = None  # monotonic time of the last progress event (or first_step)
        self._metrics: Any = None
        if read_only:
            if self.url is not None or tiers:  # the hot root a restore from the tiers copies into
                self.root.mkdir(parents=True, exist_ok=True)
            if not self.root.is_dir():
                raise ConfigError(root_problem(self.root) or f"run root {self.root} is not a directory")
            if tiers:
                self._open_tiers(tiers, writer=False)
            return
        self._layout_ok = False  # checked at the first save (ChunkStore.layout_problem)
        self._events = open_root(self.root)
        from .observe.metrics import SaveMetrics

        self._metrics = SaveMetrics(metrics_registry)
        self._events.listeners.append(self._metrics.observe)
        if self.dist.enabled:
            self._events.set_context(rank=self.dist.rank, world_size=self.dist.world_size)
        locked = ""
        if (
            self.dist.is_coordinator
        ):  # one writer per root: rank 0 holds the lock and owns cleanup and retention
            try:
                self._lock = RootLock(self.root, self.url)
                self._lock.acquire()
                cleanup_after_crash(self.ctx)
            except RootLockedError as e:
                locked = str(e)
            except BaseException:
                self._events.close()
                raise
        if self.dist.enabled and self.dist.any(bool(locked)):
            raise RootLockedError(locked or f"rank 0 could not lock {self.root} (another writer holds it)")
        if locked:
            self._events.close()
            raise RootLockedError(locked)
        bind = getattr(self.save_policy, "bind", None)
        if callable(bind):
            bind(str(self.root), self._events)
        self._preemption = False
        if save_on_preemption:
            from .recovery.heartbeat import install_preemption_handler

            install_preemption_handler()
            self._preemption = True
        self._events.set_context(checkpoint_run_id=self.run.run_id)
        if tiers:
            try:
                self._open_tiers(tiers, writer=True)
            except BaseException:
                if self._lock is not None:
                    self._lock.release()
                self._events.close()
                raise
        self._exit_flush = register_exit_flush(self, str(self.root))  # an async save is never lost at exit
        self._events.write("manager_start", root=str(self.root), new_run=self.new_run)
        from .validation.trajectory import Recorder

        self._trajectory = Recorder(
            self.root,
            self.run.run_id,
            self.trajectory_steps,
            coordinator=self.dist.is_coordinator,
            world_size=self.dist.world_size,
        )
        if self.scrub_interval_s is not None and self.dist.is_coordinator:
            from .validation.scrub import Scrubber

            self._scrubber = Scrubber(
                self,
                self.scrub_interval_s,
                max_bytes_per_s=self.scrub_max_bandwidth,
                tiers=self._tiers,
            )
            self._scrubber.start()

    # -- context manager ----------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending saves, stop the background worker and release the write lock. Idempotent.

        Raises:
            SaveError: a background save failed and nobody has seen its error yet (the lock is released first).
        """
        if self._closed:
            return
        err: BaseException | None = None
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
            err = e
        abandoned = sorted(self._persister.abandoned_steps()) if self._persister else []
        if abandoned:
            log.error(
                "close(): the saves of steps %s were abandoned (no progress); nothing was committed",
                abandoned,
            )
        self._closed = True
        if self._scrubber is not None:
            self._scrubber.stop()
        if self._trajectory is not None:
            self._trajectory.close()
        if self._exit_flush is not None:
            import atexit

            atexit.unregister(self._exit_flush)  # where threading's exit hook is used, flush sees _closed
        if self._persister is not None:
            self._persister.stop()
        if self._tiers is not None:
            try:
                self._tiers.close()  # waits up to upload_timeout_s; TierUploadError names what is missing
                if err is None and self._lock is not None:
                    apply_retention(self.ctx)  # steps kept only while they uploaded: sent now, policy applies
            except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
                err = err or e
            finally:
                if self._store_lock is not None:
                    from .tiers.attach import release_store_lock

                    release_store_lock(self._store_lock)
        if self._events is not None:
            self._events.close()
        if self._lock is not None:
            self._lock.release()
        if err is not None:
            raise err

    def _open_tiers(self, tiers: list[Any], *, writer: bool) -> None:
        """Open and check the tiers (configuration errors raise here), lock a URL root, record the tiers in
        the hot root and queue the committed steps a tier is missing."""
        from .catalog import stable_committed_steps
        from .tiers.attach import TierSet, acquire_store_lock, open_links

        links = open_links(self.root, tiers, self._event, fsync=self.fsync, writer=writer)
        self._tiers = TierSet(self.root, links, self._event, fsync=self.fsync)
        if not writer:
            return
        if self.url is not None and self.dist.is_coordinator:
            from .tiers.attach import prune_cache

            acquire_store_lock(links[0].store, self.url)
            self._store_lock = links[0].store
            prune_cache(self.root, links[0])
        if self.dist.is_coordinator:
            self._tiers.record()
            self._tiers.resume(stable_committed_steps(self.root))

    def _check_writable(self) -> None:
        if self._closed:
            raise ManagerClosedError("this CheckpointManager is closed; create a new one")
        if self.read_only:
            raise ReadOnlyManagerError(
                "this CheckpointManager was opened with read_only=True; it cannot save"
            )

    def _event(self, name: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(name, **fields)

    def log_event(self, event: str, **fields: Any) -> None:
        """Append an event of your own to the run's event log (``events/``), e.g. a fault injected on purpose.

        The record gets ``t``, ``time``, ``source`` ("manager"), ``pid`` and, where known, ``rank``, ``run_id``
        and ``restart_count``, like trainguard's own events. ``trainguard report`` joins a ``fault_injected``
        event (fields ``kind`` and ``step``) to the failure that follows it in the same attempt. Log it before
        the fault fires: a line is handed to the OS at once, so it survives a SIGKILL right after.

        Args:
            event: the event name (not one of trainguard's own:
                :data:`trainguard.eventlog.OWN_EVENTS`).
            **fields: JSON-serializable fields.

        Raises:
            ConfigError: an empty name or one of trainguard's own event names.
            ReadOnlyManagerError, ManagerClosedError: the manager is read-only or closed (no event log then).
        """
        if not isinstance(event, str) or not event.strip():
            raise ConfigError(f"event must be a non-empty string, got {event!r}")
        if event in OWN_EVENTS:
            raise ConfigError(
                f"{event!r} is an event trainguard writes itself; give your event another name "
                "(e.g. 'fault_injected' or 'user_note')"
            )
        if self._events is None or self._closed:
            raise (ManagerClosedError if self._closed else ReadOnlyManagerError)(
                "this CheckpointManager has no event log (read_only=True or closed); log from the writer"
            )
        self._events.write(event, **fields)

    # -- saving -------------------------------------------------------------------------------------------
    def maybe_save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> PendingSave | None:
        """Beat the heartbeat and save if the save policy says so (or a preemption was requested).

        Args:
            step: the step just completed.
            state: what ``save`` takes.
            metrics: numbers recorded in the manifest (e.g. loss; ``KeepBest`` ranks by them).
            force: save whatever the policy says, e.g. ``force=step == total_steps`` so the final steps of a
                run whose length is not a multiple of the interval are not lost at a normal end. No second
                save when this step is already committed or being saved; a forced save waits for a free
                staging buffer even with ``when_busy="skip"``. Under torch.distributed pass the same value on
                every rank.

        Returns:
            The PendingSave, or None when no save was due.

        Raises:
            TrainguardError: what ``save`` raises (``SaveError``, ``CheckpointExistsError``, ``ConfigError``),
                including the error of an earlier background save.
        """
        from .recovery.heartbeat import heartbeat, preemption_requested

        heartbeat(step)
        self._record_loss(step, metrics)
        if not self._first_step_logged:
            self._first_step_logged = True
            self._event("first_step", step=step)
        if self.dist.is_coordinator:
            now = time.monotonic()
            if self._progress_t is None:
                self._progress_t = now
            elif now - self._progress_t >= PROGRESS_INTERVAL_S:
                self._event("progress", step=step)
                self._progress_t = now
        if self._preemption and self.dist.any(preemption_requested()):  # every rank agrees on the step
            self._event("preemption", step=step)
            from .recovery.heartbeat import exit_after_preemption_save

            if not self._in_flight(step) and not is_committed(self.storage, step):
                self.save(step, state, metrics=metrics)
            self.close()
            exit_after_preemption_save()
        self._raise_background_error()
        if force:
            if self._in_flight(step) or is_committed(self.storage, step):
                return None  # the policy already saved this step
            return self._save(step, state, metrics=metrics, metadata=None, overwrite=False, block=True)
        if self._should_save(step):
            return self._save(
                step, state, metrics=metrics, metadata=None, overwrite=False, block=self.when_busy == "wait"
            )
        return None

    def _record_loss(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Append the step's loss to the run's trajectory log; after a restore, check it (collective while the
        check is armed: every rank calls ``maybe_save`` each step, with or without a loss)."""
        tr = self._trajectory
        if tr is None:
            return
        armed = tr.check is not None
        bad = tr.record(step, metrics)
        if not armed:
            return
        if self.dist.enabled:
            bad = self.dist.any(bad)
        if bad:
            from .validation.hooks import diverged

            raise diverged(self, step)
        tr.passed(step)

    def _arm_trajectory(self, step: int) -> None:
        if self._trajectory is not None:
            self._trajectory.arm(step)

    def _should_save(self, step: int) -> bool:
        decision = self.save_policy.should_save(step, now_s=time.monotonic())
        if self.dist.enabled and not getattr(self.save_policy, "step_based", False):
            decision = bool(
                self.dist.broadcast_ints([int(decision)])[0]
            )  # rank 0 decides for time-based policies
        return decision

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> PendingSave:
        """Save ``state`` as the checkpoint of ``step``.

        With ``async_save=True`` (the default) this blocks only while the state is copied into a free staging
        buffer set (waiting for one if every set is busy) and returns a :class:`PendingSave`; CRC32C, chunking,
        writing and the commit run in the background. With ``async_save=False`` it returns once committed.

        Args:
            step: the training step (int >= 0).
            state: name -> object with state_dict()/load_state_dict(), tensor, or nested dict/list/tuple of
                tensors and plain Python values.
            metrics: numbers recorded in the manifest (e.g. loss).
            metadata: JSON-able user metadata recorded in the manifest.
            overwrite: replace an existing checkpoint of this step.

        Returns:
            A PendingSave; ``wait()`` returns the SaveResult or raises the background error.

        Raises:
            CheckpointExistsError: the step is already committed (or being saved) and ``overwrite`` is False.
            SaveError: an earlier background save failed (raised once, here or from wait/close), or, for
                synchronous saves, this save failed. StorageFullError (a SaveError) when the disk is full.
                Nothing is committed by a failed save and earlier checkpoints are intact.
        """
        return self._save(step, state, metrics=metrics, metadata=metadata, overwrite=overwrite, block=True)

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        overwrite: bool,
        block: bool,
    ) -> PendingSave:
        self._check_writable()
        self._raise_background_error()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        if not self._layout_ok:  # never report success for checkpoints that restore would refuse
            bad_layout = self.store.layout_problem()
            if bad_layout is not None:
                raise ConfigError(bad_layout)
            self._layout_ok = True
        if not self._run_checked:
            lineage.check_before_first_save(self.ctx, step)
            self._run_checked = True
            if self.dist.is_coordinator:  # a stricter keep frees space before this save writes anything
                apply_retention(self.ctx, at_open=True)
        if not overwrite and (self._in_flight(step) or is_committed(self.storage, step)):
            d = self.root / step_dir_name(step)
            info = None if self._in_flight(step) else inspect_step(self.storage, step, d, self.store)[0]
            if info is not None and info.usable:
                lineage.check_step_owner(self.ctx, step)
            if info is None or info.usable:
                raise CheckpointExistsError(
                    f"step {step} already has a committed checkpoint under {self.root}; pass overwrite=True to "
                    "replace it"
                )
            # A corrupt checkpoint of this step (typically the one restore_latest just skipped) holds nothing
            # usable: replace it rather than stop the training loop.
            log.warning("replacing the %s checkpoint of step %d (%s)", info.status, step, info.problem)
            self._event("replace_corrupt", step=step, problem=info.problem)
        t0 = time.perf_counter()
        now0 = time.monotonic()
        if not self.async_save:
            self._run_probe(step)
            flat, paths, top = _statefn.collect(state)
            flat, paths = per_rank.split(flat, paths, top, self.dist)
            handle = PendingSave(step)
            try:
                result = _persist.persist(
                    self.ctx, step, flat, paths, top, metrics, metadata, t0, blocking=True
                )
            except SaveError as e:
                handle.fail(e, seen=True)
                raise
            handle.staging_s = result.block_s
            handle.resolve(result)
            self.save_policy.record_save(step, now_s=now0, block_s=result.block_s, persist_s=None)
            self.save_policy.record_save(
                step, now_s=time.monotonic(), block_s=result.block_s, persist_s=result.persist_s
            )
            return handle
        assert self._stager is not None and self._persister is not None
        bufset = self._persister.acquire(block=block)
        try:
            self._raise_background_error()  # a save abandoned while this one waited for its buffers
        except BaseException:
            if bufset is not None:
                self._stager.release(bufset)
            raise
        if bufset is None:
            self._event(
                "save_skipped", step=step, reason="every staging buffer set is busy persisting earlier saves"
            )
            log.warning("skipping the save of step %d: earlier saves are still persisting", step)
            return PendingSave(step, time.perf_counter() - t0, skipped=True)
        try:
            self._run_probe(step)
            flat, paths, top = _statefn.collect(state)
            flat, paths = per_rank.split(flat, paths, top, self.dist)
            staged = bufset.stage(flat)
        except BaseException as e:
            self._stager.release(bufset)  # type: ignore[union-attr]
            if isinstance(e, (TrainguardError, KeyboardInterrupt, SystemExit)):
                raise
            # as a synchronous save reports a failure: SaveError naming the cause
            raise SaveError(
                f"saving step {step} failed while staging: {type(e).__name__}: {e}; nothing was committed and "
                "earlier checkpoints are intact",
                step=step,
                rank_errors={self.dist.rank: e},
            ) from e
        staging_s = time.perf_counter() - t0
        handle = PendingSave(step, staging_s)
        self.save_policy.record_save(step, now_s=now0, block_s=staging_s, persist_s=None)
        self._persister.submit(SaveRequest(step, staged, paths, top, metrics, metadata, t0), handle, bufset)
        return handle

    def _persist_request(self, req: SaveRequest, staging_s: float, cancel: threading.Event) -> SaveResult:
        """The save path of a background save (run by the AsyncPersister's worker thread)."""
        return _persist.persist(
            self.ctx,
            req.step,
            dict(req.staged),
            req.paths,
            req.top,
            req.metrics,
            req.metadata,
            req.t0,
            blocking=False,
            staging_s=staging_s,
            cancel=cancel,
        )

    def _run_probe(self, step: int) -> None:
        """Compute the probe in the caller's thread; its record goes with this step's save."""
        if self.probe is None:
            return
        from .validation.probe import compute

        t = time.perf_counter()
        outputs = compute(self.probe)
        self._probes[step] = (outputs, time.perf_counter() - t)

    def _in_flight(self, step: int) -> bool:
        return self._persister is not None and self._persister.in_flight(step)

    def _pending_steps(self) -> list[int]:
        return self._persister.pending_steps() if self._persister is not None else []

    def _raise_background_error(self) -> None:
        """Raise (once) the error of a background save nobody has seen yet."""
        if self._persister is not None:
            self._persister.raise_background_error()

    @property
    def metrics_registry(self) -> Any:
        """The prometheus-client registry holding this manager's save metrics (None when read-only).

        Serve it with ``prometheus_client.start_http_server(port, addr="127.0.0.1", registry=...)``; under
        ``trainguard run --metrics-port`` the supervisor serves the same metrics from the event log.
        """
        return self._metrics.registry if self._metrics is not None else None

    @property
    def staging_bytes(self) -> int:
        """Host memory held by staging buffers, in bytes (bounded by ``staging_buffers`` x the state size)."""
        return self._stager.nbytes if self._stager is not None else 0

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed or failed.

        Raises:
            SaveError: a background save failed (raised once).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._persister is not None:
            self._persister.wait(timeout)

    # -- state shared with the collaborators (RootContext) ------------------------------------------------
    @property
    def run(self) -> RunInfo:
        """This manager's run identity (its lineage once a restore resumed one)."""
        return self.ctx.run

    @property
    def saves(self) -> deque[SaveResult]:
        """The most recent committed saves of this manager (at most 1000), in commit order."""
        return self.ctx.saves

    @property
    def last_restore(self) -> RestoreTimings:
        """Timings and bytes of the last restore."""
        return self.ctx.last_restore

    @last_restore.setter
    def last_restore(self, value: RestoreTimings) -> None:
        self.ctx.last_restore = value

    # -- listing ------------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint under the root with status (valid / unverified / corrupt / incomplete), bytes and
        time, ascending by step (``trainguard ls`` also lists the steps whose save failed). Waits for this manager's pending saves first, so a save just made is listed.
        Cheap: reads manifests and stats chunks; ``verify`` re-reads data. Safe against a writer in another
        process committing and deleting checkpoints meanwhile (a stable scan, see :func:`catalog.scan`)."""
        self.wait()
        if self._tiers is not None:
            from .tiers.attach import listing

            return listing(self._tiers, lambda: scan(self.storage, self.store), url=self.url)
        return scan(self.storage, self.store)

    def prefetch(self) -> int | None:
        """Copy the newest checkpoint restorable from any tier to the hot root (chunks intact there are kept,
        the others read from the first tier holding them with a matching CRC32C), ahead of a restart.

        Returns:
            The step now intact on the hot root, or None when no tier holds a restorable checkpoint (without
            tiers: the newest usable step of the root).
        """
        if self._tiers is None:
            return self.latest_step()
        return self._tiers.materialize()

    def latest_step(self) -> int | None:
        """The newest step whose checkpoint lists as valid or unverified in a stable scan (the one
        ``restore_latest`` tries first), or None. A checkpoint that a full read (``verify``, a restore) found
        corrupt is not returned."""
        valid = [i.step for i in self.checkpoints() if i.usable]
        return max(valid) if valid else None

    # -- restoring ----------------------------------------------------------------------------------------
    def restore(self, step: int, state: MutableMapping[str, Any], *, strict: bool = True) -> int:
        """Load the checkpoint of ``step`` into ``state`` in place and return ``step``.

        The top-level keys of ``state`` choose which saved entries to load. Within each, the state must match
        the checkpoint: the same keys (wrapper prefixes such as ``_orig_mod.`` and ``module.`` aside) and, for
        tensors loaded in place, the same dtypes and shapes. An empty dict or list takes everything saved as
        saved; optimizer state always comes back as saved, dtype included, for every parameter that had it.

        Args:
            step: the step to load.
            state: name -> object, as given to ``save``; loaded in place.
            strict: with False, load what matches, convert dtypes to the target's and log the differences
                instead of raising (shapes must still match).

        Raises:
            CheckpointNotFoundError: no committed checkpoint of that step.
            CorruptCheckpointError: the checkpoint failed an integrity check (nothing handed to load_state_dict;
                tensors loaded in place before the failure may hold partial data).
            StateMismatchError: the state does not match the checkpoint (shapes; with ``strict``, keys, dtypes
                or missing optimizer state); the message lists the checkpoint's and the target's side.
        """
        if self._closed:
            raise ManagerClosedError("this CheckpointManager is closed; create a new one")
        self.wait()
        t0 = time.perf_counter()
        if self._tiers is not None:  # chunks missing or corrupt on the hot root: read from a tier into memory
            with self._tiers.restoring(self.ctx, step):
                _restore.load(self.ctx, step, state, strict=strict)
        else:
            _restore.load(self.ctx, step, state, strict=strict)
        load_s = time.perf_counter() - t0
        from .validation.hooks import check_probe

        validate_s = self._validate_s + check_probe(self, step)
        self.last_restore = RestoreTimings(
            load_s=load_s, validate_s=validate_s, bytes=self.last_restore.bytes
        )
        self._arm_trajectory(step)
        return step

    def restore_latest(self, state: MutableMapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest VALID checkpoint into ``state`` in place and return its step.

        A corrupt or incomplete newer checkpoint is skipped with a logged warning (and an event naming the
        corrupt chunk); the next older one is tried. ``state`` and ``strict`` as in :meth:`restore`. Only the
        lineage of the run that committed last is considered (another run kept apart with ``new_run=True`` is
        passed over). A checkpoint that a writer in another process deletes meanwhile is not an error: the root
        is listed again. A writing manager records the restored checkpoint's run as its parent (its lineage).

        Args:
            state: name -> object, as given to ``save``; loaded in place.
            strict: as in :meth:`restore`.

        Returns:
            The restored step, or None when the root holds no committed checkpoint at all.

        Raises:
            NoValidCheckpointError: checkpoints exist but none is valid (never silently starts from scratch).
            StateMismatchError: the state does not match the checkpoint (not a reason to fall back).
            ManagerClosedError: the manager is closed.
        """
        if self._closed:
            raise ManagerClosedError("this CheckpointManager is closed; create a new one")
        self.wait()
        timings = RestoreTimings()
        try:
            if self._tiers is not None:  # the newest step on any tier; what the hot root lacks: into memory
                with self._tiers.restoring(self.ctx):
                    step = _restore.restore_latest(self.ctx, state, timings, strict=strict)
            else:
                step = _restore.restore_latest(self.ctx, state, timings, strict=strict)
        except NoValidCheckpointError as e:  # `trainguard run` reads it: a relaunch cannot fix this
            self.ctx.event("restore_failed", error="NoValidCheckpointError", problem=str(e).split("\n")[0])
            raise
        if step is not None:
            self.last_restore = timings
            self._arm_trajectory(step)
        return step


def _cache_root(url: str) -> Path:
    """The local hot root of a URL run root: ``$TRAINGUARD_CACHE_DIR`` (default ``~/.cache/trainguard``) /
    ``roots/<hash of the URL>``."""
    import hashlib

    base = os.environ.get("TRAINGUARD_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "trainguard"
    )
    return Path(base) / "roots" / hashlib.sha256(url.encode()).hexdigest()[:16]
