"""End to end: the demo with failures of every kind ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.demo import DemoConfig, fault_plan
from trainguard.recovery.events import read_events


def test_the_fault_plan_is_seeded_covers_every_kind_and_leaves_room_to_progress():
    cfg = DemoConfig(steps=200, failures=5, seed=3)
    plan = fault_plan(cfg)
    assert plan == fault_plan(DemoConfig(steps=200, failures=5, seed=3))
    assert plan != fault_plan(DemoConfig(steps=200, failures=5, seed=4))
    assert sorted(f["kind"] for f in plan) == [
        "corrupt_newest",
        "hang",
        "kill_during_save",
        "kill_step",
        "silent_corruption",
    ]
    steps = [f["step"] for f in plan]
    assert (
        all(b > a + cfg.save_every for a, b in zip(steps, steps[1:], strict=False)) and steps[-1] < cfg.steps
    )
    assert all(f["step"] % cfg.save_every == 0 for f in plan if f["kind"] == "kill_during_save")


@pytest.mark.slow
@pytest.mark.serial  # reads the shared demo run, which runs alone (tests/conftest.py)
def test_a_demo_with_five_kinds_of_failure_ends_identical_and_each_recovery_used_the_newest_valid(demo_run):
    s = demo_run  # tests/conftest.py: 60 steps saved every 5, five failures (the report tests read it too)
    out = Path(s["out"])
    assert s["supervisor_exit_code"] == 0, s
    assert s["identical"] is True and s["tensors_compared"] > 10, s["differences"]
    assert s["ok"] is True
    assert {f["kind"] for f in s["failures"]} == {
        "kill_step",
        "kill_during_save",
        "hang",
        "corrupt_newest",
        "silent_corruption",
    }
    for f in s["failures"]:
        assert f["recovered"] and f["resumed_from_newest_valid"], f
        assert f["ttr_s"] > 0 and f["phases"]["load_s"] is not None and f["steps_lost"] >= 0
        # one definition of the step a failure hit (the last heartbeat): the table's columns agree
        assert f["steps_lost"] == max(0, f["step"] - f["resumed_from"]) and f["step"] <= f["planned_step"], f
    causes = {f["kind"]: f["cause"] for f in s["failures"]}
    assert causes["hang"] == "hang" and causes["kill_step"] == "signal"
    corrupt = next(f for f in s["failures"] if f["kind"] == "corrupt_newest")
    # the corrupt newest checkpoint was skipped: resumed from an older one, and the event log names the chunk
    skipped = read_events(out / "faulted", event="restore_skipped")
    by_chunk = [e for e in skipped if e.get("chunk")]
    assert by_chunk and by_chunk[0]["chunk"].startswith("chunks/") and corrupt["corrupt_chunk_reported"]
    assert corrupt["resumed_from"] < by_chunk[0]["step"]
    # silent corruption passed every CRC32C; the probe caught it: suspect, resumed from an older checkpoint
    silent = next(f for f in s["failures"] if f["kind"] == "silent_corruption")
    suspect = [e for e in skipped if "suspect" in e["problem"] and "probe" in e["problem"]]
    assert suspect and silent["resumed_from"] < suspect[0]["step"]
    # the step the fault damaged (named in the job's log) is the one flagged, and the resume came from before it
    damaged = re.search(
        r"\[fault\] silently corrupted (\S+) in \S+ of step (\d+)", (out / "faulted.log").read_text()
    )
    assert damaged, "the silent-corruption fault did not run"
    step = int(damaged.group(2))
    assert step in {e["step"] for e in suspect}, (
        f"step {step} ({damaged.group(1)}) was restored without a flag"
    )
    assert silent["resumed_from"] < step and silent["recovered"], silent
    assert silent["phases"]["validation_s"] > 0
    assert 0 < s["goodput"] <= 1 and s["checkpoints"]["count"] >= 8


def test_demo_rejects_impossible_settings_with_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "demo", "--steps", "10"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "--steps" in r.stderr


@pytest.mark.slow
def test_demo_json_has_the_documented_keys(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "demo",
            "--steps",
            "40",
            "--failures",
            "1",
            "--save-every",
            "10",
            "--seed",
            "2",
            "--out",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    s = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr[-2000:]
    for key in ("identical", "steps", "final_loss", "checkpoints", "failures", "goodput"):
        assert key in s
    assert set(s["checkpoints"]) >= {"count", "bytes", "mean_block_s", "max_block_s"}
    assert set(s["failures"][0]) >= {"kind", "step", "steps_lost", "ttr_s", "phases"}
    assert s["identical"] is True and 0 < s["goodput"] <= 1
    # the demo writes the HTML report of its faulted run (`trainguard report`) and names it
    assert s["report"] == str(tmp_path.absolute() / "report.html")
    assert "<!DOCTYPE html>" in (tmp_path / "report.html").read_text()
