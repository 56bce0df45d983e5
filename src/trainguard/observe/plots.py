"""The plots of ``trainguard report``, drawn with matplotlib from :func:`.figures.compute_figures` output.

Each function takes the figures dict and returns ``(PNG bytes, has_data)``. Plots without data still render
a labelled placeholder (``has_data`` False), so a report of a run that is just starting has every plot. Uses ``matplotlib.figure.Figure``
directly (no pyplot, no global backend state), so it is safe in any thread and needs no display.
"""

from __future__ import annotations

import io
import math
from typing import Any

from ..recovery.ttr import PHASES

PHASE_LABELS = {
    "detection_s": "detection",
    "teardown_s": "teardown",
    "backoff_s": "backoff",
    "relaunch_s": "relaunch",
    "identification_s": "identification",
    "load_s": "load",
    "validation_s": "validation",
    "first_step_s": "first step",
}
"""Legend labels of the TTR phases."""

_WIDTH_IN, _HEIGHT_IN, _DPI = 9.0, 3.6, 100


def _figure(height_in: float = _HEIGHT_IN) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(_WIDTH_IN, height_in), dpi=_DPI, layout="constrained")


def _png(fig: Any) -> tuple[bytes, bool]:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, facecolor="white")
    return buf.getvalue(), not getattr(fig, "_trainguard_empty", False)


def _placeholder(ax: Any, text: str) -> None:
    ax.figure._trainguard_empty = True
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.35", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_color("0.8")


MANY = 40
"""Above this many saves (or recoveries) the plots switch from one labelled bar each to a numeric axis."""


def _time_unit(figs: dict[str, Any]) -> tuple[float, str]:
    """(divisor, unit) for wall-time axes: seconds, minutes or hours, by the run's length."""
    span = figs["run"]["t_end"] - figs["run"]["t_start"]
    if span > 2 * 3600:
        return 3600.0, "h"
    if span > 120:
        return 60.0, "min"
    return 1.0, "s"


