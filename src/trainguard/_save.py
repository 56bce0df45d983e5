"""The front of the save path (``CheckpointManager.save``/``maybe_save``): the checks before a save, the
copy into staging buffers and the hand-off to the async engine (or the synchronous persist), and the
per-step bookkeeping of ``maybe_save`` (heartbeat, loss trajectory, progress events, the save policy).

:class:`SavePath` receives what it uses (the run root's :class:`~trainguard._context.RootContext`, the save
policy, the validation) and owns the async engine (:class:`~trainguard.staging.persister.AsyncPersister`);
it never sees the manager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import _persist, _statefn, lineage
from ._context import RootContext
from ._gc import paused_gc
from ._text import exception_text
from ._writers import WriterThreads
from .catalog import inspect_step, is_committed
from .errors import CheckpointExistsError, ConfigError, SaveError, TrainguardError
from .format import step_dir_name
from .policies import SavePolicy
from .results import SaveResult
from .retention.apply import apply_retention
from .staging import PendingSave, Stager
from .staging.persister import AsyncPersister, SaveRequest
from .state import per_rank
from .validation.attach import Validation

log = logging.getLogger("trainguard")


class SavePath:
    """Saves of one writer: checks, staging, the async engine and the save policy's bookkeeping.

    Args:
        ctx: the run root's context (storage, chunk store, distributed context, event log, run identity).
        validation: the probe and NaN/Inf checks and the loss trajectory.
        save_policy: decides the steps ``maybe_save`` saves at; told of every save's timings.
        async_save: persist in a background thread (:attr:`persister`).
        staging_buffers: staging buffer sets of the async engine.
        save_timeout_s: a background save without progress for this many seconds is abandoned (None: never).
        read_only: no saves (no staging buffers, no worker).
        progress_interval_s: ``tick`` logs a ``progress`` event (rank 0) at most this often, in seconds.
    """

    def __init__(
        self,
        ctx: RootContext,
        validation: Validation,
        save_policy: SavePolicy,
        *,
        async_save: bool,
        staging_buffers: int,
        save_timeout_s: float | None,
        read_only: bool,
        progress_interval_s: float = 10.0,
    ) -> None:
        self.ctx = ctx
        self.validation = validation
        self.save_policy = save_policy
        self.async_save = async_save
        self.stager: Stager | None = Stager(staging_buffers) if async_save and not read_only else None
        self.persister: AsyncPersister | None = None
        if self.stager is not None:  # the async engine: queue, worker thread, in-flight saves, stall watchdog
            self.persister = AsyncPersister(
                self._persist_request,
                self.stager,
                save_timeout_s=save_timeout_s,
                last_progress=lambda: ctx.store.last_progress,
                event=ctx.event,
                on_persisted=lambda step, staging_s, result: save_policy.record_save(
                    step, now_s=time.monotonic(), block_s=staging_s, persist_s=result.persist_s
                ),
                rank=ctx.dist.rank,
                where=str(ctx.root),
            )
            ctx.in_flight_since = self.persister.in_flight_since
            ctx.staging_bytes = lambda: self.stager.nbytes if self.stager is not None else 0
        self._layout_ok = False  # checked at the first save (ChunkStore.layout_problem)
        self._run_checked = read_only
        self._codec_loaded = False  # blosc2 imported by this manager's first save with compression on
        self._first_step_logged = False
        self.progress_interval_s = progress_interval_s
        self._progress_t: float | None = None  # monotonic time of the last progress event (or first_step)

    # -- the async engine -----------------------------------------------------------------------------------
    def in_flight(self, step: int) -> bool:
        """Whether a save of ``step`` is still persisting in the background."""
        return self.persister is not None and self.persister.in_flight(step)

    def done(self, step: int) -> bool:
        """Whether ``step`` is committed or being saved."""
        return self.in_flight(step) or is_committed(self.ctx.storage, step)

    def pending_steps(self) -> list[int]:
        """Steps whose background saves have not finished."""
        return self.persister.pending_steps() if self.persister is not None else []

    def raise_background_error(self, started: PendingSave | None = None) -> None:
        """Raise (once) the error of a background save nobody has seen yet.

        Args:
            started: the save the calling ``save``/``maybe_save`` made before reporting the earlier error
                (None: none); it goes on in the background, and the error says so (``SaveError.pending_save``;
                None for a skipped save).
        """
        if self.persister is None:
            return
        try:
            self.persister.raise_background_error(skip=started)
        except SaveError as e:
            started = None if started is None or started.skipped else started
            e.pending_save = started
            if started is not None and e.args and isinstance(e.args[0], str):
                e.args = (
                    f"{e.args[0]} [reported by the save of step {started.step}, which was staged and is "
                    f"persisting in the background (SaveError.pending_save; wait() or close() reports its "
                    "outcome)]",
                    *e.args[1:],
                )
            raise

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed or failed (see ``CheckpointManager.wait``)."""
        if self.persister is not None:
            self.persister.wait(timeout)

    def stop(self) -> list[int]:
        """Stop the background worker; returns the steps whose saves were abandoned (no progress)."""
        if self.persister is None:
            return []
        abandoned = sorted(self.persister.abandoned_steps())
        self.persister.stop()
        return abandoned

    # -- maybe_save's bookkeeping -----------------------------------------------------------------------------
    def tick(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Beat the heartbeat, record the step's loss (checked after a restore) and log ``first_step`` and
        ``progress`` events.

        Raises:
            ResumeDivergedError: the loss diverged after a restore.
        """
        from .recovery.heartbeat import heartbeat

        heartbeat(step)
        self.validation.record_loss(step, metrics)
        if not self._first_step_logged:
            self._first_step_logged = True
            self.ctx.event("first_step", step=step)
        if self.ctx.dist.is_coordinator:
            now = time.monotonic()
            if self._progress_t is None:
                self._progress_t = now
            elif now - self._progress_t >= self.progress_interval_s:
                self.ctx.event("progress", step=step)
                self._progress_t = now

    def should_save(self, step: int) -> bool:
        """The save policy's decision for ``step`` (rank 0 decides for time-based policies)."""
        dist = self.ctx.dist
        decision = self.save_policy.should_save(step, now_s=time.monotonic())
        if dist.enabled and not getattr(self.save_policy, "step_based", False):
            decision = bool(dist.broadcast_ints([int(decision)])[0])
        return decision

    # -- one save -------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        overwrite: bool,
        block: bool,
    ) -> PendingSave:
        """Save ``state`` as the checkpoint of ``step`` (``CheckpointManager.save``; ``block``: wait for a
        free staging buffer set, else skip the save when every set is busy). Async tier uploads pause while
        the training thread is in here (:class:`~trainguard.tiers.upload.StagingGate`).

        Returns:
            The PendingSave (``skipped`` when no buffer set was free and ``block`` is False).

        An earlier background save's unseen failure is raised only after this save was staged and handed
        to the background (``SaveError.pending_save`` is this save's handle), so catching it never loses this
        save; when this save itself fails before that, its error is raised and the earlier one stays unseen
        (raised by the next call, ``wait`` or ``close``).

        Raises:
            ConfigError: a root layout that restore would refuse (the manager checked ``step`` with
                ``format.layout.as_step``).
            CheckpointExistsError: the step is committed (or being saved) and ``overwrite`` is False.
            RunConflictError: the first save would interleave with another run's checkpoints.
            SaveError: an earlier background save failed (this save was started: ``pending_save``), staging
                failed, or (synchronous) this save failed.
        """
        if self.ctx.tiers is None:
            handle = self._save(step, state, metrics, metadata, overwrite, block)
        else:
            with self.ctx.tiers.staging():
                handle = self._save(step, state, metrics, metadata, overwrite, block)
        self.raise_background_error(handle)
        return handle

    def _save(
        self,
        step: int,
        state: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        overwrite: bool,
        block: bool,
    ) -> PendingSave:
        """The save itself (:meth:`save` without reporting earlier background failures)."""
        ctx = self.ctx
        if not self._layout_ok:  # never report success for checkpoints that restore would refuse
            bad_layout = ctx.store.layout_problem()
            if bad_layout is not None:
                raise ConfigError(bad_layout)
            self._layout_ok = True
        if not self._run_checked:
            lineage.check_before_first_save(ctx, step)
            self._run_checked = True
            if ctx.dist.is_coordinator:  # a stricter keep frees space before this save writes anything
                apply_retention(ctx, at_open=True)
        if not overwrite and self.done(step):
            self._check_replace(step)
        t0 = time.perf_counter()
        now0 = time.monotonic()
        if not self._codec_loaded:  # counted in this save's stall (block_s): goodput subtracts it
            self._codec_loaded = True
            if ctx.compression is not None and ctx.compression.mode != "off":
                from .incremental import codecs  # here, not in the persist thread (see load_library)

                codecs.load_library()
        if self.persister is None or self.stager is None:
            with paused_gc():  # the caller waits for the whole save (see trainguard._gc)
                return self._save_sync(step, state, metrics, metadata, t0, now0)
        bufset = self.persister.acquire(block=block)  # not paused: this waits for an earlier persist
        if bufset is None:
            ctx.event(
                "save_skipped", step=step, reason="every staging buffer set is busy persisting earlier saves"
            )
            log.warning("skipping the save of step %d: earlier saves are still persisting", step)
            return PendingSave(step, time.perf_counter() - t0, skipped=True)
        try:
            with paused_gc():  # the state's flattening and staging; the persist pauses on its own
                flat, paths, top = self._collect(step, state)
                flat, paths = per_rank.split(flat, paths, top, ctx.dist, step)
                staged = self._stage_together(bufset, flat, step)
        except BaseException as e:
            self.stager.release(bufset)
            if isinstance(e, (TrainguardError, KeyboardInterrupt, SystemExit)):
                raise
            # as a synchronous save reports a failure: SaveError naming the cause
            raise SaveError(
                f"saving step {step} failed while staging: {exception_text(e)}; nothing was committed and "
                "earlier checkpoints are intact",
                step=step,
                rank_errors={ctx.dist.rank: e},
            ) from e
        staging_s = time.perf_counter() - t0
        handle = PendingSave(step, staging_s)
        self.save_policy.record_save(step, now_s=now0, block_s=staging_s, persist_s=None)
        self.persister.submit(SaveRequest(step, staged, paths, top, metrics, metadata, t0), handle, bufset)
        return handle

    def _check_replace(self, step: int) -> None:
        """``step`` is committed or in flight and ``overwrite`` is False: refuse, unless its checkpoint is
        corrupt (typically the one ``restore_latest`` just skipped), which holds nothing usable and is
        replaced rather than stop the training loop."""
        ctx = self.ctx
        in_flight = self.in_flight(step)
        info = (
            None
            if in_flight
            else inspect_step(ctx.storage, step, ctx.root / step_dir_name(step), ctx.store)[0]
        )
        if info is not None and info.usable:
            lineage.check_step_owner(ctx, step)
        if info is None or info.usable:
            raise CheckpointExistsError(
                f"step {step} already has a committed checkpoint under {ctx.root}; pass overwrite=True to "
                "replace it"
            )
        log.warning("replacing the %s checkpoint of step %d (%s)", info.status, step, info.problem)
        ctx.event("replace_corrupt", step=step, problem=info.problem)

    def _collect(
        self, step: int, state: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
        """The probe and the state's leaves (:func:`_statefn.collect`). Under torch.distributed a failure here
        goes through the save's first collective (:func:`per_rank.exchange`), so every rank raises at this
        step, not only this one while the others pair this save with its next."""
        try:
            self.validation.run_probe(step)
            return _statefn.collect(state)
        except BaseException as e:  # KeyboardInterrupt too: the other ranks must not go on alone
            if self.ctx.dist.enabled:
                per_rank.exchange(self.ctx.dist, step, {}, e)  # raises e here, an error naming us elsewhere
            raise

    def _stage_together(self, bufset: Any, flat: dict[str, Any], step: int) -> dict[str, Any]:
        """``bufset.stage(flat)``; under torch.distributed one all-reduce after it, so that a rank whose staging
        failed (host memory, a pinned allocation) does not leave the others persisting this step alone,
        their persist then waiting in its collectives until the group timeout."""
        try:
            staged = bufset.stage(flat)
        except BaseException:
            if self.ctx.dist.enabled:
                self.ctx.dist.any(True)
            raise
        if self.ctx.dist.enabled and self.ctx.dist.any(False):
            raise SaveError(
                f"saving step {step} failed: staging failed on another rank; nothing was committed and earlier "
                "checkpoints are intact",
                step=step,
            )
        return staged

    def _save_sync(
        self,
        step: int,
        state: Mapping[str, Any],
        metrics: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        t0: float,
        now0: float,
    ) -> PendingSave:
        """A synchronous save: persist in the caller's thread; returns a resolved PendingSave."""
        flat, paths, top = self._collect(step, state)
        flat, paths = per_rank.split(flat, paths, top, self.ctx.dist, step)
        handle = PendingSave(step)
        try:
            result = _persist.persist(self.ctx, step, flat, paths, top, metrics, metadata, t0, blocking=True)
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

    def _persist_request(
        self, req: SaveRequest, staging_s: float, cancel: threading.Event, writers: WriterThreads
    ) -> SaveResult:
        """The save path of a background save (run by the AsyncPersister's worker thread). Automatic garbage
        collection is paused meanwhile (at most ``trainguard._gc.DEFAULT_LIMIT_S``): a collection that the
        persist's allocations trigger holds the GIL, so it would stall the training thread as well."""
        with paused_gc():
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
                writers=writers,
            )
