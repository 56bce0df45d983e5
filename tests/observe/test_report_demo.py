"""The report of a real demo run (a small GPT, five injected failures of every kind): rendered in headless
Chromium (Debian's `chromium` package; scripts/test installs it as root) and its figures re-derived from the
event log here."""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainguard.planning import optimal_interval_s
from trainguard.recovery.events import read_events

KINDS = {"kill_step", "kill_during_save", "hang", "corrupt_newest", "silent_corruption"}
CHROMIUM = shutil.which("chromium")

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # the shared demo run's goodput from two sources


@pytest.fixture(scope="module")
def demo(demo_run):
    assert demo_run["ok"], demo_run
    return demo_run


@pytest.fixture(scope="module")
def report_json(demo):
    root = Path(demo["out"]) / "faulted"
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(root), "--json"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=10000",
            *args,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed: run scripts/test as root (it installs it) or "
    "`apt-get install -y chromium`",
)
def test_the_demo_report_renders_in_headless_chromium_with_every_plot_and_every_failure(demo, tmp_path):
    report = Path(demo["report"])
    assert report.is_file() and report.parent == Path(demo["out"])
    r = _chromium(report.as_uri(), "--dump-dom")
    assert r.returncode == 0, r.stderr[-2000:]
    dom = r.stdout
    console = [line for line in r.stderr.splitlines() if ":CONSOLE" in line]
    assert console == [], console  # no script error, no failed resource
    assert 'data-plots-ok="yes"' in dom
    figures = re.findall(r'<figure class="plot" id="plot-(\w+)"([^>]*)>', dom)
    assert [f[0] for f in figures] == ["timeline", "save_times", "sizes", "recoveries", "goodput", "interval"]
    for pid, attrs in figures:
        size = re.search(r'data-rendered="(\d+)x(\d+)"', attrs)
        ink = re.search(r'data-ink="([0-9.]+)"', attrs)
        assert size and int(size[1]) >= 600 and int(size[2]) >= 300, (pid, attrs)
        assert ink and float(ink[1]) > 0.02, (pid, attrs)  # drawn pixels, as decoded by the browser
        assert 'data-has-data="yes"' in attrs, (pid, attrs)  # a real plot, not the "no data" placeholder
    table = re.search(r'<table id="failures">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert table
    rows = re.findall(r"<tr>(.*?)</tr>", table[1], re.S)
    cells = [
        (
            re.search(r'class="l kind">([^<]*)<', row)[1],
            re.search(r'class="injected">([^<]*)<', row)[1],
            int(re.search(r'class="steps-lost">([^<]*)<', row)[1]),
        )
        for row in rows
    ]
    # every injected failure, in order, with the steps lost that the supervisor measured during the run
    # (RunResult, not the report's own join); a loaded machine may add a failure of its own (e.g. a hang):
    # listed too, by its cause
    assert [(k, lost) for k, inj, lost in cells if inj == "yes"] == [
        (f["kind"], f["steps_lost"]) for f in demo["failures"]
    ]
    assert {k for k, inj, _ in cells if inj == "yes"} == KINDS
    assert all(k in ("exit", "signal", "hang") for k, inj, _ in cells if inj == "no")
    shot = tmp_path / "shot.png"
    r = _chromium(report.as_uri(), f"--screenshot={shot}", "--window-size=1100,4000")
    assert r.returncode == 0 and shot.stat().st_size > 10_000
    from PIL import Image

    px = np.asarray(Image.open(shot).convert("L"))
    assert (px < 200).mean() > 0.02  # the page is not blank


def _attempt_points(records, key):
    pts = []
    for r in records:
        if (r.get("run_id"), r.get("restart_count")) != key or r.get("rank") not in (0, None):
            continue
        if r["event"] in ("first_step", "progress"):
            pts.append((r["t"], r["step"]))
        elif r["event"] == "save":
            pts.append((r["t"] - r["persist_s"], r["step"]))
        elif r["event"] == "failure":
            pts.append((r["t_death"], r["last_step"]))
    pts.sort()
    return np.array([p[0] for p in pts]), np.maximum.accumulate(np.array([p[1] for p in pts], dtype=float))


def _time_of_step(ts, steps, step):
    """The earliest time the trajectory is at ``step``, else interpolated between the last point below it and
    the first point above it."""
    at = np.flatnonzero(steps == step)
    if at.size:
        return float(ts[at[0]])
    below, above = np.flatnonzero(steps < step), np.flatnonzero(steps > step)
    i, j = below[-1], above[0]
    return float(ts[i] + (ts[j] - ts[i]) * (step - steps[i]) / (steps[j] - steps[i]))


def test_report_json_equals_the_figures_derived_from_the_event_log_here(demo, report_json):
    root = Path(demo["out"]) / "faulted"
    ev = read_events(root)
    run_id = next(r["run_id"] for r in ev if r["event"] == "supervisor_start")
    # failures: the supervisor's cause, the kind the job logged before the fault fired, the recovery's TTR
    fails = [r for r in ev if r["event"] == "failure"]
    recs = {r["restart_count"]: r for r in ev if r["event"] == "recovery"}
    injected = {r["restart_count"]: r for r in ev if r["event"] == "fault_injected"}
    expect = [
        {
            "kind": injected[f["attempt"]]["kind"] if f["attempt"] in injected else f["cause"],
            "cause": f["cause"],
            "step": f["last_step"],
            "steps_lost": recs[f["attempt"] + 1]["steps_lost"],
            "ttr_s": recs[f["attempt"] + 1]["ttr_s"],
            "phases": recs[f["attempt"] + 1]["phases"],
        }
        for f in fails
    ]
    got = [
        {k: f[k] for k in ("kind", "cause", "step", "steps_lost", "ttr_s", "phases")}
        for f in report_json["failures"]
    ]
    assert got == expect
    # ...and the injected ones agree with the demo's own plan and its supervisor result
    planned = [f for f, r in zip(got, report_json["failures"], strict=True) if r["injected"]]
    assert [(f["kind"], f["step"], f["steps_lost"]) for f in planned] == [
        (f["kind"], f["step"], f["steps_lost"]) for f in demo["failures"]
    ]
    saves = [r for r in ev if r["event"] == "save"]
    assert [(s["step"], s["block_s"], s["persist_s"], s["bytes"]) for s in report_json["saves"]] == [
        (s["step"], s["block_s"], s["persist_s"], s["bytes"]) for s in saves
    ]
    ck = report_json["checkpoints"]
    deleted = {r["step"] for r in ev if r["event"] == "retention_delete"}
    assert (
        (ck["count"], ck["bytes"], ck["bytes_written"])
        == (
            len(saves),
            sum(s["bytes"] for s in saves),
            sum(s["bytes_written"] for s in saves),
        )
        == (demo["checkpoints"]["count"], demo["checkpoints"]["bytes"], demo["checkpoints"]["bytes_written"])
    )
    assert ck["retained"] == sorted({s["step"] for s in saves} - deleted)
    skipped = [r for r in ev if r["event"] == "restore_skipped"]
    suspect = {r["step"] for r in skipped if r["problem"].startswith("suspect")}
    assert ck["suspect_detected"] == sorted(suspect)
    assert ck["corrupt_detected"] == sorted({r["step"] for r in skipped} - suspect)
    # goodput: per attempt, the time its interpolated step trajectory spent on steps no later attempt redid,
    # less the stalls of the saves among them (never below zero: on a loaded machine the final save's wait can
    # outlast the span its persist start ends), over the run's wall time
    wall = max(r["t"] for r in ev) - min(r["t"] for r in ev)
    restored = {
        r["restart_count"]: r["step"] or 0
        for r in ev
        if r["event"] == "restore" and r.get("rank") in (0, None)
    }
    attempts = sorted(restored)
    productive, cutoff = 0.0, float("inf")
    for k in reversed(attempts):
        ts, steps = _attempt_points(ev, (run_id, k))
        start, end = restored[k], steps[-1]
        useful = min(end, cutoff)
        cutoff = min(cutoff, start)
        if useful <= start:
            continue
        per_step = (ts[-1] - ts[0]) / (steps[-1] - steps[0])
        t_begin = ts[0] - (steps[0] - start) * per_step
        t_end = _time_of_step(ts, steps, useful)
        stalls = sum(s["block_s"] for s in saves if s["restart_count"] == k and start < s["step"] <= useful)
        productive += max(0.0, t_end - t_begin - stalls)
    assert report_json["goodput"] == pytest.approx(productive / wall, rel=1e-9)
    assert 0 < report_json["goodput"] <= 1
    # the demo prints the report's goodput: one definition, one number
    assert report_json["goodput"] == demo["goodput"]
    # its train log (compute seconds of surviving steps) is a different source that tells the same story
    assert report_json["goodput"] == pytest.approx(demo["useful_train_s"] / demo["wall_s"], rel=0.3)
    # the interval: measured spacing of save starts within an attempt against Daly for the run's C, L, MTBF
    c = statistics.median(s["block_s"] for s in saves)
    lat = statistics.median(s["persist_s"] for s in saves)
    mtbf = wall / sum(1 for f in fails if f["cause"] != "preempted")
    spacing = []
    for k in attempts:
        starts = sorted(s["t"] - s["persist_s"] for s in saves if s["restart_count"] == k)
        spacing += list(np.diff(starts))
    iv = report_json["interval"]
    assert iv["checkpoint_s"] == c and iv["persist_s"] == lat and iv["mtbf_s"] == pytest.approx(mtbf)
    assert iv["measured_s"] == pytest.approx(statistics.median(spacing) - c)
    assert iv["optimal_s"] == pytest.approx(optimal_interval_s(c, mtbf, persist_s=lat))
