"""The figures of a run, computed from its event log alone (``trainguard report``, ``status`` and metrics).

Everything here is derived from the records of ``<run root>/events/*.jsonl`` (docs/FORMAT.md, "Event log"):
no second source of truth. A root that is still being written is fine: the figures describe the run up to
its newest event, and a recovery still in progress has ``ttr_s`` None.

Definitions (all times in seconds, wall clock):

- **Attempt**: one launch of the job, keyed by ``(run_id, restart_count)``; a job run without the supervisor
  is one attempt per manager process (keyed by its pid).
- **Wall time**: the union of the spans ``[first event, last event]`` of each supervised run (records with
  one ``run_id``) and of each unsupervised manager process, so idle time between two separate runs on the
  same root is not counted.
- **Surviving steps**: attempt k trains steps ``(restored_k, end_k]``; steps above the restored step of any
  later attempt were lost and trained again. Processing attempts from the last to the first,
  ``useful_k = (restored_k, min(end_k, cutoff)]`` and then ``cutoff = min(cutoff, restored_k)``.
- **Productive time** of an attempt: the wall time its step trajectory (``first_step``, ``progress``, the
  start of each ``save`` (``t - persist_s``) and the failure's ``last_step`` at ``t_death``), linearly
  interpolated, took to train its surviving steps, less the blocking time of the saves among them, and never
  below zero (a save that blocks past the trajectory's last point, e.g. a final save waited for, can block
  longer than the interpolated span it ends). The time of the first step itself is estimated from the
  attempt's mean step time.
- **Goodput**: productive time over wall time, in (0, 1] (None before any step completed). Over time: the
  productive time accrued by each instant over the wall time elapsed then.
- **Checkpoint interval**: measured as the median compute time between the starts of two consecutive saves
  of one attempt (their spacing less the blocking time C); the optimum is Daly's (2006) with the asynchronous
  rule ``max(T, L)`` (:func:`trainguard.planning.optimal_interval_s`) for the run's own median C (blocking
  seconds per save), median L (persist seconds per save) and MTBF (wall time over failures, preemptions
  excluded). R and D for the waste model are the mean restart time (TTR less detection) and detection time.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Iterable
from typing import Any

from ..recovery.ttr import PHASES

FAILURE_FIELDS = ("kind", "cause", "step", "steps_lost", "ttr_s", "phases")
"""The fields of each failure that ``trainguard report --json`` promises (more may follow)."""

GOODPUT_SAMPLES = 60
"""Points of the goodput-over-time curve."""

TIMELINE_POINTS = 4000
"""The timeline keeps at most about this many (time, step) points over all attempts (evenly thinned; the first
and last point of each attempt always kept). Goodput is computed from every point."""


def _thin(points: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``points``, evenly spaced by index, always keeping the first and the last."""
    if len(points) <= most:
        return points
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _rank0(rec: dict[str, Any]) -> bool:
    return rec.get("rank") in (0, None)


def attempt_key(rec: dict[str, Any]) -> tuple[str, int]:
    """The attempt a record belongs to: ``(run_id, restart_count)``, or ``("pid:<pid>", 0)`` without a run id.

    Args:
        rec: one event record.

    Returns:
        A hashable key; records of one supervised attempt share it across processes and ranks.
    """
    run_id = rec.get("run_id")
    if isinstance(run_id, str) and run_id:
        rc = _int(rec.get("restart_count"))
        return (run_id, rc if rc is not None else -1)
    return (f"pid:{rec.get('pid')}", 0)


def _group_key(rec: dict[str, Any]) -> str:
    run_id = rec.get("run_id")
    return run_id if isinstance(run_id, str) and run_id else f"pid:{rec.get('pid')}"


def wall_spans(records: Iterable[dict[str, Any]]) -> list[tuple[float, float]]:
    """The merged wall-clock spans covered by the runs of a root (see the module docstring).

    Args:
        records: event records (any order).

    Returns:
        Disjoint ``(start, end)`` pairs in seconds since the epoch, ascending.
    """
    spans: dict[str, list[float]] = {}
    for r in records:
        t = _num(r.get("t"))
        if t is None:
            continue
        s = spans.setdefault(_group_key(r), [t, t])
        s[0], s[1] = min(s[0], t), max(s[1], t)
    merged: list[tuple[float, float]] = []
    for a, b in sorted((s[0], s[1]) for s in spans.values()):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _wall_until(spans: list[tuple[float, float]], t: float) -> float:
    return sum(max(0.0, min(b, t) - a) for a, b in spans if a < t)


