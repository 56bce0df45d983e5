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
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _persist, _restore, _statefn, _worker, lineage
from ._lock import RootLock
from .catalog import CheckpointInfo, inspect_step, scan
from .commit import publish
from .distributed.context import DistContext
from .distributed.options import WriterOptions
from .errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    RootLockedError,
    SaveError,
    TrainguardError,
    UnsafeFileError,
)
from .format import Manifest, step_dir_name
from .format.layout import MANIFEST_NAME
from .format.run import RunInfo, new_run_id
from .incremental.chunkstore import ChunkStore
from .policies import SavePolicy
from .recovery.events import OWN_EVENTS, EventLog
from .results import RestoreTimings, SaveResult
from .retention import RetentionPolicy, as_retention
from .retention.apply import apply_retention, cleanup_after_crash
from .staging import PendingSave, Stager
from .state import per_rank
from .storage.base import Storage
from .storage.local import LocalStorage

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
            (None: off); damage found is recorded (``corrupt``) and logged before a restore needs it.

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
        tiers: list[Any] | None = None,
        storage_options: dict[str, Any] | None = None,
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
        if isinstance(root, (str, os.PathLike)):
            try:
                self.storage: Storage = LocalStorage(root, fsync=fsync, durability=durability)
            except ValueError as e:  # the storage checks its own options
                raise ConfigError(str(e)) from None
        elif isinstance(root, Storage) and root.local_path is not None:
            self.storage = root
        else:
            raise ConfigError(
                f"root must be a directory path or a trainguard.storage.Storage with a local directory, got "
                f"{root!r}"
            )
        self.root: Path = self.storage.local_path  # type: ignore[assignment]  # checked just above
        self.read_only = read_only
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(1000)
        if not isinstance(self.save_policy, SavePolicy):
            raise ConfigError(
                f"save_policy must have should_save()/record_save() (e.g. tg.EveryNSteps(100)), got "
                f"{type(save_policy).__name__}"
            )
        self.retention = as_retention(keep)
        validation_options(
            check_finite=check_finite,
            probe=probe,
            probe_rtol=probe_rtol,
            probe_atol=probe_atol,
            trajectory_steps=trajectory_steps,
            scrub_interval_s=scrub_interval_s,
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
        self.options = WriterOptions(
            chunk_size_bytes=chunk_size_bytes, pack_threshold_bytes=min(1 << 20, chunk_size_bytes)
        )
        self.store = ChunkStore(self.storage)
        self.fsync = fsync
        if when_busy not in ("wait", "skip"):
            raise ConfigError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        if dist_timeout_s is not None and (
            isinstance(dist_timeout_s, bool)
            or not isinstance(dist_timeout_s, (int, float))
            or not 0 < dist_timeout_s < float("inf")
        ):
            raise ConfigError(f"dist_timeout_s must be a number of seconds > 0, got {dist_timeout_s!r}")
        if collective is None:
            collective = not read_only
        if not collective and not read_only:
            raise ConfigError(
                "a writing manager must be collective under torch.distributed (every rank writes its shards); "
                "collective=False is for read_only=True"
            )
        self.dist = DistContext(collective=collective, timeout_s=dist_timeout_s)
        self.new_run = bool(new_run)
        # Run identity: rank 0 draws the id, every rank records the same one.
        self.run = RunInfo(self.dist.broadcast_bytes(new_run_id().encode()).decode())
        self._resumed = False
        self._run_checked = read_only
        if self.dist.enabled and when_busy == "skip":
            raise ConfigError(
                "when_busy='skip' is not supported under torch.distributed (ranks could skip "
                "different saves); use 'wait'"
            )
        if staging_buffers < 1:
            raise ConfigError(f"staging_buffers must be >= 1, got {staging_buffers}")
        if save_timeout_s is not None and not (
            isinstance(save_timeout_s, (int, float))
            and not isinstance(save_timeout_s, bool)
            and save_timeout_s > 0
        ):
            raise ConfigError(
                f"save_timeout_s must be a number of seconds > 0 or None, got {save_timeout_s!r}"
            )
        if save_timeout_s is not None and self.dist.enabled:
            raise ConfigError(
                "save_timeout_s is not supported under torch.distributed yet (an abandoned save would leave the "
                "ranks' collectives out of step); rely on the supervisor's heartbeat timeout"
            )
        self.save_timeout_s = None if save_timeout_s is None else float(save_timeout_s)
        self.async_save = bool(async_save)
        self.when_busy = when_busy
        self._stager: Stager | None = Stager(staging_buffers) if async_save and not read_only else None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._pending: list[PendingSave] = []
        self._in_flight: set[int] = set()
        self._in_flight_t: dict[int, float] = {}  # step -> wall time its save began
        self._job_lock = threading.Lock()
        self._current: _worker.Job | None = None  # the job the worker is persisting
        self._abandoned: list[_worker.Job] = []  # abandoned jobs (their threads may still be stuck)
        self.last_restore = RestoreTimings()
        # the most recent SAVES_KEPT committed saves of this manager, in commit order
        self.saves: deque[SaveResult] = deque(maxlen=SAVES_KEPT)
        self._exit_flush: Any = None
        self._closed = False
        self._lock: RootLock | None = None
        self._events: EventLog | None = None
        self._first_step_logged = False
        self._progress_t: float | None = None  # monotonic time of the last progress event (or first_step)
        self._manifest_chunks: dict[int, set[str]] = {}
        self._manifest_runs: dict[int, str] = {}  # step -> id of the run that wrote it (retention's cache)
        self._manifest_metrics: dict[int, dict[str, Any]] = {}
        self._metrics: Any = None
        if read_only:
            if self.url is not None or tiers:  # the hot root a restore from the tiers copies into
                self.root.mkdir(parents=True, exist_ok=True)
            if not self.root.is_dir():
                raise ConfigError(_root_problem(self.root) or f"run root {self.root} is not a directory")
            if tiers:
                self._open_tiers(tiers, writer=False)
            return
        self._layout_ok = False  # checked at the first save (ChunkStore.layout_problem)
        self._events = _open_root(self.root)
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
                self._lock = RootLock(self.root)
                self._lock.acquire()
                self._cleanup_after_crash()
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
        self._exit_flush = _worker.register_exit_flush(self)  # an async save is never lost silently at exit
        self._events.write("manager_start", root=str(self.root), new_run=self.new_run)
        from .validation.trajectory import Recorder

        self._trajectory = Recorder(
            self.root, self.run.run_id, self.trajectory_steps, coordinator=self.dist.is_coordinator
        )
        if self.scrub_interval_s is not None and self.dist.is_coordinator:
            from .validation.scrub import Scrubber

            self._scrubber = Scrubber(self, self.scrub_interval_s)
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
        abandoned = sorted(_abandoned(self))
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
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
        if self._tiers is not None:
            try:
                self._tiers.close()  # waits up to upload_timeout_s; TierUploadError names what is missing
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

        links = open_links(self.root, tiers, self._event, fsync=self.fsync)
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
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        if self.read_only:
            raise TrainguardError("this CheckpointManager was opened with read_only=True; it cannot save")

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
                :data:`trainguard.recovery.events.OWN_EVENTS`).
            **fields: JSON-serializable fields.

        Raises:
            ConfigError: an empty name or one of trainguard's own event names.
            TrainguardError: the manager is read-only or closed (it has no event log then).
        """
        if not isinstance(event, str) or not event.strip():
            raise ConfigError(f"event must be a non-empty string, got {event!r}")
        if event in OWN_EVENTS:
            raise ConfigError(
                f"{event!r} is an event trainguard writes itself; give your event another name "
                "(e.g. 'fault_injected' or 'user_note')"
            )
        if self._events is None or self._closed:
            raise TrainguardError(
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

            if step not in self._in_flight and not (self.root / step_dir_name(step) / MANIFEST_NAME).exists():
                self.save(step, state, metrics=metrics)
            self.close()
            exit_after_preemption_save()
        self._raise_background_error()
        if force:
            if step in self._in_flight or (self.root / step_dir_name(step) / MANIFEST_NAME).exists():
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
            lineage.check_before_first_save(self, step)
            self._run_checked = True
            if self.dist.is_coordinator:  # a stricter keep frees space before this save writes anything
                apply_retention(self, at_open=True)
        if not overwrite and (
            step in self._in_flight or (self.root / step_dir_name(step) / MANIFEST_NAME).exists()
        ):
            d = self.root / step_dir_name(step)
            info = None if step in self._in_flight else inspect_step(self.storage, step, d, self.store)[0]
            if info is not None and info.usable:
                lineage.check_step_owner(self, step)
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
                result = _persist.persist(self, step, flat, paths, top, metrics, metadata, t0, blocking=True)
            except SaveError as e:
                handle._set_error(e)
                handle._error_seen = True
                raise
            handle.staging_s = result.block_s
            handle._set_result(result)
            self.save_policy.record_save(step, now_s=now0, block_s=result.block_s, persist_s=None)
            self.save_policy.record_save(
                step, now_s=time.monotonic(), block_s=result.block_s, persist_s=result.persist_s
            )
            return handle
        assert self._stager is not None
        bufset = _worker.acquire(self, block=block)
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
        self._in_flight.add(step)
        self._in_flight_t[step] = time.time()
        self._pending.append(handle)
        self.save_policy.record_save(step, now_s=now0, block_s=staging_s, persist_s=None)
        self._ensure_worker()
        self._queue.put(_worker.Job(handle, bufset, (staged, paths, top, metrics, metadata, t0)))
        return handle

    def _run_probe(self, step: int) -> None:
        """Compute the probe in the caller's thread; its record goes with this step's save."""
        if self.probe is None:
            return
        from .validation.probe import compute

        t = time.perf_counter()
        outputs = compute(self.probe)
        self._probes[step] = (outputs, time.perf_counter() - t)

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(
                target=_worker.work, args=(self, self._queue), name="trainguard-persist", daemon=True
            )
            self._worker.start()

    def _load(self, step: int, state: MutableMapping[str, Any], *, strict: bool = True) -> None:
        _restore.load(self, step, state, strict=strict)

    def _restored(self, m: Manifest) -> None:
        lineage.record_resume(self, m)

    def _mark_corrupt(self, step: int, err: CorruptCheckpointError) -> None:
        _restore.mark_corrupt(self, step, err)

    def _publish(self, m: Manifest, extra: Callable[[bytes], dict[str, bytes]] | None = None) -> None:
        publish(self.storage, m, fsync=self.fsync, extra=extra)

    def _raise_background_error(self) -> None:
        """Raise (once) the error of a background save nobody has seen yet; forget finished handles."""
        err = None
        keep = []
        for h in self._pending:
            if not h.done():
                keep.append(h)
            elif h.error is not None and not h._error_seen and err is None:
                h._error_seen = True
                err = h.error
            elif h.error is not None and not h._error_seen:
                keep.append(h)
        self._pending = keep
        if err is not None:
            raise err

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
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in list(self._pending):
            if not _worker.wait_handle(self, h, deadline):
                raise TimeoutError(f"save of step {h.step} still persisting after {timeout} s")
        self._raise_background_error()

    # -- retention (rank 0) -------------------------------------------------------------------------------
    def _apply_retention(self) -> None:
        apply_retention(self)

    def _cleanup_after_crash(self) -> None:
        cleanup_after_crash(self)

    def _oldest_in_flight_t(self) -> float:
        """Wall time the oldest save still in flight began (now when none)."""
        return min([t for t in self._in_flight_t.values()] or [time.time()])

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
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        self.wait()
        t0 = time.perf_counter()
        if self._tiers is not None:  # chunks missing or corrupt on the hot root: read from a tier into memory
            with self._tiers.restoring(self, step):
                self._load(step, state, strict=strict)
        else:
            self._load(step, state, strict=strict)
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

        Returns:
            The restored step, or None when the root holds no committed checkpoint at all.

        Raises:
            NoValidCheckpointError: checkpoints exist but none is valid (never silently starts from scratch).
            StateMismatchError: the state does not match the checkpoint (not a reason to fall back).
        """
        if self._closed:
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        self.wait()
        timings = RestoreTimings()
        if (
            self._tiers is not None
        ):  # the newest step restorable from any tier, what the hot root lacks in memory
            with self._tiers.restoring(self):
                step = _restore.restore_latest(self, state, timings, strict=strict)
        else:
            step = _restore.restore_latest(self, state, timings, strict=strict)
        if step is not None:
            self.last_restore = timings
            self._arm_trajectory(step)
        return step


