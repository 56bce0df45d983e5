"""Accounting of a supervised run: attempts, recoveries, and time-to-resume (TTR) joined from both sides.

One recovery is everything between a failure of attempt ``k - 1`` and the first training step completed by
attempt ``k`` (``restart_count == k``). TTR is ``t(first step completed) - t_death`` and splits into phases
measured on both sides of the process boundary:

========================  ====================================================  ==========================
phase                     interval                                               measured by
========================  ====================================================  ==========================
``detection_s``           death (exit, signal, last heartbeat of a hang) ->      supervisor
                          noticed
``teardown_s``            noticed -> process group gone (SIGTERM, grace,         supervisor
                          SIGKILL for hangs; leftovers otherwise)
``backoff_s``             deliberate wait before the relaunch                    supervisor
``relaunch_s``            spawn -> ``manager_start`` (imports, model build)       supervisor + manager
``identification_s``      scan the root and choose the latest valid step         manager (``restore.scan_s``)
``load_s``                read and deserialize that step                         manager (``restore.load_s``)
``validation_s``          post-load validation                                   manager (``restore.validate_s``)
``first_step_s``          ``restore`` done -> first step completed               manager (``first_step``)
========================  ====================================================  ==========================

The phases do not tile TTR exactly (user code between ``manager_start`` and ``restore_latest`` is in no
phase), so ``ttr_s >= sum(phases)``. Manager events are matched on ``run_id`` and ``restart_count`` (both
from the environment the supervisor sets) and taken from rank 0 (or records without a rank). A job that does
not use the manager gets the supervisor phases only, and its first heartbeat stands for the first step.

This join needs the manager's events in the supervisor's event log: ``trainguard run --root`` must be the
job's checkpoint root.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .events import EVENTS_DIR, is_regular_file
from .heartbeat import Heartbeat

PHASES = (
    "detection_s",
    "teardown_s",
    "backoff_s",
    "relaunch_s",
    "identification_s",
    "load_s",
    "validation_s",
    "first_step_s",
)
"""Phase names, in the order they happen."""

MANAGER_EVENTS = ("manager_start", "restore", "first_step")
"""Events the manager writes that the join uses."""

HEARTBEAT_FALLBACK_DELAY_S = 2.0
"""Wait this long after the first heartbeat of an attempt for a ``manager_start`` before deciding that the job
does not use the manager and taking the heartbeat as its first step."""


class EventTail:
    """Incremental reader of the run's event log: each poll reads only bytes appended since the last one.

    Files already present when the tail is created are skipped to their end (they belong to earlier runs).

    Args:
        root: the run root.
        run_id: keep only records of this run.
        ignore: a file not to read (the supervisor's own log).
    """

    def __init__(self, root: str | os.PathLike[str], run_id: str, *, ignore: Path | None = None) -> None:
        self.dir = Path(root) / EVENTS_DIR
        self.run_id = run_id
        self._ignore = ignore
        self._offsets: dict[Path, int] = {}
        for f in self._files():
            try:
                self._offsets[f] = f.stat().st_size
            except OSError:
                pass

    def _files(self) -> list[Path]:
        try:
            return [f for f in self.dir.glob("*.jsonl") if f != self._ignore and is_regular_file(f)]
        except OSError:
            return []

    def poll(self) -> list[dict[str, Any]]:
        """Return the new complete records of this run (a torn last line waits for the next poll)."""
        out: list[dict[str, Any]] = []
        for f in self._files():
            offset = self._offsets.get(f, 0)
            try:
                with open(f, "rb") as fh:
                    fh.seek(offset)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[f] = offset + end + 1
            for line in data[: end + 1].splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("run_id") == self.run_id:
                    out.append(rec)
        out.sort(key=lambda r: float(r.get("t", 0.0)))
        return out


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class RecoveryTiming:
    """The time-to-resume of one recovery (the ``recovery`` event).

    Attributes:
        restart_count: the attempt that recovered (1 for the first restart).
        t_death: best estimate of the failure time (seconds since the epoch).
        last_step: the last step the failed attempt reported by heartbeat, or None.
        restored_step: the step the new attempt restored (0 when it found no checkpoint), or None when unknown.
        steps_lost: ``last_step - restored_step`` (at least 0), or None when either is unknown.
        ttr_s: seconds from ``t_death`` to the first step completed after the restore, or None.
        phases: seconds per phase of :data:`PHASES`; None where the data is missing.
        complete: True when the first post-recovery step was seen.
        first_step_source: ``"manager"`` (``first_step`` event), ``"heartbeat"`` (first beat), or None.
    """

    restart_count: int
    t_death: float
    last_step: int | None
    restored_step: int | None
    steps_lost: int | None
    ttr_s: float | None
    phases: dict[str, float | None]
    complete: bool
    first_step_source: str | None

    def to_dict(self) -> dict[str, Any]:
        """Return the record as JSON-ready fields."""
        return {
            "restart_count": self.restart_count,
            "t_death": self.t_death,
            "last_step": self.last_step,
            "restored_step": self.restored_step,
            "steps_lost": self.steps_lost,
            "ttr_s": self.ttr_s,
            "phases": dict(self.phases),
            "complete": self.complete,
            "first_step_source": self.first_step_source,
        }

    def describe(self) -> str:
        """One line for humans: TTR, its phases, restored step and steps lost."""
        parts = []
        for name in PHASES:
            v = self.phases.get(name)
            if v is not None:
                parts.append(f"{name[:-2].replace('_', ' ')} {v:.2f}")
        ttr = f"{self.ttr_s:.2f} s" if self.ttr_s is not None else "unknown (no first step seen)"
        known = [v for v in self.phases.values() if v is not None]
        other = ""
        if self.ttr_s is not None and known:
            other = f" (+{max(0.0, self.ttr_s - sum(known)):.2f} other)"
        restored = "unknown" if self.restored_step is None else str(self.restored_step)
        lost = "unknown" if self.steps_lost is None else str(self.steps_lost)
        return (
            f"recovery {self.restart_count}: ttr {ttr} = {' + '.join(parts) or 'no phases'}{other}; "
            f"restored step {restored}, steps lost {lost}"
        )


@dataclass
class PendingRecovery:
    """A recovery in progress: supervisor facts known at relaunch, manager facts as they arrive.

    Attributes:
        restart_count: the new attempt's restart count.
        t_death: failure time of the previous attempt (seconds since the epoch).
        detect_s: death to noticed (seconds).
        teardown_s: noticed to process group gone (seconds).
        backoff_s: the wait before the relaunch (seconds).
        last_step: the failed attempt's last heartbeat step.
        t_spawn: when the new attempt was spawned (seconds since the epoch), None until then.
    """

    restart_count: int
    t_death: float
    detect_s: float | None
    teardown_s: float | None
    backoff_s: float | None
    last_step: int | None
    t_spawn: float | None = None
    first_beat: Heartbeat | None = None
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: bool = False

    def offer(self, record: dict[str, Any]) -> None:
        """Keep the first rank-0 manager record of this attempt for each event name."""
        name = record.get("event")
        if name not in MANAGER_EVENTS or name in self.records:
            return
        if record.get("restart_count") != self.restart_count or record.get("rank", 0) not in (0, None):
            return
        self.records[str(name)] = record

    def offer_heartbeats(self, beats: list[Heartbeat]) -> None:
        """Remember the earliest first beat of the new attempt (its first completed step, for jobs without a
        manager)."""
        for hb in beats:
            if self.first_beat is None or hb.first_t < self.first_beat.first_t:
                self.first_beat = hb

    def ready(self, now: float) -> bool:
        """Return True when the first post-recovery step is known (see :data:`HEARTBEAT_FALLBACK_DELAY_S`).

        Args:
            now: the current wall time (seconds since the epoch).
        """
        if "first_step" in self.records:
            return True
        if "manager_start" in self.records or self.first_beat is None:
            return False
        return now - self.first_beat.first_t >= HEARTBEAT_FALLBACK_DELAY_S

    def finish(self) -> RecoveryTiming:
        """Compute the recovery's timing from what is known now and mark it done."""
        self.done = True
        return compute_recovery(
            restart_count=self.restart_count,
            t_death=self.t_death,
            detect_s=self.detect_s,
            teardown_s=self.teardown_s,
            backoff_s=self.backoff_s,
            last_step=self.last_step,
            t_spawn=self.t_spawn,
            manager_start=self.records.get("manager_start"),
            restore=self.records.get("restore"),
            first_step=self.records.get("first_step"),
            first_beat=self.first_beat,
        )


def compute_recovery(
    *,
    restart_count: int,
    t_death: float,
    detect_s: float | None,
    teardown_s: float | None,
    backoff_s: float | None,
    last_step: int | None,
    t_spawn: float | None,
    manager_start: dict[str, Any] | None,
    restore: dict[str, Any] | None,
    first_step: dict[str, Any] | None,
    first_beat: Heartbeat | None = None,
) -> RecoveryTiming:
    """Join supervisor facts and manager events into one :class:`RecoveryTiming`.

    Args:
        restart_count: the recovering attempt (>= 1).
        t_death: failure time of the previous attempt (seconds since the epoch).
        detect_s: detection latency (seconds).
        teardown_s: kill and cleanup time (seconds).
        backoff_s: wait before relaunch (seconds).
        last_step: the failed attempt's last heartbeat step.
        t_spawn: spawn time of the new attempt (seconds since the epoch).
        manager_start: the new attempt's ``manager_start`` event (field ``t``: manager ready).
        restore: its ``restore`` event (``t`` = restore done; ``step``, ``scan_s``, ``load_s``,
            ``validate_s``; ``step`` None means it started from scratch).
        first_step: its ``first_step`` event (``t`` = first step completed).
        first_beat: the new attempt's earliest heartbeat, used when there is no ``first_step`` event.

    Returns:
        The timing; fields that need missing events are None.
    """
    phases: dict[str, float | None] = dict.fromkeys(PHASES)
    phases["detection_s"] = detect_s
    phases["teardown_s"] = teardown_s
    phases["backoff_s"] = backoff_s
    t_ready = _num(manager_start.get("t")) if manager_start else None
    if t_ready is not None and t_spawn is not None:
        phases["relaunch_s"] = max(0.0, t_ready - t_spawn)
    t_restored = None
    restored_step: int | None = None
    if restore is not None:
        phases["identification_s"] = _num(restore.get("scan_s"))
        phases["load_s"] = _num(restore.get("load_s"))
        phases["validation_s"] = _num(restore.get("validate_s"))
        t_restored = _num(restore.get("t"))
        step = restore.get("step")
        restored_step = int(step) if isinstance(step, int) and not isinstance(step, bool) else 0
    t_first: float | None = None
    source: str | None = None
    if first_step is not None and _num(first_step.get("t")) is not None:
        t_first, source = _num(first_step.get("t")), "manager"
    elif first_beat is not None:
        t_first, source = first_beat.first_t, "heartbeat"
    if t_first is not None and t_restored is not None and source == "manager":
        phases["first_step_s"] = max(0.0, t_first - t_restored)
    ttr_s = max(0.0, t_first - t_death) if t_first is not None else None
    steps_lost = None
    if last_step is not None and restored_step is not None:
        # The heartbeat may lag a save by up to 0.1 s, so a restored step past the last beat is 0 lost, not < 0.
        steps_lost = max(0, last_step - restored_step)
    return RecoveryTiming(
        restart_count=restart_count,
        t_death=t_death,
        last_step=last_step,
        restored_step=restored_step,
        steps_lost=steps_lost,
        ttr_s=ttr_s,
        phases=phases,
        complete=t_first is not None,
        first_step_source=source,
    )


@dataclass(frozen=True)
class Attempt:
    """One launch of COMMAND and how it ended.

    Attributes:
        attempt: 0 for the first launch (equals its ``TRAINGUARD_RESTART_COUNT``).
        pid: the process id (also the process group id).
        t_start: spawn time (seconds since the epoch).
        t_end: when the process group was gone (seconds since the epoch).
        outcome: ``"success"``, ``"stopped"``, or a failure cause: ``"exit"``, ``"signal"``, ``"hang"``,
            ``"preempted"``.
        exit_code: the exit status (None when killed by a signal).
        signal: the signal's name when killed by one (e.g. ``"SIGKILL"``).
        last_step: the highest heartbeat step of the attempt, or None.
        t_death: best estimate of the failure time (exit noticed; last heartbeat for hangs).
        detect_s: death to noticed (seconds).
        teardown_s: noticed to process group gone (seconds).
    """

    attempt: int
    pid: int
    t_start: float
    t_end: float
    outcome: str
    exit_code: int | None
    signal: str | None
    last_step: int | None
    t_death: float
    detect_s: float
    teardown_s: float

    @property
    def failed(self) -> bool:
        """True for the failure outcomes."""
        return self.outcome not in ("success", "stopped")


@dataclass(frozen=True)
class RunResult:
    """Everything ``trainguard run`` reports.

    Attributes:
        exit_code: see :data:`EXIT_CODES`.
        status: ``"succeeded"``, ``"gave_up"``, ``"stopped"``, ``"preempted"`` or ``"spawn_failed"``.
        reason: why it gave up or stopped (``"max_restarts"``, ``"no_progress"``, ``"SIGTERM"``, ...).
        run_id: the run id passed to every attempt.
        root: the run root.
        command: the supervised command.
        attempts: every launch, in order.
        recoveries: the TTR of every recovery, in order.
        event_log: the supervisor's event log file (JSON lines), or None.
        error: what went wrong in words, when the command could not start (``"command not found: ..."``).
    """

    exit_code: int
    status: str
    reason: str | None
    run_id: str
    root: str
    command: tuple[str, ...]
    attempts: tuple[Attempt, ...]
    recoveries: tuple[RecoveryTiming, ...]
    event_log: str | None = None
    error: str | None = None

    @property
    def failures(self) -> list[Attempt]:
        """The attempts that failed."""
        return [a for a in self.attempts if a.failed]

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON summary printed by ``trainguard run --json``."""
        return {
            "exit_code": self.exit_code,
            "status": self.status,
            "reason": self.reason,
            "run_id": self.run_id,
            "root": self.root,
            "command": list(self.command),
            "attempts": len(self.attempts),
            "restarts": max(0, len(self.attempts) - 1),
            "attempt_list": [asdict(a) for a in self.attempts],
            "failures": [asdict(a) for a in self.failures],
            "recoveries": [r.to_dict() for r in self.recoveries],
            "event_log": self.event_log,
            "error": self.error,
        }