class _Attempt:
    """The step trajectory and saves of one attempt."""

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.t_first_event = math.inf
        self.restored: int | None = None
        self.has_restore = False
        self.first: tuple[float, int] | None = None
        self.points: list[tuple[float, int]] = []
        self.saves: list[dict[str, Any]] = []

    def trajectory(self) -> list[tuple[float, int]]:
        """(t, step) points, ascending in t, with steps made non-decreasing."""
        pts = sorted(self.points)
        out: list[tuple[float, int]] = []
        for t, s in pts:
            if out and s < out[-1][1]:
                s = out[-1][1]
            out.append((t, s))
        return out

    def start_step(self) -> int | None:
        if self.has_restore:
            return self.restored or 0
        if self.first is not None:
            return self.first[1] - 1
        return None


def _time_at_step(traj: list[tuple[float, int]], step: float) -> float:
    """Wall time the trajectory reached ``step`` (linear interpolation; clamped to its ends)."""
    steps = [s for _, s in traj]
    i = bisect.bisect_left(steps, step)
    if i <= 0:
        return traj[0][0]
    if i >= len(traj):
        return traj[-1][0]
    (t0, s0), (t1, s1) = traj[i - 1], traj[i]
    return t0 if s1 == s0 else t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def _attempts(records: list[dict[str, Any]]) -> list[_Attempt]:
    by_key: dict[tuple[str, int], _Attempt] = {}

    def get(rec: dict[str, Any]) -> _Attempt:
        key = attempt_key(rec)
        a = by_key.get(key)
        if a is None:
            a = by_key[key] = _Attempt(key)
        return a

    for r in records:
        name, t = r.get("event"), _num(r.get("t"))
        if t is None or not _rank0(r):
            continue
        if name in ("manager_start", "job_start"):
            a = get(r)
            a.t_first_event = min(a.t_first_event, t)
        elif name == "restore" and not get(r).has_restore:
            a = get(r)
            a.has_restore, a.restored = True, _int(r.get("step"))
        elif name == "first_step" and _int(r.get("step")) is not None:
            a = get(r)
            a.first = (t, int(r["step"]))
            a.points.append(a.first)
        elif name == "progress" and _int(r.get("step")) is not None:
            get(r).points.append((t, int(r["step"])))
        elif name == "save" and _int(r.get("step")) is not None:
            a = get(r)
            a.saves.append(r)
            a.points.append((t - (_num(r.get("persist_s")) or 0.0), int(r["step"])))
        elif name == "failure" and _int(r.get("last_step")) is not None:
            get(r).points.append((_num(r.get("t_death")) or t, int(r["last_step"])))
    out = [a for a in by_key.values() if a.points]
    for a in out:
        a.t_first_event = min(a.t_first_event, min(t for t, _ in a.points))
    return sorted(out, key=lambda a: a.t_first_event)


def _productive_intervals(attempts: list[_Attempt]) -> list[tuple[float, float, float]]:
    """Per attempt with surviving steps: (wall start, wall end, blocking seconds of its surviving saves)."""
    out: list[tuple[float, float, float]] = []
    cutoff = math.inf
    for a in reversed(attempts):
        traj = a.trajectory()
        start = a.start_step()
        if start is None or not traj:
            continue
        end = traj[-1][1]
        useful_end = min(end, cutoff)
        cutoff = min(cutoff, start)
        if useful_end <= start:
            continue
        t_first, s_first = a.first if a.first is not None else traj[0]
        span_steps = end - s_first
        per_step = (traj[-1][0] - t_first) / span_steps if span_steps > 0 else 0.0
        t_begin = t_first - max(0, s_first - start) * per_step
        t_end = _time_at_step(traj, useful_end) if useful_end > s_first else t_first
        blocked = sum(_num(s.get("block_s")) or 0.0 for s in a.saves if start < int(s["step"]) <= useful_end)
        out.append((t_begin, max(t_begin, t_end), blocked))
    return out