def timeline(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Steps over wall time per attempt, with checkpoint commits, failures, restarts and recoveries marked."""
    fig = _figure(4.2)
    ax = fig.add_subplot()
    tl = figs["timeline"]
    if not any(a["points"] for a in tl["attempts"]):
        _placeholder(ax, "no training step recorded yet")
        return _png(fig)
    div, unit = _time_unit(figs)
    for i, a in enumerate(tl["attempts"]):
        pts = a["points"]
        label: str | None = f"attempt {a['attempt']}" if a["attempt"] is not None else f"process {i}"
        if len(tl["attempts"]) > 12:
            label = None if i else "attempts"
        ax.plot([p[0] / div for p in pts], [p[1] for p in pts], "-", lw=1.6, label=label)
    if tl["commits"]:
        ax.plot(
            [c[0] / div for c in tl["commits"]],
            [c[1] for c in tl["commits"]],
            "o",
            ms=4 if len(tl["commits"]) <= 200 else 1.5,
            mfc="none",
            color="tab:green",
            label="checkpoint committed",
        )
    fails = [f for f in tl["failures"] if f[1] is not None]
    if fails:
        ax.plot(
            [f[0] / div for f in fails], [f[1] for f in fails], "X", ms=10, color="tab:red", label="failure"
        )
    recs = tl.get("recoveries") or []
    if recs:
        ax.plot(
            [r[0] / div for r in recs],
            [r[1] for r in recs],
            "^",
            ms=8,
            color="tab:cyan",
            label="resumed (TTR end)",
        )
    for j, t in enumerate(tl["restarts"]):
        ax.axvline(t / div, color="0.5", ls="--", lw=0.8, label="restart" if j == 0 else None)
    ax.set_xlabel(f"wall time since the run started ({unit})")
    ax.set_ylabel("training step")
    ax.set_title("Timeline: steps, checkpoints, failures and restarts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", ncols=2)
    return _png(fig)


def save_times(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Blocking stall and persist time of each save (milliseconds) by step."""
    fig = _figure()
    ax = fig.add_subplot()
    saves = figs["saves"]
    if not saves:
        _placeholder(ax, "no checkpoint committed yet")
        return _png(fig)
    block = [1000 * (s["block_s"] or 0.0) for s in saves]
    persist = [1000 * (s["persist_s"] or 0.0) for s in saves]
    if len(saves) > MANY:
        steps = [s["step"] for s in saves]
        ax.plot(steps, block, ".", ms=3, label="blocking stall (training waits)", color="tab:orange")
        ax.plot(steps, persist, ".", ms=3, label="persist (background, to durable)", color="tab:blue")
    else:
        x = list(range(len(saves)))
        ax.bar(
            [i - 0.2 for i in x],
            block,
            width=0.4,
            label="blocking stall (training waits)",
            color="tab:orange",
        )
        ax.bar(
            [i + 0.2 for i in x],
            persist,
            width=0.4,
            label="persist (background, to durable)",
            color="tab:blue",
        )
        ax.set_xticks(x, [str(s["step"]) for s in saves], rotation=90 if len(saves) > 20 else 0, fontsize=8)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("milliseconds")
    if max(persist + block) > 50 * max(min(b for b in block if b > 0) if any(block) else 1.0, 1e-3):
        ax.set_yscale("log")
    ax.set_title("Per save: blocking stall and persist time")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _png(fig)


def sizes(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Checkpoint sizes per save (logical, stored, new bytes) and the retention of each checkpoint."""
    fig = _figure(5.4)
    ax, rx = fig.subplots(2, 1, height_ratios=[1.0, 1.0])
    saves = figs["saves"]
    if not saves:
        _placeholder(ax, "no checkpoint committed yet")
        _placeholder(rx, "no retention yet")
        return _png(fig)
    mib = 1 << 20
    steps = [s["step"] for s in saves]
    many = len(saves) > MANY
    x = steps if many else list(range(len(saves)))
    mark = "." if many else "o"
    ax.plot(x, [(s["bytes"] or 0) / mib for s in saves], mark + "-", label="logical (referenced)")
    ax.plot(x, [(s["stored_bytes"] or 0) / mib for s in saves], "--", label="stored")
    written = [(s["bytes_written"] or 0) / mib for s in saves]
    if many:
        ax.plot(x, written, ".", ms=3, alpha=0.8, label="new bytes written")
        ax.set_xlabel("checkpoint step")
    else:
        ax.bar(x, written, width=0.5, alpha=0.6, label="new bytes written")
        ax.set_xticks(x, [str(s) for s in steps], fontsize=8, rotation=90 if len(saves) > 20 else 0)
    ax.set_ylabel("MiB")
    ax.set_title("Checkpoint sizes per save")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    div, unit = _time_unit(figs)
    end = (figs["run"]["t_end"] - figs["run"]["t_start"]) / div
    retention = figs["checkpoints"]["retention"]
    height = 0.8
    ys: list[float] = []
    widths: list[float] = []
    lefts: list[float] = []
    colours: list[str] = []
    for i, r in enumerate(retention):  # one barh call: thousands of checkpoints stay fast
        lo = r["from_s"] / div
        to = r["to_s"] / div if r["to_s"] is not None else end
        ys.append(r["step"] if many else i)
        widths.append(max(to - lo, end * 0.002))
        lefts.append(lo)
        colours.append("tab:green" if r["to_s"] is None else "0.7")
    if many:  # one line per checkpoint: a LineCollection draws thousands fast, Rectangles do not
        rights = [a + w for a, w in zip(lefts, widths, strict=True)]
        rx.hlines(ys, lefts, rights, colors=colours, linewidth=2)
    else:
        rx.barh(ys, widths, left=lefts, height=height, color=colours)
    if not many:
        rx.set_yticks(range(len(retention)), [str(r["step"]) for r in retention], fontsize=7)
    rx.set_xlabel(f"wall time since the run started ({unit})")
    rx.set_ylabel("step")
    rx.set_title("Retention: each checkpoint from commit to deletion or replacement (green: still kept)")
    rx.grid(alpha=0.3, axis="x")
    return _png(fig)


def recoveries(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Each recovery's time-to-resume as stacked bars of its phases."""
    fig = _figure()
    ax = fig.add_subplot()
    rows = [f for f in figs["failures"] if f["ttr_s"] is not None]
    if not rows:
        _placeholder(ax, "no completed recovery")
        return _png(fig)
    if len(rows) > MANY:
        labels = [str(i + 1) for i in range(len(rows))]
    else:
        labels = [f"{i + 1}: {f['kind']}\nafter step {f['step']}" for i, f in enumerate(rows)]
    bottoms = [0.0] * len(rows)
    for phase in PHASES:
        vals = [f["phases"].get(phase) or 0.0 for f in rows]
        if not any(vals):
            continue
        ax.bar(labels, vals, bottom=bottoms, label=PHASE_LABELS[phase], width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    other = [max(0.0, f["ttr_s"] - b) for f, b in zip(rows, bottoms, strict=True)]
    if any(v > 0.005 for v in other):
        ax.bar(labels, other, bottom=bottoms, label="other (user code)", color="0.8", width=0.6)
    ax.set_ylabel("seconds")
    ax.set_title("Time to resume per recovery, by phase")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncols=3)
    return _png(fig)


def goodput(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Goodput (productive time over wall time) as the run went on."""
    fig = _figure()
    ax = fig.add_subplot()
    curve = figs["goodput_timeline"]
    if not curve:
        _placeholder(ax, "no training step recorded yet")
        return _png(fig)
    div, unit = _time_unit(figs)
    ax.plot([c[0] / div for c in curve], [100 * c[1] for c in curve], "-", color="tab:purple", lw=2)
    for f in figs["failures"]:
        ax.axvline(f["t_s"] / div, color="tab:red", ls=":", lw=1)
    ax.set_ylim(0, 105)
    ax.set_xlabel(f"wall time since the run started ({unit})")
    ax.set_ylabel("goodput (%)")
    total = figs["goodput"]
    ax.set_title(f"Goodput over time (final {100 * total:.1f} %; dotted: failures)" if total else "Goodput")
    ax.grid(alpha=0.3)
    return _png(fig)


def interval(figs: dict[str, Any]) -> tuple[bytes, bool]:
    """Expected waste against the checkpoint interval for the run's C, L and MTBF, with the measured interval
    and the Young/Daly optimum marked."""
    from ..planning import expected_waste_fraction

    fig = _figure()
    ax = fig.add_subplot()
    iv = figs["interval"]
    if iv.get("optimal_s") is None or iv.get("mtbf_s") is None:
        _placeholder(ax, "optimum unknown: " + str(iv.get("reason", "no data")))
        return _png(fig)
    c, m, lat = iv["checkpoint_s"], iv["mtbf_s"], iv["persist_s"]
    marks = [v for v in (iv["optimal_s"], iv.get("measured_s")) if v]
    lo, hi = max(min(marks) / 20, 1e-3), max(marks) * 20
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    ys = [
        100
        * expected_waste_fraction(x, c, m, restart_s=iv["restart_s"], detect_s=iv["detect_s"], persist_s=lat)
        for x in xs
    ]
    ax.plot(xs, ys, "-", color="0.3", label="expected waste (first order)")
    ax.axvline(iv["optimal_s"], color="tab:green", lw=2, label=f"Daly optimum {iv['optimal_s']:.3g} s")
    if iv.get("young_s"):
        ax.axvline(iv["young_s"], color="tab:olive", ls=":", label=f"Young {iv['young_s']:.3g} s")
    if iv.get("measured_s"):
        ax.axvline(
            iv["measured_s"], color="tab:orange", ls="--", lw=2, label=f"measured {iv['measured_s']:.3g} s"
        )
    ax.set_xscale("log")
    finite = [y for y in ys if math.isfinite(y)]
    ax.set_ylim(0, min(100, max(finite) * 1.05) if finite else 100)
    ax.set_xlabel("compute time between checkpoints (s)")
    ax.set_ylabel("expected waste (%)")
    ax.set_title(f"Checkpoint interval: C {c:.3g} s, L {lat or c:.3g} s, MTBF {m:.3g} s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _png(fig)


PLOTS = (
    ("timeline", "Timeline of the run", timeline),
    ("save_times", "Blocking stall and persist time per save", save_times),
    ("sizes", "Checkpoint sizes and retention", sizes),
    ("recoveries", "Time to resume per recovery", recoveries),
    ("goodput", "Goodput over time", goodput),
    ("interval", "Checkpoint interval against the Young/Daly optimum", interval),
)
"""(id, title, function) of every plot, in report order."""
