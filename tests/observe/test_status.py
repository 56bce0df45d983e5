"""`trainguard status`: the current step from the heartbeat, the newest valid checkpoint and its age, saves in
flight, restarts so far; `--json` once, `--watch` refreshing until Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

import trainguard as tg
from trainguard.observe.status import run_status

from ..conftest import run_env
from .eventlog import one_failure_run, sup, write_log


def _beat(path, step: int) -> None:
    env = run_env() | {"TRAINGUARD_HEARTBEAT_FILE": str(path)}
    code = f"from trainguard.recovery.heartbeat import heartbeat, flush_heartbeat; heartbeat({step}); flush_heartbeat()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def _root_with_checkpoints(tmp_path):
    root = tmp_path / "root"
    mgr = tg.CheckpointManager(root, async_save=False)
    state = {"w": torch.zeros(100)}
    for step in (10, 20):
        state["w"] += 1
        mgr.save(step, state)
    mgr.close()
    return root


def test_status_of_a_running_supervised_job_reads_its_heartbeat_and_the_root(tmp_path):
    root = _root_with_checkpoints(tmp_path)
    hb = tmp_path / "heartbeat-1"
    _beat(hb, 57)
    recs = [r for r in one_failure_run() if r["event"] not in ("success", "save", "retention_delete")]
    for r in recs:
        if r["event"] == "job_start":
            r["heartbeat_file"] = str(hb)
    write_log(root, recs)
    (root / "step-000000030.partial-r0abcd").mkdir()  # a save being written
    now = time.time()
    s = run_status(root, now=now)
    assert (s["status"], s["attempt"], s["restarts"], s["failures"]) == ("running", 1, 1, 1)
    assert (s["step"], s["step_source"]) == (57, "heartbeat") and 0 <= s["step_age_s"] < 60
    assert s["newest_valid"]["step"] == 20 and 0 <= s["newest_valid"]["age_s"] < 60
    assert s["saves_in_flight"] == [30] and s["checkpoints"] == {"valid": 2, "incomplete": 1}
    assert s["last_failure"] == {"cause": "signal", "step": 25, "t": 125.1}
    assert s["last_recovery"] == {"ttr_s": 3.5, "steps_lost": 5}


def test_status_without_a_heartbeat_falls_back_to_the_newest_step_in_the_event_log(tmp_path):
    root = _root_with_checkpoints(tmp_path)  # an unsupervised run: manager events only
    s = run_status(root)
    assert (s["status"], s["step"], s["step_source"], s["run_id"]) == ("unsupervised", 20, "events", None)
    assert s["saves_in_flight"] == [] and s["restarts"] == 0


def test_status_of_a_finished_run_says_so(tmp_path):
    write_log(tmp_path, one_failure_run())
    s = run_status(tmp_path)
    assert s["status"] == "succeeded" and s["step"] == 30 and s["newest_valid"] is None


def test_status_json_prints_one_object_and_a_missing_root_is_a_usage_error(tmp_path):
    root = _root_with_checkpoints(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "status", str(root), "--json"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["newest_valid"]["step"] == 20 and s["step"] == 20
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "status", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_status_watch_refreshes_as_the_run_moves_and_stops_cleanly_on_ctrl_c(tmp_path):
    root = _root_with_checkpoints(tmp_path)
    hb = tmp_path / "hb"
    _beat(hb, 5)
    write_log(
        root,
        [
            sup(time.time(), "supervisor_start"),
            sup(time.time(), "job_start", restart_count=0, heartbeat_file=str(hb)),
        ],
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainguard", "status", str(root), "--watch", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=run_env() | {"COLUMNS": "120"},
    )
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def shown(text: str, timeout_s: float = 60.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and text not in "".join(out):
            time.sleep(0.1)
        return text in "".join(out)

    try:
        assert shown("5 (heartbeat") and shown("step 20")
        _beat(hb, 99)  # the job moved on: a later refresh shows it
        assert shown("99 (heartbeat")
    finally:
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
        reader.join(10)
    assert proc.returncode == 0, proc.stderr.read()


def test_an_odd_heartbeat_file_named_in_the_log_is_ignored_not_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for odd in ("/dev/zero", str(fifo)):
        write_log(
            tmp_path,
            [sup(time.time(), "supervisor_start"), sup(time.time(), "job_start", heartbeat_file=odd)],
        )
        # a read of the FIFO would block for ever and one of /dev/zero never end: bounded by a join, not by a
        # wall-clock figure a loaded machine can exceed
        got: list[dict] = []
        reader = threading.Thread(
            target=lambda out: out.append(run_status(tmp_path)), args=(got,), daemon=True
        )
        reader.start()
        reader.join(120)
        assert not reader.is_alive(), f"run_status read {odd}"
        [s] = got
        assert s["step"] is None and s["status"] == "running"