def validation_options(
    *,
    check_finite: str,
    probe: Any,
    probe_rtol: float,
    probe_atol: float,
    trajectory_steps: int,
    scrub_interval_s: float | None,
) -> None:
    """Check the validation options (issue 11).

    Raises:
        ConfigError: naming the option and what it accepts.
    """
    from .validation import CHECK_FINITE_MODES

    if check_finite not in CHECK_FINITE_MODES:
        raise ConfigError(f"check_finite must be one of {CHECK_FINITE_MODES}, got {check_finite!r}")
    if probe is not None and not callable(probe):
        raise ConfigError(f"probe must be a callable returning a tensor or a dict of tensors, got {probe!r}")
    for name, v in (("probe_rtol", probe_rtol), ("probe_atol", probe_atol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    if isinstance(trajectory_steps, bool) or not isinstance(trajectory_steps, int) or trajectory_steps < 0:
        raise ConfigError(f"trajectory_steps must be an int >= 0 (0: off), got {trajectory_steps!r}")
    if scrub_interval_s is not None and (
        isinstance(scrub_interval_s, bool)
        or not isinstance(scrub_interval_s, (int, float))
        or not 0 < scrub_interval_s < float("inf")
    ):
        raise ConfigError(
            f"scrub_interval_s must be a number of seconds > 0 or None, got {scrub_interval_s!r}"
        )


def _root_problem(root: Path) -> str | None:
    """Why ``root`` cannot be a run root (it exists but is not a directory), or None.

    One ``stat`` decides, so a root another rank creates meanwhile is never taken for a file."""
    import stat as _stat

    try:
        st = os.stat(root)  # follows a symlink to its target
    except FileNotFoundError:
        if os.path.islink(root):
            return (
                f"run root {root} is a symlink to {os.readlink(root)!r}, which does not exist: fix the link "
                "or choose another root"
            )
        return None
    except OSError:
        return None  # the mkdir or the event log that follows reports it
    if _stat.S_ISDIR(st.st_mode):
        return None
    if os.path.islink(root):
        return (
            f"run root {root} is a symlink to {os.readlink(root)!r}, which is not a directory: fix the link or "
            "choose another root"
        )
    return f"run root {root} is a file, not a directory: choose another root"


def _open_root(root: Path) -> EventLog:
    """Create the run root of a writer (if missing) and its event log, with clear errors for odd roots."""
    problem = _root_problem(root)
    if problem is not None:
        raise ConfigError(problem)
    try:
        root.mkdir(parents=True, exist_ok=True)
        return EventLog(root, "manager")
    except UnsafeFileError:
        raise
    except OSError as e:
        import errno

        if e.errno == errno.EROFS:
            why = "is on a read-only filesystem"
        elif e.errno in (errno.EACCES, errno.EPERM):
            why = "is not writable by this user"
        else:
            why = f"cannot be written ({e.strerror or e})"
        raise ConfigError(
            f"run root {root} {why}: choose a writable root, or open it with "
            "CheckpointManager(root, read_only=True) to list and restore only"
        ) from None


def _abandoned(mgr: CheckpointManager) -> set[int]:
    return {j.handle.step for j in mgr._abandoned}


def _cache_root(url: str) -> Path:
    """The local hot root of a URL run root: ``$TRAINGUARD_CACHE_DIR`` (default ``~/.cache/trainguard``) /
    ``roots/<hash of the URL>``."""
    import hashlib

    base = os.environ.get("TRAINGUARD_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "trainguard"
    )
    return Path(base) / "roots" / hashlib.sha256(url.encode()).hexdigest()[:16]