def goodput(
    records: list[dict[str, Any]],
    *,
    samples: int = GOODPUT_SAMPLES,
    _attempts_: list[_Attempt] | None = None,
    _spans: list[tuple[float, float]] | None = None,
) -> tuple[float | None, list]:
    """Goodput of the run and its curve over time (see the module docstring).

    Args:
        records: every event record of the root, ascending in ``t``.
        samples: points of the curve.

    Returns:
        ``(goodput, [[seconds since the run's start, goodput], ...])``; goodput is None when no step completed
        or the wall time is 0.
    """
    spans = _spans if _spans is not None else wall_spans(records)
    intervals = _productive_intervals(_attempts_ if _attempts_ is not None else _attempts(records))
    if not spans or not intervals:
        return None, []
    t0, t1 = spans[0][0], spans[-1][1]

    def at(t: float) -> float | None:
        wall = _wall_until(spans, t)
        if wall <= 0:
            return None
        prod = 0.0
        for a, b, blocked in intervals:
            if t >= b:
                prod += max(0.0, b - a - blocked)
            elif t > a:
                prod += max(0.0, (t - a) - blocked * (t - a) / (b - a))
        return min(1.0, prod / wall)

    total = at(t1)
    curve = []
    for i in range(1, samples + 1):
        t = t0 + (t1 - t0) * i / samples
        g = at(t)
        if g is not None:
            curve.append([t - t0, g])
    if total is not None and total <= 0:
        total = None
    return total, curve


