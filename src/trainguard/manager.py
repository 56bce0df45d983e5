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
import time
from collections import deque
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from . import _restore
from ._config import (
    check_distributed_options,
    check_options,
    check_supervisor_root,
    open_storage,
    open_writer,
    root_problem,
    save_options,
    validation_options,
)
from ._context import RootContext
from ._lock import RootLock
from ._save import SavePath
from .catalog import CheckpointInfo, scan
from .distributed.context import DistContext
from .errors import ConfigError, ManagerClosedError, ReadOnlyManagerError, SaveError
from .eventlog import EventLog, check_user_event
from .format.layout import as_step
from .format.run import RunInfo, new_run_id
from .incremental.chunkstore import ChunkStore
from .policies import SavePolicy
from .results import RestoreTimings, SaveResult
from .retention import RetentionPolicy, as_retention
from .retention.apply import apply_retention, cleanup_after_crash
from .staging import PendingSave
from .staging.persister import register_exit_flush
from .storage.base import Storage
from .storage.objects import is_url
from .validation.attach import Validation

log = logging.getLogger("trainguard")
SAVES_KEPT = 1000  # results kept in CheckpointManager.saves (the most recent ones)

PROGRESS_INTERVAL_S = 10.0
"""``maybe_save`` logs a ``progress`` event (rank 0 only) at most this often: the step over wall time that
``trainguard report`` plots between checkpoints (about 45 MB of event log per 30 days of training)."""


