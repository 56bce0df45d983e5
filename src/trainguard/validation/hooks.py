"""The small hooks that the save and restore paths call (kept here so those paths stay wiring)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..errors import NonFiniteStateError, ResumeDivergedError, SuspectCheckpointError
from . import finite
from .suspect import mark_suspect


class ValidationHost(Protocol):
    """What these hooks use: the validation settings and state of one manager
    (:class:`trainguard.validation.attach.Validation`); never the manager module."""

    @property
    def root(self) -> Path: ...

    @property
    def fsync(self) -> bool: ...

    @property
    def dist(self) -> Any: ...

    @property
    def check_finite(self) -> str: ...

    @property
    def probe(self) -> Any: ...

    @property
    def probe_rtol(self) -> float: ...

    @property
    def probe_atol(self) -> float: ...

    @property
    def saves(self) -> Any: ...

    @property
    def trajectory(self) -> Any: ...

    def event(self, name: str, **fields: Any) -> None: ...

    def wait(self, timeout: float | None = None) -> None: ...


log = logging.getLogger("trainguard")


def check_before_persist(
    mgr: ValidationHost, step: int, flat: Mapping[str, Any], known: Mapping[str, int] | None = None
) -> None:
    """``check_finite`` in the persist path (the background thread for async saves): scan the staged copy
    (``known``: name -> count of the tensors the writer threads already scanned, :class:`finite.SaveScan`).

    Raises:
        NonFiniteStateError: ``check_finite="error"`` and a floating tensor (on any rank) holds NaN/Inf.
    """
    mode = getattr(mgr, "check_finite", "off")
    if mode == "off":
        return
    t0 = time.perf_counter()
    bad = finite.scan(flat, getattr(mgr, "check_finite_only", None), known)
    scan_s = time.perf_counter() - t0
    # on io_group: this runs in the persist path (an async save's background thread), where a collective on
    # ctl_group would interleave with the training thread's (ranks pairing different collectives: a hang)
    any_bad = mgr.dist.any(bool(bad), io=True) if mgr.dist.enabled else bool(bad)
    if not any_bad:
        return
    where = f" on rank {mgr.dist.rank}" if mgr.dist.enabled else ""
    what = finite.describe(bad) if bad else "(none on this rank; another rank found non-finite values)"
    if mode == "warn":
        log.warning("step %d: saving a state with non-finite values%s: %s", step, where, what)
        mgr.event("save_nonfinite", step=step, tensors=bad, scan_s=scan_s)
        return
    mgr.event("save_rejected", step=step, reason="non-finite values", tensors=bad, scan_s=scan_s)
    raise NonFiniteStateError(
        f"the save of step {step} was rejected: non-finite values{where} in {what}. Nothing was committed, "
        "retention did not run and earlier checkpoints are intact; find where the NaN/Inf comes from (lower "
        "the learning rate, clip gradients, check the data), or pass check_finite='warn' to save it anyway",
        step=step,
        tensors=bad,
    )


def _suspect(mgr: ValidationHost, step: int, reason: str, by: str) -> SuspectCheckpointError:
    if mgr.dist.is_coordinator:
        mark_suspect(mgr.root, step, reason, by=by, fsync=mgr.fsync)
    mgr.event("checkpoint_suspect", step=step, reason=reason, by=by)
    log.warning("checkpoint of step %d is suspect: %s", step, reason)
    return SuspectCheckpointError(
        f"checkpoint of step {step} is suspect: {reason}; the state objects hold the values loaded from it: do not "
        "train on them (restore an older checkpoint over them, or rebuild them)",
        step=step,
        reason=reason,
    )


FINITE_SCOPE_KEY = "trainguard.check_finite_only"  # manifest metadata: the entries the save's scan covered


def finite_scope(mgr: Any, metadata: Mapping[str, Any] | None = None) -> tuple[str, ...] | None:
    """The entries ``check_finite`` covers: the manager's ``check_finite_only`` (set by an integration such as
    ``tg.lightning``), else the scope recorded in the checkpoint's metadata by the save, so that any reader
    (a plain ``CheckpointManager``, ``trainguard export``) scans what the writer scanned; None: everything."""
    own = getattr(mgr, "check_finite_only", None)
    if own is not None:
        return tuple(own)
    recorded = (metadata or {}).get(FINITE_SCOPE_KEY)
    if isinstance(recorded, list) and all(isinstance(x, str) for x in recorded):
        return tuple(recorded)
    return None


def scan_loaded(
    mgr: ValidationHost,
    step: int,
    loaded: Mapping[str, Any],
    metadata: Mapping[str, Any] | None = None,
    known: Mapping[str, int] | None = None,
) -> float:
    """The non-finite scan of every restored floating tensor (before the state's objects take them), within
    :func:`finite_scope` (``metadata``: the checkpoint's manifest metadata; ``known``: fqn -> NaN/Inf count
    of the tensors the reading threads already scanned, see :class:`~trainguard.distributed.chunkread.ShardReader`).

    Returns:
        The seconds it took.

    Raises:
        SuspectCheckpointError: a restored tensor holds NaN/Inf (with ``check_finite="error"``, the default);
            the step is marked suspect.
    """
    mode = getattr(mgr, "check_finite", "off")
    if mode == "off":
        return 0.0
    t0 = time.perf_counter()
    bad = finite.scan(loaded, finite_scope(mgr, metadata), known)
    any_bad = mgr.dist.any(bool(bad)) if mgr.dist.enabled else bool(bad)
    took = time.perf_counter() - t0
    if not any_bad:
        return took
    what = finite.describe(bad) if bad else "a tensor of another rank"
    if mode == "warn":
        log.warning("restored checkpoint of step %d holds non-finite values: %s", step, what)
        return took
    raise _suspect(mgr, step, f"non-finite values after load in {what}", "restore")


def check_probe(mgr: ValidationHost, step: int) -> float:
    """Recompute the probe on the restored objects and compare it with the one stored at save.

    Returns:
        The seconds it took (0 without a probe or without a stored probe).

    Raises:
        SuspectCheckpointError: the outputs differ (the step is marked suspect).
    """
    fn = getattr(mgr, "probe", None)
    if fn is None:
        return 0.0
    from .probe import ProbeRecordError, compare, compute, read_probe

    t0 = time.perf_counter()
    problem = None
    now = compute(fn)  # on every rank, stored record or not: the probe's forward may be collective (FSDP)
    try:
        stored = read_probe(mgr.root, step)
    except ProbeRecordError as e:
        log.warning("step %d: %s; the probe cannot vouch for this checkpoint", step, e)
        stored = None
    if stored is not None:
        problem = compare(stored, now, rtol=mgr.probe_rtol, atol=mgr.probe_atol)
    bad = mgr.dist.any(problem is not None) if mgr.dist.enabled else problem is not None
    took = time.perf_counter() - t0
    if bad:
        raise _suspect(mgr, step, problem or "the probe differs on another rank", "probe")
    return took


def diverged(mgr: ValidationHost, step: int) -> ResumeDivergedError:
    """After a trajectory violation: mark the restored checkpoint and this launch's checkpoints suspect."""
    tr = mgr.trajectory
    assert tr is not None and tr.check is not None
    chk = tr.check
    try:  # saves still persisting commit first, so they are marked too
        mgr.wait()
    except Exception:  # noqa: BLE001 - their failure is not this error; it was logged by the worker
        pass
    v = chk.violations
    if v:
        first = v[0]
        reason = (
            f"the loss diverged {first.step - chk.restored_step} step(s) after resuming from step "
            f"{chk.restored_step}: step {first.step} loss {first.loss:.6g}, {first.how}"
        )
    else:  # judged on the coordinator, whose losses are the logged reference
        reason = (
            f"the loss diverged by step {step} after resuming from step {chk.restored_step} (found by rank 0)"
        )
    own = sorted({r.step for r in mgr.saves if r.step > chk.restored_step})
    from .trajectory import confirmed_steps

    kept = confirmed_steps(mgr.root)  # a resume from them reproduced the failed launch: never condemned
    marked = [s for s in (chk.restored_step, *own) if s not in kept]
    if mgr.dist.is_coordinator:
        for s in marked:
            mark_suspect(
                mgr.root,
                s,
                reason
                if s == chk.restored_step
                else f"saved by a launch whose loss diverged after resume: {reason}",
                by="trajectory",
                fsync=mgr.fsync,
            )
        if tr.log is not None:
            tr.log.mark_diverged(step)
    mgr.event(
        "resume_diverged",
        step=step,
        restored_step=chk.restored_step,
        steps=[x.step for x in v],
        losses=[x.loss for x in v],
        expected=[x.expected for x in v],
        suspect=marked,
    )
    tr.check = None
    return ResumeDivergedError(
        f"{reason}. Checkpoints {marked} are marked suspect; the next launch resumes from an older checkpoint "
        f"(`trainguard mark {mgr.root} STEP --clear` if the change was intended)"
        + (
            f"; step {chk.restored_step} is kept: an earlier resume from it was confirmed"
            if chk.restored_step in kept
            else ""
        ),
        restored_step=chk.restored_step,
        steps=[x.step for x in v],
        values=[x.loss for x in v],
        expected=[x.expected for x in v],
        suspect_steps=marked,
    )
