"""The validation of one manager (issue 11): its settings, the probe records of saves in flight, the
trajectory recorder and the background scrubber, and the hooks the save and restore paths call.

Built by the manager with explicit dependencies (run root, distributed context, event log, the manager's
committed saves and its ``wait``); the save path (``_persist``) and the restore path (``_restore``) reach it
through ``RootContext.validation``. Nothing here imports the manager.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import ResumeNotExactWarning
from . import finite, hooks


def _no_wait(timeout: float | None = None) -> None:
    return None


class Validation:
    """Validation settings and state of one manager (see ``CheckpointManager``'s arguments of the same names).

    Args:
        root: the run root directory (``suspect.json`` markers, probe records, the trajectory log).
        dist: the distributed context (collective verdicts).
        event: writes one event to the run's event log (``event(name, **fields)``).
        saves: the manager's most recent committed saves (:class:`~trainguard.results.SaveResult`), read when
            a divergence marks this launch's checkpoints suspect.
        fsync: make the markers durable.
        check_finite: ``"error"``, ``"warn"`` or ``"off"``.
        probe: ``fn() -> tensor | dict[str, tensor]`` or None.
        probe_rtol: relative tolerance of the probe comparison.
        probe_atol: absolute tolerance of the probe comparison.
        trajectory_steps: steps checked after a restore (0: off).
        scrub_interval_s: seconds between background scrubs (None: off).
        scrub_max_bandwidth: the scrubber's read cap, bytes per second (None: uncapped).

    Attributes:
        check_finite_only: top-level entries the NaN/Inf scan covers (None: everything; set by an integration
            such as ``tg.lightning`` through ``CheckpointManager.check_finite_only``).
        validate_s: seconds the non-finite scan of the last load took.
        trajectory: the writer's :class:`~trainguard.validation.trajectory.Recorder` (None until
            :meth:`start_writer`).
        scrubber: the background :class:`~trainguard.validation.scrub.Scrubber` (None when off).
        wait: blocks until the manager's pending saves committed (set by the manager; used before marking
            this launch's checkpoints suspect).
    """

    def __init__(
        self,
        *,
        root: Path,
        dist: Any,
        event: Callable[..., None],
        saves: Any,
        fsync: bool = True,
        check_finite: str = "error",
        probe: Callable[[], Any] | None = None,
        probe_rtol: float = 0.0,
        probe_atol: float = 0.0,
        trajectory_steps: int = 50,
        scrub_interval_s: float | None = None,
        scrub_max_bandwidth: float | None = None,
    ) -> None:
        self.root = root
        self.dist = dist
        self.event = event
        self.saves = saves
        self.fsync = fsync
        self.check_finite = check_finite
        self.probe = probe
        self.probe_rtol = float(probe_rtol)
        self.probe_atol = float(probe_atol)
        self.trajectory_steps = trajectory_steps
        self.scrub_interval_s = None if scrub_interval_s is None else float(scrub_interval_s)
        self.scrub_max_bandwidth = scrub_max_bandwidth
        self.check_finite_only: tuple[str, ...] | None = None
        self.validate_s = 0.0
        self.trajectory: Any = None
        self.scrubber: Any = None
        self.wait: Callable[..., None] = _no_wait
        # step -> (probe outputs, seconds the probe took), until the save of that step commits or fails
        self._probes: dict[int, tuple[dict[str, Any], float]] = {}
        # fqn -> (dtype, chunk hashes) of tensors last saved finite (finite.SaveScan: not scanned again)
        self._finite_memory: dict[str, tuple[str, tuple[str, ...]]] = {}

    # -- a writer's background parts ------------------------------------------------------------------------
    def start_writer(self, run_id: str, *, tiers: Any = None) -> None:
        """Open the trajectory recorder and (rank 0, ``scrub_interval_s`` set) start the scrubber; ``tiers``:
        the manager's TierSet, from which the scrubber repairs damaged chunks (None: report only)."""
        from .trajectory import Recorder

        self.trajectory = Recorder(
            self.root,
            run_id,
            self.trajectory_steps,
            coordinator=self.dist.is_coordinator,
            world_size=self.dist.world_size,
        )
        if self.scrub_interval_s is not None and self.dist.is_coordinator:
            from .scrub import Scrubber

            self.scrubber = Scrubber(
                self.root,
                self.event,
                self.scrub_interval_s,
                max_bytes_per_s=self.scrub_max_bandwidth,
                tiers=tiers,
            )
            self.scrubber.start()

    def close(self) -> None:
        """Stop the scrubber and flush the trajectory log."""
        if self.scrubber is not None:
            self.scrubber.stop()
        if self.trajectory is not None:
            self.trajectory.close()

    # -- the save path ------------------------------------------------------------------------------------
    def run_probe(self, step: int) -> None:
        """Compute the probe in the caller's thread (the training loop's); its record goes with this step's
        save (:meth:`before_persist`)."""
        if self.probe is None:
            return
        from .probe import compute

        t = time.perf_counter()
        outputs = compute(self.probe)
        self._probes[step] = (outputs, time.perf_counter() - t)

    def before_persist(
        self, step: int, flat: Mapping[str, Any], *, scan: bool = True
    ) -> tuple[dict[str, Any], float] | None:
        """In the persist path: take the probe record of ``step`` and scan the staged state for NaN/Inf.

        Args:
            step: the step being saved.
            flat: the staged state (flat name -> value).
            scan: scan here; False when the caller runs :meth:`scan_before_commit` itself (after the writes,
                whose threads scan the tensors with chunks of their own: :meth:`save_scan`).

        Returns:
            (probe outputs, seconds the probe took), or None without a probe.

        Raises:
            NonFiniteStateError: ``check_finite="error"`` and a floating tensor (any rank) holds NaN/Inf.
        """
        probe = self._probes.pop(step, None)
        if scan:
            self.scan_before_commit(step, flat)
        return probe

    def save_scan(self) -> finite.SaveScan | None:
        """The scan the writer threads run on one save's own-chunk tensors (None with ``check_finite="off"``);
        its ``known`` counts go to :meth:`scan_before_commit`."""
        if self.check_finite == "off":
            return None
        return finite.SaveScan(self._finite_memory, self.check_finite_only)

    def scan_before_commit(
        self, step: int, flat: Mapping[str, Any], known: Mapping[str, int] | None = None
    ) -> None:
        """The ``check_finite`` scan of the staged state (any thread; a no-op with ``check_finite="off"``);
        ``known``: name -> count of the tensors already scanned (:meth:`save_scan`), not scanned again.

        Raises:
            NonFiniteStateError: ``check_finite="error"`` and a floating tensor (any rank) holds NaN/Inf.
        """
        hooks.check_before_persist(self, step, flat, known)

    # -- the restore path ---------------------------------------------------------------------------------
    def after_load(
        self,
        step: int,
        loaded: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        known: Mapping[str, int] | None = None,
    ) -> None:
        """The non-finite scan of the restored tensors (before the state's objects take them); its seconds
        go to :attr:`validate_s`. ``known``: fqn -> NaN/Inf count of the tensors the reading threads already
        scanned as their chunks landed (not scanned again).

        Raises:
            SuspectCheckpointError: a restored tensor holds NaN/Inf (``check_finite="error"``).
        """
        self.validate_s = hooks.scan_loaded(self, step, loaded, metadata, known)

    def check_probe(self, step: int) -> float:
        """Recompute the probe on the restored objects and compare; returns the seconds it took.

        Raises:
            SuspectCheckpointError: the outputs differ (the step is marked suspect).
        """
        return hooks.check_probe(self, step)

    # -- the training loop --------------------------------------------------------------------------------
    def arm(self, step: int) -> None:
        """After a restore of ``step``: check the next ``trajectory_steps`` losses against the logged ones."""
        if self.trajectory is not None:
            self.trajectory.arm(step)

    def record_loss(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Append the step's loss to the run's trajectory log; after a restore, check it (collective while the
        check is armed: every rank calls ``maybe_save`` each step, with or without a loss).

        Raises:
            ResumeDivergedError: the loss differs from the one logged for the same step before the failure, or
                (no such reference) left the band of the losses before the restored step.
        """
        tr = self.trajectory
        if tr is None:
            return
        armed = tr.check is not None
        bad = tr.record(step, metrics)
        if not armed:
            return
        if self.dist.enabled:
            bad = self.dist.any(bad)
        if bad:
            raise hooks.diverged(self, step)
        inexact = tr.not_reproduced()
        if inexact is not None:  # within the trip tolerance, but not the failed launch's loss: say so, once
            self.event("resume_not_reproduced", **inexact)
            warnings.warn(
                f"trainguard: resume not reproduced exactly: after the restore of step {inexact['restored_step']} "
                f"the loss of step {inexact['step']} is {inexact['loss']:.6g}, the launch before the failure "
                f"logged {inexact['expected']:.6g} (relative difference {inexact['rel_diff']:.2g} > "
                f"{inexact['tolerance']:g}); the run goes on (not a divergence), but state that decides the "
                "training (data order, DataLoader seed, RNG streams, dropout) was not restored exactly; a "
                "DataLoader without its own generator= is a common cause (use ResumableLoader or "
                "ResumableSampler.dataloader)",
                ResumeNotExactWarning,
                stacklevel=4,
            )
        confirmed = tr.confirm()
        if confirmed is not None:  # the resume reproduced the failed launch: nothing more is judged
            self.event(
                "resume_confirmed", restored_step=confirmed[0], steps=confirmed[1], max_rel_diff=confirmed[2]
            )
        tr.passed(step)