class CheckpointManager:
    """Saves and restores the whole training state under one run root.

    Args:
        root: the run root directory (created if missing), its :class:`~trainguard.storage.Storage`
            (e.g. a :class:`~trainguard.storage.FaultyStorage` in fault tests; ``fsync``, ``durability``
            and ``direct_io`` are then the storage's own), or an object-store URL (``"s3://bucket/run1"``,
            any fsspec URL; ``pip install 'trainguard[s3]'``): the manager then saves to a local cache
            (``$TRAINGUARD_CACHE_DIR``, default ``~/.cache/trainguard``) as its hot root, keeping the newest
            checkpoint there, with the URL as a dual-write replica that keeps ``keep``; a second writer of the
            URL is refused (RootLockedError), and credentials that cannot write are a ConfigError here.
        save_policy: decides the steps ``maybe_save`` saves at (default: every 1000 steps).
        keep: retention: an int N keeps the newest N valid checkpoints, a RetentionPolicy, or None to keep all.
            Applied only after a new checkpoint commits; the newest valid checkpoint is never deleted.
        read_only: open without the write lock (list, verify and restore only); local by default (no
            collective, see ``collective``).
        fsync: make every save durable (default True).
        durability: how chunk files are made durable. ``"auto"`` (default): after all chunks are written, one
            ``syncfs(2)`` of the run root's filesystem per rank per save when the node holds no more dirty
            page-cache data than the size of the save's own chunks (under torch.distributed: those of every
            rank of the job on this node; chunks written with ``direct_io`` count too), else an fsync of each
            chunk file; then the renames into ``chunks/``. ``"batched"``: always ``syncfs`` (per-file fsyncs
            where it is missing). ``"per_file"``: fsync every chunk file and directory as it is written.
            ``syncfs`` also flushes other processes' dirty data on that filesystem, and the save waits for it:
            ``"auto"`` avoids it beside other writers (benchmarks/RESULTS.md, bench_syncfs).
        direct_io: write chunk files of at least 1 MiB around the page cache (``O_DIRECT``, default True),
            through pooled, page-aligned 8 MiB buffers (one per write in progress): a save allocates no
            page-cache memory for its bytes, evicts none of the job's cached data (its dataset, say) and
            leaves no dirty pages for the kernel to write back. The ``durability`` above still applies.
            Filesystems without direct I/O get buffered writes. Chunk files are then not in the page cache:
            tier uploads and a restore on the same node read them from the disk. False: through the page
            cache, as ``torch.save`` and DCP write (a restore on the same node right after a save then reads
            memory instead of the disk).
        chunk_size_bytes: largest chunk, in bytes (default 64 MiB).
        save_on_preemption: on SIGTERM, save at the next ``maybe_save`` and exit cleanly.
        async_save: persist in a background thread; the caller blocks only for the copy into staging buffers
            (default True).
        staging_buffers: staging buffer sets (2: double-buffered; host memory up to 2x the state's tensors).
        when_busy: what ``maybe_save`` does when every buffer set is still persisting earlier saves:
            ``"wait"`` (block until one is free, default) or ``"skip"`` (skip this save, logging a
            ``save_skipped`` event). ``save`` always waits.
        save_timeout_s: a background save that makes no progress (no chunk written, deduplicated or, while it
            waits for the previous retention's deletions, deleted; no flush finished) for this many seconds
            is abandoned: it fails with a SaveError naming its step (raised by
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
        verify_before_load: in one process, read every chunk a restore needs and check its CRC32C before the
            first byte reaches the state's objects (default True), so a corrupt checkpoint leaves them untouched.
            It reads the checkpoint twice (the second time usually from the page cache: 1.35x the restore time
            for 256 MiB warm, ``benchmarks/bench_restore_verify.py``). False: one read, each chunk checked as it
            is loaded in place (the fastest restart); a corrupt chunk found then may leave part of its bytes in
            the objects (``CorruptCheckpointError.state_modified``; a fallback to an older checkpoint overwrites
            them). Under torch.distributed chunks are always checked as they load. With True, a chunk whose
            every destination is memory allocated and never written (a relaunched job's ``torch.empty`` tensors,
            a model materialized with ``to_empty``; Linux, no swap) is not read before: it is loaded first,
            checked as it lands, and on a failure that memory is put back as it was (zero pages).
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
        tiers: storage below the hot root, in order (:class:`~trainguard.Tier`: a shared filesystem path or an
            object-store URL, each with its own ``keep``): a save commits to the hot root first, then async
            tiers receive it in the background (``sync=True`` tiers: before ``wait()`` returns); a restore
            reads a chunk missing or corrupt on the hot root from the first tier holding it with a matching
            CRC32C, and ``close()`` waits up to each tier's ``upload_timeout_s`` (seconds) for the uploads
            (TierUploadError). None or ``[]`` (default): the hot root only. See ``docs/tiers.md``.
        storage_options: options for the fsspec filesystem of a URL ``root`` (s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``; they override the environment's ``AWS_*`` variables).
            Only with a URL root (ConfigError otherwise); a tier takes its own in ``tg.Tier(...)``.

    Raises:
        RootLockedError: another process holds the write lock of ``root`` (for a URL root: the store's lock
            object).
        ConfigError: an invalid argument, or a root that is not usable: a file, a dangling symlink, on a
            read-only filesystem or without write permission (for writers); ``storage_options`` with a local
            root; a URL root or tier whose credentials are missing or cannot write (for writers).
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
        durability: str = "auto",
        direct_io: bool = True,
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
        verify_before_load: bool = True,
        tiers: list[Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        compression: str = "auto",
        delta: bool = False,
        max_chain: int = 10,
    ) -> None:
        from .policies import EveryNSteps

        tier_list, self.url = list(tiers or []), None
        if is_url(root) or storage_options is not None:  # tiers' code stays out of a local root's restart
            from .tiers.attach import url_root

            # an object-store run root: a local cache as the hot root, the URL as a sync replica
            root, keep, tier_list, self.url = url_root(root, keep, tier_list, storage_options)
        self._tiers: Any = None
        self.storage = open_storage(root, fsync=fsync, durability=durability, direct_io=direct_io)
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
        checked_validation = validation_options(
            check_finite=check_finite,
            probe=probe,
            probe_rtol=probe_rtol,
            probe_atol=probe_atol,
            trajectory_steps=trajectory_steps,
            scrub_interval_s=scrub_interval_s,
            scrub_max_bandwidth=scrub_max_bandwidth,
        )
        self.options, self.compression, self.incremental = save_options(
            chunk_size_bytes=chunk_size_bytes, compression=compression, delta=delta, max_chain=max_chain
        )
        self.store = ChunkStore(self.storage)
        self.fsync = fsync
        self.dist = DistContext(collective=collective, timeout_s=dist_timeout_s)
        if self.dist.enabled and not read_only and hasattr(self.storage, "node_writers"):
            # durability="auto" (LocalStorage): the ranks on this node flush their shares of a save together
            self.storage.node_writers = self.dist.ranks_on_this_node()  # type: ignore[attr-defined]
        self.new_run = bool(new_run)
        # Run identity: rank 0 draws the id, every rank records the same one.
        run = RunInfo(self.dist.broadcast_bytes(new_run_id().encode()).decode())
        saves: deque[SaveResult] = deque(maxlen=SAVES_KEPT)  # the most recent committed saves, in order
        self.validation = Validation(
            root=self.root,
            dist=self.dist,
            event=self._event,
            saves=saves,
            fsync=fsync,
            **checked_validation,
        )
        self.validation.wait = self._saves_wait
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
            saves=saves,
            compression=self.compression,
            incremental=self.incremental,
            validation=self.validation,
            verify_before_load=bool(verify_before_load),
        )
        check_distributed_options(
            dist_enabled=self.dist.enabled, when_busy=when_busy, save_timeout_s=save_timeout_s
        )
        self.save_timeout_s = None if save_timeout_s is None else float(save_timeout_s)
        self.async_save = bool(async_save)
        self.when_busy = when_busy
        self._saves = SavePath(
            self.ctx,
            self.validation,
            self.save_policy,
            async_save=self.async_save,
            staging_buffers=staging_buffers,
            save_timeout_s=self.save_timeout_s,
            read_only=read_only,
            progress_interval_s=PROGRESS_INTERVAL_S,
        )
        self._stager = self._saves.stager
        self._exit_flush: Any = None
        self._closed = False
        self._lock: RootLock | None = None
        self._events: EventLog | None = None
        self._metrics: Any = None
        self._scrubber: Any = None
        self._preemption = False
        if read_only:
            if self.url is not None or tier_list:  # the hot root a restore from the tiers copies into
                self.root.mkdir(parents=True, exist_ok=True)
            if not self.root.is_dir():
                raise ConfigError(root_problem(self.root) or f"run root {self.root} is not a directory")
            if tier_list:
                self._open_tiers(tier_list, writer=False)
            return
        self._events, self._metrics, self._lock = open_writer(
            self.root,
            self.dist,
            metrics_registry,
            cleanup=lambda: cleanup_after_crash(self.ctx),
            name=self.url,
        )
        bind = getattr(self.save_policy, "bind", None)
        if callable(bind):
            bind(str(self.root), self._events)
        if save_on_preemption:
            from .recovery.heartbeat import install_preemption_handler

            install_preemption_handler()
            self._preemption = True
        self._events.set_context(checkpoint_run_id=self.run.run_id)
        if tier_list:
            try:
                self._open_tiers(tier_list, writer=True)
            except BaseException:
                if self._lock is not None:
                    self._lock.release()
                self._events.close()
                raise
        self._exit_flush = register_exit_flush(self, str(self.root))  # an async save is never lost at exit
        self._events.write("manager_start", root=str(self.root), new_run=self.new_run)
        if self.dist.rank == 0:
            check_supervisor_root(self.root, self._events, self.url)
        self.validation.start_writer(self.run.run_id, tiers=self._tiers)
        self._scrubber = self.validation.scrubber

    def _open_tiers(self, tiers: list[Any], *, writer: bool) -> None:
        from .tiers.attach import open_tiers

        self._tiers = open_tiers(
            self.root,
            tiers,
            self._event,
            fsync=self.fsync,
            writer=writer,
            coordinator=self.dist.is_coordinator,
            url=self.url,
        )
        self.ctx.tiers = self._tiers

    # -- context manager ----------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending saves, stop the background worker, the scrubber and the tier uploads, and release
        the write lock. Idempotent; collective under torch.distributed (see the class notes).

        With tiers, waits for uploads up to the largest ``upload_timeout_s`` (seconds) of the tiers.

        Raises:
            SaveError: a background save failed and nobody has seen its error yet (the lock is released first;
                when several did, the first is raised, naming the steps of the others, which are logged).
            TierUploadError: a tier did not receive every checkpoint in time (the hot checkpoints are intact;
                a new manager with the same tiers uploads what is missing).
        """
        if self._closed:
            return
        err: BaseException | None = None
        try:
            self._saves_wait()
        except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
            err = e
            self._report_other_failures(e)
        self._closed = True
        self.ctx.refs.take_newest()  # a manifest kept at open for a restore_latest that never came
        self.validation.close()
        if self._exit_flush is not None:
            import atexit

            atexit.unregister(self._exit_flush)  # where threading's exit hook is used, flush sees _closed
        abandoned = self._saves.stop()
        if abandoned:
            log.error(
                "close(): the saves of steps %s were abandoned (no progress); nothing was committed",
                abandoned,
            )
        settled = True  # False once a pass without progress was cancelled (waited for once, not twice)
        if self._tiers is not None:
            try:
                self._tiers.close()  # waits up to upload_timeout_s; TierUploadError names what is missing
                if err is None and self._lock is not None and (settled := self._settle_collection()):
                    apply_retention(self.ctx)  # steps kept only while they uploaded: sent now, policy applies
            except BaseException as e:  # noqa: BLE001 - re-raised after cleanup
                err = err or e
        if settled:  # no deletion of ours may run once another writer can take the root
            self._settle_collection()
        if self._events is not None:
            self._events.close()
        if self._lock is not None:
            self._lock.release()
        if err is not None:
            raise err

    def _settle_collection(self) -> bool:
        """Wait for retention's background chunk deletion (for ``close``). With ``save_timeout_s``, a pass that
        deletes no chunk for that long is stopped at its next chunk and False returned (a hung storage: what
        it has not deleted is garbage, collected when the next writer opens the root); otherwise True."""
        coll, limit = self.ctx.collection, self.save_timeout_s
        if limit is None:
            return coll.wait()
        while not coll.wait(limit):
            if time.monotonic() - self.ctx.store.last_progress > limit:
                coll.cancel()
                log.error(
                    "close(): deleting unreferenced chunks under %s made no progress for %s s (save_timeout_s); "
                    "it stops at its next chunk, the rest is collected when the next writer opens the root",
                    self.root,
                    limit,
                )
                return False
        return True

    def _report_other_failures(self, first: BaseException) -> None:
        """``close`` raises one background failure: log the other unseen ones and name their steps in it."""
        steps = []
        while True:
            try:
                self._saves.raise_background_error()
                break
            except SaveError as e:
                log.error("close(): the save of step %s failed too: %s", e.step, e)
                steps.append(e.step)
        if steps and isinstance(first, SaveError) and first.args and isinstance(first.args[0], str):
            first.args = (
                f"{first.args[0]} [the saves of steps {steps} failed too; see the log]",
                *first.args[1:],
            )

    def _pending_steps(self) -> list[int]:
        return self._saves.pending_steps()

    def _check_open(self, *, write: bool = False) -> None:
        if self._closed:
            raise ManagerClosedError("this CheckpointManager is closed; create a new one")
        if write and self.read_only:
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
        check_user_event(event)
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
        """Beat the heartbeat, record the step's loss and save if the save policy says so (or a preemption
        was requested: then save, close and exit the process). Call it after every training step, on every
        rank (collective under torch.distributed).

        Args:
            step: the step just completed (int >= 0).
            state: what ``save`` takes.
            metrics: numbers recorded in the manifest (e.g. ``{"loss": 0.7}``; ``KeepBest`` ranks by them;
                ``"loss"`` feeds the trajectory check after a restore).
            force: save whatever the policy says, e.g. ``force=step == total_steps`` so the final steps of a
                run whose length is not a multiple of the interval are not lost at a normal end. No second
                save when this step is already committed or being saved; a forced save waits for a free
                staging buffer even with ``when_busy="skip"``. Under torch.distributed pass the same value on
                every rank.

        Returns:
            The PendingSave (``wait()`` gives its SaveResult; ``skipped`` when ``when_busy="skip"`` found every
            staging buffer set busy), or None when no save was due.

        Raises:
            SaveError: this save failed (synchronous saves) or an earlier background save failed (raised
                once, and only after this call's own save, if one was due, was staged: that save goes on in
                the background and ``e.pending_save`` is its PendingSave, so ``except`` and carry on loses
                nothing); StorageFullError (a SaveError) when the disk is full. The message names the step whose
                save failed (``e.step``) and, apart, the call that reported it.
            CheckpointExistsError: the policy chose a step that is already committed.
            ResumeDivergedError: after a restore, the loss left the band of the losses logged before.
            ConfigError: ``step`` is not an int in ``[0, 2**62]`` (a float, str, bool or negative step;
                numpy integers are taken as ints), checked before the save policy.
            ManagerClosedError, ReadOnlyManagerError: the manager is closed or read-only.
        """
        step = as_step(step)  # before the policy: a float or negative step must not pass silently
        self._saves.tick(step, metrics)
        from .recovery.heartbeat import preemption_requested

        if self._preemption and self.dist.any(preemption_requested()):  # every rank agrees on the step
            self._event("preemption", step=step)
            from .recovery.heartbeat import exit_after_preemption_save

            if not self._saves.done(step):
                try:
                    self.save(step, state, metrics=metrics)
                except SaveError as e:  # an earlier save's failure: this one was started, close() commits it
                    if e.pending_save is None:
                        raise
                    log.error("an earlier save failed (%s); saving step %d before exiting", e, step)
            self.close()
            exit_after_preemption_save()
        if (force or self._saves.should_save(step)) and not (force and self._saves.done(step)):
            block = force or self.when_busy == "wait"
            self._check_open(write=True)
            # reports an earlier save's failure only after this save was staged (SaveError.pending_save)
            return self._saves.save(step, state, metrics=metrics, metadata=None, overwrite=False, block=block)
        self._saves.raise_background_error()
        return None

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
        Collective under torch.distributed: every rank calls it with the same ``step``.

        Args:
            step: the training step (int >= 0).
            state: name -> object with state_dict()/load_state_dict(), tensor (any dtype and shape, on any
                device; DTensor shards per rank), or nested dict/list/tuple of tensors and plain Python values.
            metrics: numbers recorded in the manifest (e.g. ``{"loss": 0.7}``).
            metadata: JSON-able user metadata recorded in the manifest.
            overwrite: replace an existing checkpoint of this step.

        Returns:
            A PendingSave; ``wait()`` returns the SaveResult (bytes, seconds blocked and persisting) or raises
            the background error.

        Raises:
            CheckpointExistsError: the step is already committed (or being saved) and ``overwrite`` is False.
            SaveError: an earlier background save failed (raised once, here or from wait/close; here only
                after this save was staged: it goes on in the background, ``e.pending_save``), or, for
                synchronous saves, this save failed. StorageFullError (a SaveError) when the disk is full;
                NonFiniteStateError (a SaveError) for NaN/Inf with ``check_finite="error"``.
                Nothing is committed by a failed save and earlier checkpoints are intact. The message names the
                step whose save failed (``e.step``) and, apart, the call that reported it.
            RunConflictError: a first save that would interleave with another run's checkpoints.
            ConfigError: ``step`` is not an int in ``[0, 2**62]`` (numpy integers are taken as ints), or the
                root's layout is one restore would refuse.
            ManagerClosedError, ReadOnlyManagerError: the manager is closed or read-only.
        """
        self._check_open(write=True)
        step = as_step(step)
        return self._saves.save(
            step, state, metrics=metrics, metadata=metadata, overwrite=overwrite, block=True
        )

    @property
    def check_finite_only(self) -> tuple[str, ...] | None:
        """Top-level entries the NaN/Inf scans cover (None: everything); set by integrations."""
        return self.validation.check_finite_only

    @check_finite_only.setter
    def check_finite_only(self, value: tuple[str, ...] | None) -> None:
        self.validation.check_finite_only = value

    @property
    def scrub_max_bandwidth(self) -> float | None:
        """The background scrubber's read cap, in bytes per second (None: uncapped)."""
        return self.validation.scrub_max_bandwidth

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
        return self.ctx.staging_bytes()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed or failed, and the chunks retention let go of are
        deleted (a background pass after each commit: :mod:`trainguard.retention.collector`).

        Args:
            timeout: seconds to wait at most (None: no limit).

        Raises:
            SaveError: a background save failed (raised once).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._saves_wait(timeout)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self.ctx.collection.wait(left):
            raise TimeoutError(f"unreferenced chunks under {self.root} still being deleted after {timeout} s")

    def _saves_wait(self, timeout: float | None = None) -> None:
        """:meth:`wait` for the pending saves only (a listing needs no chunk deletion to end)."""
        self._saves.wait(timeout)

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
        """Timings (seconds) and bytes of the last restore."""
        return self.ctx.last_restore

    @last_restore.setter
    def last_restore(self, value: RestoreTimings) -> None:
        self.ctx.last_restore = value

    # -- listing ------------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint under the root with status (valid / unverified / corrupt / incomplete), bytes and
        time, ascending by step (``trainguard ls`` also lists the steps whose save failed). Waits for this
        manager's pending saves first, so a save just made is listed. Cheap: reads manifests and stats chunks;
        ``verify`` re-reads data. Safe against a writer in another process committing and deleting
        checkpoints meanwhile (a stable scan, see :func:`catalog.scan`)."""
        self._saves_wait()
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
        self.ctx.collection.wait()  # a chunk found on the hot root must still be there once its manifest is
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
        Timings (seconds) and bytes read go to :attr:`last_restore`. Collective under torch.distributed.

        Args:
            step: the step to load (int >= 0).
            state: name -> object, as given to ``save``; loaded in place.
            strict: with False, load what matches, convert dtypes to the target's and log the differences
                instead of raising (shapes must still match).

        Returns:
            ``step``.

        Raises:
            CheckpointNotFoundError: no committed checkpoint of that step.
            CorruptCheckpointError: the checkpoint failed an integrity check. In one process every chunk is
                checked before loading (a chunk going into never-written memory as it loads, that memory put
                back as it was on failure): the state's objects were not modified. Under torch.distributed tensors
                loaded in place may hold part of it (``state_modified``): rebuild them before training.
            StateMismatchError: the state does not match the checkpoint (shapes; with ``strict``, keys, dtypes
                or missing optimizer state); one message lists every difference (the first 20 of each kind,
                then a count), the checkpoint's and the target's side.
            SuspectCheckpointError: the restored state holds NaN/Inf (``check_finite="error"``) or the probe
                differs; the step is marked suspect.
            InsufficientMemoryError: the checkpoint does not fit in this machine's memory.
            ConfigError: ``step`` is not an int in ``[0, 2**62]`` (numpy integers are taken as ints).
            ManagerClosedError: the manager is closed.
        """
        self._check_open()
        step = as_step(step)
        self.wait()  # the saves, and the chunk deletion after them (a restore never runs beside it)
        return _restore.restore_step(self.ctx, step, state, strict=strict)

    def restore_latest(self, state: MutableMapping[str, Any], *, strict: bool = True) -> int | None:
        """Load the newest VALID checkpoint into ``state`` in place and return its step.

        A corrupt or incomplete newer checkpoint is skipped with a logged warning (and an event naming the
        corrupt chunk); the next older one is tried. ``state`` and ``strict`` as in :meth:`restore`. Only the
        lineage of the run that committed last is considered (another run kept apart with ``new_run=True`` is
        passed over). A checkpoint that a writer in another process deletes meanwhile is not an error: the root
        is listed again. A writing manager records the restored checkpoint's run as its parent (its lineage).
        Timings (seconds) and the steps skipped go to :attr:`last_restore`. Collective under torch.distributed.

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
        self._check_open()
        self.wait()  # the saves, and the chunk deletion after them (a restore never runs beside it)
        return _restore.restore_newest(self.ctx, state, strict=strict)