def _save_record(r: dict[str, Any], t0: float) -> dict[str, Any]:
    t = float(r["t"])
    persist = _num(r.get("persist_s"))
    return {
        "step": int(r["step"]),
        "t": t,
        "t_s": t - t0,
        "start_s": t - (persist or 0.0) - t0,
        "block_s": _num(r.get("block_s")),
        "persist_s": persist,
        "bytes": _int(r.get("bytes")),
        "stored_bytes": _int(r.get("stored_bytes", r.get("bytes"))),
        "bytes_written": _int(r.get("bytes_written")),
        "chunks": _int(r.get("chunks")),
        "restart_count": _int(r.get("restart_count")),
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def checkpoint_interval(
    records: list[dict[str, Any]],
    failures: list[dict[str, Any]],
    wall_s: float,
    *,
    _attempts_: list[_Attempt] | None = None,
) -> dict[str, Any]:
    """The measured checkpoint interval against the Young/Daly optimum for the run's own C, L and MTBF.

    Args:
        records: every event record, ascending in ``t``.
        failures: the failures as in :func:`compute_figures` (their ``cause``, ``ttr_s`` and ``phases``).
        wall_s: the run's wall time (seconds).

    Returns:
        ``measured_s`` (median compute seconds between save starts), ``optimal_s`` (Daly with the async rule;
        None without a failure or a save), ``young_s``, ``checkpoint_s`` (C), ``persist_s`` (L), ``mtbf_s``,
        ``failures``, ``exposure_s``, ``restart_s`` (R), ``detect_s`` (D), ``waste_measured`` and
        ``waste_optimal`` (first-order expected waste fractions), ``ratio`` (measured / optimal) and a
        ``reason`` sentence.
    """
    from ..planning import expected_waste_fraction, optimal_interval_s, young_interval_s

    attempts = _attempts_ if _attempts_ is not None else _attempts(records)
    blocks = [b for a in attempts for s in a.saves if (b := _num(s.get("block_s"))) is not None]
    persists = [p for a in attempts for s in a.saves if (p := _num(s.get("persist_s"))) is not None]
    c, lat = _median(blocks), _median(persists)
    spacings = []
    for a in attempts:
        starts = sorted(float(s["t"]) - (_num(s.get("persist_s")) or 0.0) for s in a.saves)
        spacings += [b - x for x, b in zip(starts, starts[1:], strict=False)]
    spacing = _median(spacings)
    measured = max(0.0, spacing - (c or 0.0)) if spacing is not None else None
    counted = [f for f in failures if f.get("cause") != "preempted"]
    mtbf = wall_s / len(counted) if counted and wall_s > 0 else None
    detects = [d for f in failures if (d := _num((f.get("phases") or {}).get("detection_s"))) is not None]
    restarts = [
        f["ttr_s"] - (_num((f.get("phases") or {}).get("detection_s")) or 0.0)
        for f in failures
        if _num(f.get("ttr_s")) is not None
    ]
    r_s, d_s = _mean(restarts) or 0.0, _mean(detects) or 0.0
    out: dict[str, Any] = {
        "measured_s": measured,
        "spacing_s": spacing,
        "optimal_s": None,
        "young_s": None,
        "method": "daly",
        "checkpoint_s": c,
        "persist_s": lat,
        "mtbf_s": mtbf,
        "failures": len(counted),
        "exposure_s": wall_s,
        "restart_s": r_s,
        "detect_s": d_s,
        "waste_measured": None,
        "waste_optimal": None,
        "ratio": None,
    }
    if c is None:
        out["reason"] = "no checkpoint was committed: C is unknown"
        return out
    if mtbf is None:
        out["reason"] = (
            f"no failure in {wall_s:.0f} s of run: the MTBF is unknown (at least the run's length), so the "
            "optimum is too"
        )
        return out
    optimal = optimal_interval_s(c, mtbf, persist_s=lat)
    out["optimal_s"] = optimal
    out["young_s"] = max(young_interval_s(c, mtbf), lat or c)
    out["waste_optimal"] = expected_waste_fraction(
        max(optimal, 1e-9), c, mtbf, restart_s=r_s, detect_s=d_s, persist_s=lat
    )
    if measured is not None and measured > 0:
        out["waste_measured"] = expected_waste_fraction(
            measured, c, mtbf, restart_s=r_s, detect_s=d_s, persist_s=lat
        )
        out["ratio"] = measured / optimal if optimal > 0 else None
    verdict = ""
    if out["ratio"] is not None:
        verdict = (
            "about right"
            if 0.5 <= out["ratio"] <= 2.0
            else ("too frequent" if out["ratio"] < 0.5 else "too rare")
        )
        verdict = f"; the measured interval is {out['ratio']:.2f}x the optimum: {verdict}"
    out["reason"] = (
        f"Daly optimum for C = {c:.3g} s, L = {lat if lat is not None else c:.3g} s, MTBF = {mtbf:.3g} s "
        f"({len(counted)} failure(s) in {wall_s:.0f} s){verdict}"
    )
    return out


def compute_figures(records: list[dict[str, Any]], *, now: float | None = None) -> dict[str, Any]:
    """Everything ``trainguard report`` shows, from the event records of one root.

    Args:
        records: every event record of the root, ascending in ``t`` (:func:`trainguard.eventlog.read_events`).
        now: the wall time the figures are taken at (default: the current time); only ``generated_at``.

    Returns:
        A JSON-ready dict with ``failures`` (each: ``kind`` (the injected fault's kind, else the cause),
        ``cause``, ``injected``, ``attempt``, ``step`` (the last step done before it: the heartbeat, else the
        injected fault's step), ``injected_step`` (the ``step`` its ``fault_injected`` event logged, or None),
        ``last_step``, ``restored_step``, ``steps_lost``,
        ``ttr_s``, ``phases``, ``exit_code``, ``signal``, ``t``, ``t_s``), ``goodput`` (float in (0, 1] or
        None), ``goodput_timeline``, ``saves`` (each: ``step``, ``t``, ``t_s``, ``start_s``, ``block_s``,
        ``persist_s``, ``bytes``, ``stored_bytes``, ``bytes_written``, ``chunks``, ``restart_count``),
        ``save_failures``, ``checkpoints`` (totals; ``corrupt_detected`` and ``suspect_detected``, the steps a
        restore skipped as corrupt or as suspect; ``retention``: each commit from ``from_s`` to ``to_s``, its
        deletion or, ``replaced`` True, a later save of the same step; None while kept), ``interval``
        (:func:`checkpoint_interval`), ``run`` (start, end, wall time, attempts, restarts, status, last step)
        and ``timeline`` (steps over time per attempt, commits, failures, restarts, and each recovery at its
        first step after the restore: ``[t_s, restored_step]``). Times ``*_s`` are seconds since the run's
        first event; ``t`` is seconds since the epoch.
    """
    recs = [r for r in records if _num(r.get("t")) is not None]
    spans = wall_spans(recs)
    t0 = spans[0][0] if spans else 0.0
    t_end = spans[-1][1] if spans else 0.0
    wall_s = sum(b - a for a, b in spans)

    saves = [
        _save_record(r, t0) for r in recs if r.get("event") == "save" and _int(r.get("step")) is not None
    ]
    deleted = sorted(
        {
            int(r["step"])
            for r in recs
            if r.get("event") == "retention_delete" and _int(r.get("step")) is not None
        }
    )
    save_failures = [
        {"step": r.get("step"), "t": r["t"], "t_s": r["t"] - t0, "error": r.get("error")}
        for r in recs
        if r.get("event") == "save_failed" and _rank0(r)
    ]
    skipped = [r for r in recs if r.get("event") == "restore_skipped" and _int(r.get("step")) is not None]
    # a suspect checkpoint (intact bytes, content failed validation: probe, NaN/Inf, loss) is not corrupt
    suspect = sorted({int(r["step"]) for r in skipped if str(r.get("problem", "")).startswith("suspect")})
    corrupt = sorted({int(r["step"]) for r in skipped} - set(suspect))
    saved_steps = sorted({s["step"] for s in saves})
    deletions: dict[int, list[float]] = {}
    for r in recs:
        if r.get("event") == "retention_delete" and _int(r.get("step")) is not None:
            deletions.setdefault(int(r["step"]), []).append(float(r["t"]))
    retention = []
    for s in saves:
        deleted_t = min((t for t in deletions.get(s["step"], []) if t >= s["t"]), default=None)
        # a later save of the same step (a resumed attempt redoing it) replaces this checkpoint
        replaced_t = min((o["t"] for o in saves if o["step"] == s["step"] and o["t"] > s["t"]), default=None)
        gone = min((t for t in (deleted_t, replaced_t) if t is not None), default=None)
        retention.append(
            {
                "step": s["step"],
                "from_s": s["t_s"],
                "to_s": None if gone is None else gone - t0,
                "replaced": replaced_t is not None and gone == replaced_t,
            }
        )
    blocks = [s["block_s"] for s in saves if s["block_s"] is not None]
    persists = [s["persist_s"] for s in saves if s["persist_s"] is not None]
    checkpoints = {
        "count": len(saves),
        "bytes": sum(s["bytes"] or 0 for s in saves),
        "stored_bytes": sum(s["stored_bytes"] or 0 for s in saves),
        "bytes_written": sum(s["bytes_written"] or 0 for s in saves),
        "mean_block_s": _mean(blocks),
        "max_block_s": max(blocks) if blocks else None,
        "mean_persist_s": _mean(persists),
        "max_persist_s": max(persists) if persists else None,
        "deleted": deleted,
        "retained": [s for s in saved_steps if s not in deleted],
        "corrupt_detected": corrupt,
        "suspect_detected": suspect,
        "save_failures": len(save_failures),
        "retention": retention,
    }

    recoveries = {
        (r.get("run_id"), _int(r.get("restart_count"))): r for r in recs if r.get("event") == "recovery"
    }
    injected = [r for r in recs if r.get("event") == "fault_injected"]
    failures: list[dict[str, Any]] = []
    for r in recs:
        if r.get("event") != "failure":
            continue
        # the job-wide restart number (the job's TRAINGUARD_RESTART_COUNT); a supervisor's own attempt
        # number differs from it when several nodes' supervisors share one run id
        attempt = _int(r.get("restart_count"))
        if attempt is None:
            attempt = _int(r.get("attempt"))
        fault = next(
            (
                f
                for f in reversed(injected)
                if f.get("run_id") == r.get("run_id")
                and _int(f.get("restart_count")) == attempt
                and float(f["t"]) <= float(r["t"])
            ),
            None,
        )
        rec = recoveries.get((r.get("run_id"), None if attempt is None else attempt + 1))
        phases = dict.fromkeys(PHASES)
        if rec is not None and isinstance(rec.get("phases"), dict):
            phases.update({k: _num(v) for k, v in rec["phases"].items() if k in phases})
        last_step = _int(r.get("last_step"))
        step = _int(fault.get("step")) if fault is not None else None
        failures.append(
            {
                "kind": str(fault.get("kind")) if fault is not None else r.get("cause"),
                "cause": r.get("cause"),
                "injected": fault is not None,
                "attempt": attempt,
                # the step a failure hit is the last step the job reported done (as `trainguard run` says);
                # the injected fault's own step only when no heartbeat came
                "step": last_step if last_step is not None else step,
                "injected_step": step,
                "last_step": last_step,
                "restored_step": _int(rec.get("restored_step")) if rec else None,
                "steps_lost": _int(rec.get("steps_lost")) if rec else None,
                "ttr_s": _num(rec.get("ttr_s")) if rec else None,
                "phases": phases,
                "exit_code": r.get("exit_code"),
                "signal": r.get("signal"),
                "t": float(r["t"]),
                "t_s": (_num(r.get("t_death")) or float(r["t"])) - t0,
            }
        )

    attempts = _attempts(recs)
    good, curve = goodput(recs, _attempts_=attempts, _spans=spans)
    progress = [
        {
            "attempt": a.key[1] if not a.key[0].startswith("pid:") else None,
            "restored_step": a.start_step(),
            "points": [
                [t - t0, s] for t, s in _thin(a.trajectory(), max(50, TIMELINE_POINTS // len(attempts)))
            ],
        }
        for a in attempts
    ]
    ends = [r for r in recs if r.get("event") in ("success", "give_up", "stop")]
    starts = [r for r in recs if r.get("event") in ("supervisor_start", "job_start")]
    status = "running"
    if ends and (not starts or float(ends[-1]["t"]) >= float(starts[-1]["t"])):
        status = {"success": "succeeded", "give_up": "gave_up", "stop": "stopped"}[str(ends[-1]["event"])]
    elif not starts:
        status = "unsupervised"
    last_steps = [p[1] for a in attempts for p in a.trajectory()[-1:]]
    job_starts = [r for r in recs if r.get("event") == "job_start"]
    out = {
        "format": "trainguard-report/1",
        "generated_at": time.time() if now is None else now,
        "run": {
            "t_start": t0,
            "t_end": t_end,
            "wall_s": wall_s,
            "status": status,
            "attempts": len(job_starts) if job_starts else len(attempts),
            "restarts": sum(1 for r in recs if r.get("event") == "restart"),
            "last_step": max(last_steps) if last_steps else None,
            "run_ids": sorted({r["run_id"] for r in recs if isinstance(r.get("run_id"), str)}),
        },
        "failures": failures,
        "goodput": good,
        "goodput_timeline": curve,
        "saves": saves,
        "save_failures": save_failures,
        "checkpoints": checkpoints,
        "interval": {},
        "timeline": {
            "attempts": progress,
            "commits": [[s["t_s"], s["step"]] for s in saves],
            "failures": [[f["t_s"], f["last_step"]] for f in failures],
            "restarts": [float(r["t"]) - t0 for r in job_starts[1:]],
            "recoveries": [
                [f["t_s"] + f["ttr_s"], f["restored_step"]]
                for f in failures
                if f["ttr_s"] is not None and f["restored_step"] is not None
            ],
        },
    }
    out["interval"] = checkpoint_interval(recs, failures, wall_s, _attempts_=attempts)
    return out


def report_figures(root: str, *, now: float | None = None) -> dict[str, Any]:
    """:func:`compute_figures` of the event log under ``root`` (the figures of ``trainguard report --json``).

    Args:
        root: the run root.
        now: see :func:`compute_figures`.

    Returns:
        The figures, with ``root`` added.
    """
    from ..eventlog import read_events

    figs = compute_figures(read_events(root), now=now)
    figs["root"] = str(root)
    return figs
