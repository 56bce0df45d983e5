"""The metric log of a run root and the loss-trajectory check after a resume.

Every launch's writer (rank 0) appends the ``loss`` it is given by ``maybe_save(step, state, metrics=...)``
to ``trajectory/<start time ns>-<run id>.jsonl`` in the run root, one JSON line per step
(``{"step": 12, "loss": 0.53}``): one buffered ``write`` per step, no fsync (a line lost in a crash only
shortens the reference). After a restore of step S, for the next ``trajectory_steps`` steps, each new loss is
compared with one of two references:

- **same-step references**: the losses recorded for the steps after S by the launches before this one (the
  newest launch that logged the step wins: the launch that died), only from launches at the same world size
  (each log starts with ``{"world_size": N}``; at another world size a step trains on other samples per rank).
  Equal when resume is bit-exact. Two tolerances:

  * **reproduced**: ``|loss - ref| <= EXACT_REL * |ref|`` (1e-4 relative: a resume that reproduced the failed
    launch, up to the last digits that nondeterministic GPU reductions change). Once every reference step in
    the window was reproduced, the restore is **confirmed** (``{"confirmed": S}`` in this launch's log, a
    ``resume_confirmed`` event with the largest relative difference accepted) and the check ends: past the
    failure point the trajectory is new territory, which no band may judge.
  * **diverged**: ``|loss - ref| > max(K * MAD, REL_TOL * |ref|)`` trips the check (``ResumeDivergedError``).
  * in between, the resume is neither confirmed nor condemned: it trains like the failed launch but not the
    same (a data order or RNG stream that moved, another device). It is reported once (a
    ``resume_not_reproduced`` event and a ``ResumeNotExactWarning`` "resume not reproduced exactly") and the restored step is
    never confirmed by this launch.
- **the band**, only when there is no same-step reference (an elastic resize, a lost log) and the restored step
  was never confirmed: the median of the last ``BAND_RUN`` losses (judged from ``MIN_RUN`` on) must stay
  ``<= median + BAND_K * MAD + BAND_REL * |median|`` of the last ``BAND_WINDOW`` losses logged at or before S,
  and needs at least ``MIN_BAND`` of them (fewer: no band).

MAD is the median absolute deviation of those same losses. A NaN/Inf loss always violates. A launch that
tripped the check writes ``{"diverged": true}`` into its own log, which is then never used as a reference; a
trip never marks a confirmed checkpoint suspect.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..storage.safeio import MAX_EVENT_FILE_BYTES, read_bounded

TRAJECTORY_DIR = "trajectory"
K = 6.0
"""Tolerance of a same-step comparison in MADs of the losses before the restored step."""
REL_TOL = 1e-3
"""Relative tolerance always allowed before a trip (a resume that is not bit-exact; a flat loss whose MAD
is 0)."""
EXACT_REL = 1e-4
"""Relative difference up to which a same-step loss counts as *reproduced* (confirms the resume). A bit-exact
resume gives equal losses; 1e-4 leaves room for GPU kernels whose reductions are not deterministic (float32
sums in another order differ in the 6th-7th significant digit, and the difference grows a little over the
steps of the window), while a shifted dropout mask or data order moves a per-batch loss by percents."""
MIN_SPREAD = 5
"""Fewer losses than this before the restored step: the same-step tolerance is ``REL_TOL`` alone."""
BAND_WINDOW = 50
"""Losses at or before the restored step that define the band."""
MIN_BAND = 20
"""Fewer losses than this before the restored step: no band (a band of a few noisy losses condemns healthy
runs)."""
BAND_K = 10.0
"""Width of the band in MADs."""
BAND_REL = 0.1
"""Relative margin of the band, on top of ``BAND_K`` MADs: 10 % of the median."""
BAND_RUN = 5
"""Past the failure point the band judges the median of the last ``BAND_RUN`` losses (at least
``MIN_RUN``), not one step: a single noisy batch above the band is not a divergence, a sustained rise is."""
MIN_RUN = 3


def loss_value(metrics: Any) -> Any:
    """The ``loss`` of a metrics mapping: a float, a tensor on an accelerator (read one step later, so that
    reading it does not wait for the step just queued), or None (absent or not a number)."""
    if not metrics or "loss" not in metrics:
        return None
    x = metrics["loss"]
    device = getattr(getattr(x, "device", None), "type", "cpu")
    if hasattr(x, "detach"):
        x = x.detach()  # float() of a tensor that requires grad warns
        if device != "cpu":
            return x
    try:
        return float(x)
    except (TypeError, ValueError, RuntimeError):
        return None


class TrajectoryLog:
    """This launch's append-only loss log (rank 0 of a writer)."""

    def __init__(self, root: str | os.PathLike[str], run_id: str, world_size: int | None = None) -> None:
        self.world_size = world_size
        self.dir = Path(root) / TRAJECTORY_DIR
        self.path = self.dir / f"{time.time_ns():020d}-{run_id}.jsonl"
        self._f: Any = None
        self.failed = False

    def _write(self, rec: dict[str, Any]) -> None:
        if self.failed:
            return
        try:
            if self._f is None:
                self.dir.mkdir(exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
                self._f = os.fdopen(fd, "a", buffering=1)  # line-buffered: one write per line
                if self.world_size is not None:
                    self._f.write(json.dumps({"world_size": self.world_size}) + "\n")
            self._f.write(json.dumps(rec, allow_nan=True) + "\n")
        except OSError:
            self.failed = True  # the log is advisory: training goes on without it

    def append(self, step: int, loss: float) -> None:
        self._write({"step": step, "loss": loss})

    def mark_confirmed(self, restored_step: int) -> None:
        self._write({"confirmed": restored_step})

    def mark_diverged(self, step: int) -> None:
        self._write({"diverged": True, "step": step})

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def _read_log(path: Path, confirmed: set[int] | None = None) -> tuple[dict[int, float], bool, int | None]:
    """``(step -> loss, diverged, world size)`` of one log; adds the steps it confirmed to ``confirmed``."""
    steps: dict[int, float] = {}
    diverged = False
    world_size: int | None = None
    try:
        text = read_bounded(path, MAX_EVENT_FILE_BYTES, what="trajectory log").decode("utf-8", "replace")
    except OSError:
        return steps, False, None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if not isinstance(rec, dict):
            continue
        if rec.get("diverged") is True:
            diverged = True
        c = rec.get("confirmed")
        if confirmed is not None and isinstance(c, int) and not isinstance(c, bool):
            confirmed.add(c)
        ws = rec.get("world_size")
        if isinstance(ws, int) and not isinstance(ws, bool) and world_size is None:
            world_size = ws
        s, x = rec.get("step"), rec.get("loss")
        if isinstance(s, int) and not isinstance(s, bool) and isinstance(x, (int, float)):
            steps[s] = float(x)
    return steps, diverged, world_size


def history(
    root: str | os.PathLike[str], *, exclude: Path | None = None, world_size: int | None = None
) -> dict[int, float]:
    """step -> loss from every earlier launch's log that did not diverge; the newest launch wins a step.

    With ``world_size``: only launches that ran at that world size (or did not record one)."""
    return _histories(root, exclude=exclude, world_size=world_size)[1]


def confirmed_steps(root: str | os.PathLike[str]) -> set[int]:
    """The restored steps whose resume matched the failed launch's losses (confirmed), in any launch's log."""
    out: set[int] = set()
    _histories(root, exclude=None, world_size=None, confirmed=out)
    return out


def _histories(
    root: str | os.PathLike[str],
    *,
    exclude: Path | None,
    world_size: int | None,
    confirmed: set[int] | None = None,
) -> tuple[dict[int, float], dict[int, float]]:
    """Reads each log once: ``(every launch's losses, those of launches at world_size)`` (see :func:`history`;
    the second is the first when ``world_size`` is None); collects confirmed restored steps into ``confirmed``."""
    d = Path(root) / TRAJECTORY_DIR
    every: dict[int, float] = {}
    same: dict[int, float] = {}
    try:
        names = sorted(e.name for e in os.scandir(d) if e.name.endswith(".jsonl"))
    except OSError:
        return every, same
    for name in names:  # oldest first (the name starts with the launch's start time)
        p = d / name
        if exclude is not None and p == exclude:
            continue
        steps, diverged, ws = _read_log(p, confirmed)
        if diverged:
            continue
        every.update(steps)
        if world_size is None or ws is None or ws == world_size:
            same.update(steps)
    return every, same


class Recorder:
    """A writer's trajectory state: its log (rank 0), the check armed after a restore, and a loss held on an
    accelerator until the next step."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        run_id: str,
        window: int,
        *,
        coordinator: bool,
        world_size: int | None = None,
    ) -> None:
        self.root = root
        self.world_size = world_size
        self.run_id = run_id
        self.window = window
        self.coordinator = coordinator
        self.log: TrajectoryLog | None = None
        self.check: TrajectoryCheck | None = None
        self._pending: tuple[int, Any] | None = None

    def arm(self, restored_step: int) -> None:
        """Start checking the next ``window`` steps against the losses logged before (no-op when 0)."""
        if self.window <= 0:
            return
        own = self.log.path if self.log is not None else None
        self.check = TrajectoryCheck.arm(
            self.root, restored_step, self.window, exclude=own, world_size=self.world_size
        )

    def record(self, step: int, metrics: Any) -> bool:
        """Log the loss of ``step`` (and of a deferred earlier step); True when the armed check found a violation."""
        items: list[tuple[int, Any]] = []
        if self._pending is not None:
            items.append(self._pending)
            self._pending = None
        x = loss_value(metrics)
        if x is not None and not isinstance(x, float):
            self._pending = (step, x)
        elif x is not None:
            items.append((step, x))
        bad = False
        for s, v in items:
            v = float(v)
            if self.coordinator:
                if self.log is None:
                    self.log = TrajectoryLog(self.root, self.run_id, self.world_size)
                self.log.append(s, v)
            # only the coordinator's losses are logged, so only they have a reference: under torch.distributed
            # each rank's loss is its own batch's (the verdict is shared with every rank by the caller)
            if self.coordinator and self.check is not None and self.check.check(s, v) is not None:
                bad = True
        return bad

    def confirm(self) -> tuple[int, list[int], float] | None:
        """Once, when the armed check just became confirmed (coordinator: the one that judges): log it and return
        ``(restored step, matched steps, largest relative difference accepted)``. The check stays armed, judging nothing more, until its window ends
        (every rank calls the collective of the check for the same steps)."""
        chk = self.check
        if chk is None or not chk.confirmed or chk.announced:
            return None
        chk.announced = True
        if self.log is None:
            self.log = TrajectoryLog(self.root, self.run_id, self.world_size)
        self.log.mark_confirmed(chk.restored_step)
        return chk.restored_step, sorted(chk.matched), chk.max_rel

    def not_reproduced(self) -> dict[str, Any] | None:
        """Once, when the armed check first saw a same-step loss within the trip tolerance but not reproduced
        (coordinator): the fields of the ``resume_not_reproduced`` event, else None."""
        chk = self.check
        if chk is None or not chk.inexact or chk.reported_inexact:
            return None
        chk.reported_inexact = True
        step, (loss, ref) = min(chk.inexact.items())
        return {
            "restored_step": chk.restored_step,
            "step": step,
            "loss": loss,
            "expected": ref,
            "rel_diff": abs(loss - ref) / abs(ref) if ref else math.inf,
            "tolerance": EXACT_REL,
        }

    def passed(self, step: int) -> None:
        """After the check of ``step`` passed on every rank: disarm once past the window."""
        if self.check is not None and self.check.done(step):
            self.check = None

    def close(self) -> None:
        if self._pending is not None and self.coordinator:
            step, x = self._pending
            self._pending = None
            if self.log is None:
                self.log = TrajectoryLog(self.root, self.run_id, self.world_size)
            self.log.append(step, float(x))
        if self.log is not None:
            self.log.close()


@dataclass
class Violation:
    step: int
    loss: float
    expected: float
    how: str


@dataclass
class TrajectoryCheck:
    """Armed after a restore of ``restored_step``; checks the losses of the next ``window`` steps."""

    restored_step: int
    window: int
    reference: dict[int, float]
    median: float | None
    mad: float | None
    violations: list[Violation] = field(default_factory=list)
    recent: list[float] = field(default_factory=list)
    matched: set[int] = field(default_factory=set)
    """Reference steps whose loss was reproduced (within ``EXACT_REL``)."""
    inexact: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Reference steps whose loss stayed within the trip tolerance but was not reproduced: step -> (loss, ref)."""
    max_rel: float = 0.0
    """The largest relative difference of a reproduced step (0.0: every one was equal)."""
    announced: bool = False
    reported_inexact: bool = False

    @property
    def confirmed(self) -> bool:
        """Every same-step reference in the window was reproduced (within ``EXACT_REL``) and none was not: the
        resume reproduced the failed launch."""
        return bool(self.reference) and not self.inexact and self.matched >= self.reference.keys()

    @classmethod
    def arm(
        cls,
        root: str | os.PathLike[str],
        restored_step: int,
        window: int,
        *,
        exclude: Path | None = None,
        world_size: int | None = None,
    ) -> TrajectoryCheck:
        confirmed: set[int] = set()
        hist, same = _histories(root, exclude=exclude, world_size=world_size, confirmed=confirmed)
        reference = {s: x for s, x in same.items() if restored_step < s <= restored_step + window}
        before = [hist[s] for s in sorted(s for s in hist if s <= restored_step)][-BAND_WINDOW:]
        before = [x for x in before if math.isfinite(x)]
        median = mad = None
        if len(before) >= MIN_SPREAD:
            m = statistics.median(before)
            mad = statistics.median(abs(x - m) for x in before)
            # the band only without same-step references, from enough losses, for a step never confirmed
            if not reference and len(before) >= MIN_BAND and restored_step not in confirmed:
                median = m
        return cls(restored_step, window, reference, median, mad)

    def done(self, step: int) -> bool:
        return step > self.restored_step + self.window

    def check(self, step: int, loss: float) -> Violation | None:
        """Judge the loss of ``step``; returns the violation (also kept in ``violations``) or None."""
        if step <= self.restored_step or self.done(step) or self.confirmed:
            return None  # a confirmed restore is never judged again: past the failure point is new territory
        v: Violation | None = None
        ref = self.reference.get(step)
        mad = self.mad or 0.0
        if not math.isfinite(loss):
            v = Violation(step, loss, ref if ref is not None else float("nan"), "the loss is not finite")
        elif ref is not None:
            tol = max(K * mad, REL_TOL * abs(ref))
            if abs(loss - ref) > tol:
                v = Violation(
                    step, loss, ref, f"the loss recorded for step {step} before the failure was {ref:.6g}"
                )
            elif abs(loss - ref) <= EXACT_REL * abs(ref):
                self.matched.add(step)
                if ref:
                    self.max_rel = max(self.max_rel, abs(loss - ref) / abs(ref))
            else:
                self.inexact[step] = (loss, ref)
        elif self.median is not None and not self.reference:
            upper = self.median + BAND_K * mad + BAND_REL * abs(self.median)
            self.recent = [*self.recent, loss][-BAND_RUN:]
            run = statistics.median(self.recent)
            if len(self.recent) >= MIN_RUN and run > upper:
                v = Violation(
                    step,
                    loss,
                    upper,
                    f"the median of the last {len(self.recent)} losses ({run:.6g}) is above the band of the "
                    f"losses before step {self.restored_step} (median {self.median:.6g} + {BAND_K:g} MAD + "
                    f"{BAND_REL:.0%} = {upper:.6g})",
                )
        if v is not None:
            self.violations.append(v)
        return v
