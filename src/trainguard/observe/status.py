"""``trainguard status``: where a run stands now.

Read-only and cheap (safe to poll every second on a live run): the event log, the current attempt's heartbeat
file (its path is in the supervisor's newest ``job_start`` event) and one listing of the run root (manifests
are read, chunk data is not).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

from ..catalog import scan, step_dirs
from ..eventlog import read_events
from ..recovery.heartbeat import MAX_SLOTS, RECORD_SIZE_BYTES, Heartbeat, read_heartbeats

STATUSES = ("valid", "unverified", "suspect", "corrupt", "incomplete")  # the catalog's statuses, ls's order
_STEP_EVENTS = ("first_step", "progress", "save")


def run_status(root: str | os.PathLike[str], *, now: float | None = None) -> dict[str, Any]:
    """A snapshot of the run under ``root``.

    Args:
        root: the run root.
        now: wall time of the snapshot (seconds since the epoch; default: now).

    Returns:
        A JSON-ready dict: ``root``, ``t``, ``status`` (``running``, ``succeeded``, ``gave_up``, ``stopped``,
        ``unsupervised`` or ``no_events``), ``run_id``, ``attempt`` (the current restart count),
        ``restarts`` (so far, this run), ``failures`` (this run), ``step`` (the newest heartbeat step, else
        the newest step in the event log, a failure's last heartbeat included), ``step_source`` (``heartbeat`` or ``events``), ``step_age_s``,
        ``newest_valid`` (``{step, bytes, time, age_s}`` or None), ``checkpoints`` (counts by status),
        ``saves_in_flight`` (steps with a save directory not yet committed), ``last_failure`` (cause,
        step, time) and ``last_recovery`` (``ttr_s``, ``steps_lost``, ``restored_step``: None when the
        relaunch found no checkpoint and started over, ``steps_lost`` then None).
    """
    now = time.time() if now is None else now
    records = read_events(root)
    run_ids = [r["run_id"] for r in records if r.get("event") == "supervisor_start" and r.get("run_id")]
    run_id = run_ids[-1] if run_ids else None
    mine = [r for r in records if run_id is None or r.get("run_id") == run_id]
    status = "no_events" if not records else ("unsupervised" if run_id is None else "running")
    for r in mine:
        if r.get("event") in ("success", "give_up", "stop"):
            status = {"success": "succeeded", "give_up": "gave_up", "stop": "stopped"}[r["event"]]
    starts = [r for r in mine if r.get("event") == "job_start"]
    step, step_t, source = None, None, None
    if starts and status == "running":
        beats = _heartbeats(starts[-1].get("heartbeat_file"))
        if beats:
            newest = max(beats, key=lambda b: b.t)
            step, step_t, source = max(b.step for b in beats), newest.t, "heartbeat"
    if step is None:
        # the newest step the event log names: a progress/save event, or a failure's last heartbeat
        stepped = [
            (r["step"] if r.get("event") in _STEP_EVENTS else r["last_step"], float(r["t"]))
            for r in mine
            if (r.get("event") in _STEP_EVENTS and isinstance(r.get("step"), int))
            or (r.get("event") == "failure" and isinstance(r.get("last_step"), int))
        ]
        if stepped:
            step, step_t = stepped[-1]
            source = "events"
    infos = scan(root) if Path(root).is_dir() else []
    counts: dict[str, int] = {}  # in the catalog's order of statuses, as `trainguard ls` labels them
    for status_name in STATUSES:
        n = sum(1 for i in infos if i.status == status_name)
        if n:
            counts[status_name] = n
    valid = [i for i in infos if i.usable]  # what restore_latest would use
    newest_valid = None
    if valid:
        v = valid[-1]
        newest_valid = {
            "step": v.step,
            "status": v.status,  # "valid" or "unverified" (restorable: restore checks every byte it reads)
            "bytes": v.bytes,
            "time": v.time,
            "age_s": None if v.t is None else max(0.0, now - v.t),
        }
    steps, partials = step_dirs(root)
    failures = [r for r in mine if r.get("event") == "failure"]
    recoveries = [r for r in mine if r.get("event") == "recovery"]
    last_fail = failures[-1] if failures else None
    last_rec = recoveries[-1] if recoveries else None
    return {
        "root": str(root),
        "t": now,
        "status": status,
        "run_id": run_id,
        "attempt": starts[-1].get("restart_count") if starts else None,
        "restarts": sum(1 for r in mine if r.get("event") == "restart"),
        "failures": len(failures),
        "step": step,
        "step_source": source,
        "step_age_s": None if step_t is None else max(0.0, now - step_t),
        "newest_valid": newest_valid,
        "checkpoints": counts,
        "saves_in_flight": sorted(s for s in partials if s not in steps),
        "last_failure": None
        if last_fail is None
        else {"cause": last_fail.get("cause"), "step": last_fail.get("last_step"), "t": last_fail.get("t")},
        "last_recovery": None
        if last_rec is None
        else {
            "ttr_s": last_rec.get("ttr_s"),
            "steps_lost": last_rec.get("steps_lost"),
            "restored_step": last_rec.get("restored_step"),
        },
    }


def _heartbeats(path: object) -> list[Heartbeat]:
    """The beats of a heartbeat file named by the event log, read only when it is a regular file of at most
    MAX_SLOTS slots (a FIFO, a device or a huge file there is ignored rather than blocking or filling memory)."""
    if not isinstance(path, str) or not path:
        return []
    try:
        st = os.stat(path)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SLOTS * RECORD_SIZE_BYTES:
        return []
    return read_heartbeats(path)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def render_status(s: dict[str, Any]) -> Any:
    """A rich renderable (a table) of :func:`run_status` output."""
    from rich import box
    from rich.table import Table

    from .._text import markup

    t = Table(
        title=f"trainguard status: {markup(s['root'])}",
        box=box.SIMPLE_HEAD,
        show_header=False,
        title_justify="left",
    )
    t.add_column("what", style="bold")
    t.add_column("value")
    colour = {"running": "green", "succeeded": "green", "gave_up": "red", "stopped": "yellow"}.get(
        s["status"], ""
    )
    t.add_row("status", f"[{colour}]{markup(s['status'])}[/]" if colour else markup(s["status"]))
    if s["run_id"]:
        t.add_row(
            "run", f"{markup(s['run_id'])} (attempt {s['attempt'] if s['attempt'] is not None else '-'})"
        )
    step = "-" if s["step"] is None else f"{s['step']} ({s['step_source']}, {_age(s['step_age_s'])})"
    t.add_row("current step", step)
    nv = s["newest_valid"]
    if nv is None:
        newest = "none"
    else:  # the status as `trainguard ls` shows it: an unverified checkpoint is restorable, not "valid"
        shown = "" if nv.get("status", "valid") == "valid" else f" ({nv['status']})"
        newest = f"step {nv['step']}{shown}, {_age(nv['age_s'])}"
    t.add_row("newest restorable checkpoint", newest)
    counts = ", ".join(f"{n} {k}" for k, n in s["checkpoints"].items()) or "none"
    t.add_row("checkpoints", counts)
    t.add_row("saves in flight", ", ".join(map(str, s["saves_in_flight"])) or "none")
    t.add_row("restarts so far", str(s["restarts"]))
    t.add_row("failures", str(s["failures"]))
    if s["last_failure"]:
        lf = s["last_failure"]
        t.add_row(
            "last failure", f"{markup(lf['cause'])} at step {lf['step'] if lf['step'] is not None else '-'}"
        )
    if s["last_recovery"] and s["last_recovery"]["ttr_s"] is not None:
        lr = s["last_recovery"]
        lost = (
            f"{lr['steps_lost']} steps lost"
            if lr["steps_lost"] is not None
            else "started over: no checkpoint was restored"
            if lr.get("restored_step") is None
            else "steps lost unknown"
        )
        t.add_row("last recovery", f"TTR {lr['ttr_s']:.2f} s, {lost}")
    return t
