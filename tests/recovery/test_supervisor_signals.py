"""`trainguard run` stops on every catchable terminating signal like on SIGTERM (forwarded, no restart,
exit 128+N), and never leaves its job behind: not a child the job started in a new session, and not the job
itself when the supervisor is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.recovery.events import read_events
from trainguard.recovery.lifetime import TERMINATING_SIGNALS


def run_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}


JOB = """
import os, pathlib, subprocess, sys, time
d = pathlib.Path(sys.argv[1])
g = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.05)"], start_new_session=True)
def publish(name, value):  # whole or absent: the test polls for the name, then reads it
    (d / (name + ".tmp")).write_text(str(value))
    os.replace(d / (name + ".tmp"), d / name)
publish("grandchild", g.pid)
publish("job", os.getpid())
while True:
    time.sleep(0.05)
"""


def running(pid: int) -> bool:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3] not in (b"Z", b"X")


def wait_for(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def start(tmp_path: Path) -> tuple[subprocess.Popen, int, int]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    sup = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainguard",
            "run",
            "--root",
            str(tmp_path / "root"),
            "--grace-period",
            "5",
            "--poll-interval",
            "0.05",
            "--max-restarts",
            "3",
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
        ],
        env=run_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: (tmp_path / "job").exists() and (tmp_path / "grandchild").exists(), 60, "the job to start"
    )
    return sup, int((tmp_path / "job").read_text()), int((tmp_path / "grandchild").read_text())


def cleanup(*pids: int) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [s for s in TERMINATING_SIGNALS], ids=lambda s: s.name)
def test_every_terminating_signal_stops_the_run_and_everything_the_job_started(tmp_path, sig):
    sup, job, grandchild = start(tmp_path)
    try:
        sup.send_signal(sig)
        rc = sup.wait(timeout=60)
        assert rc == 128 + sig, sup.stderr.read() if sup.stderr else ""
        wait_for(lambda: not running(job), 10, "the job to end")
        wait_for(lambda: not running(grandchild), 10, "the job's child in a new session to end")
        events = read_events(tmp_path / "root")
        assert [e["signal"] for e in events if e["event"] == "stop"] == [sig.name]
        assert not [e for e in events if e["event"] == "restart"], "the supervisor restarted after a stop"
    finally:
        cleanup(job, grandchild)


@pytest.mark.timeout(120)
def test_the_job_dies_with_a_sigkilled_supervisor(tmp_path):
    sup, job, grandchild = start(tmp_path)
    try:
        sup.kill()
        sup.wait(timeout=30)
        wait_for(lambda: not running(job), 10, "the job to die with its supervisor")
    finally:
        cleanup(job, grandchild)


@pytest.mark.timeout(120)
def test_a_child_the_job_started_in_a_new_session_is_stopped_when_the_job_fails(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB.replace("while True:\n    time.sleep(0.05)", "sys.exit(3)"))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "run",
            "--root",
            str(tmp_path / "root"),
            "--grace-period",
            "5",
            "--backoff",
            "0.01",
            "--max-restarts",
            "0",
            "--",
            sys.executable,
            str(script),
            str(tmp_path),
        ],
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    grandchild = int((tmp_path / "grandchild").read_text())
    try:
        assert p.returncode == 3, p.stderr
        assert not running(grandchild)
        [ev] = [e for e in read_events(tmp_path / "root") if e["event"] == "leftovers_stopped"]
        assert grandchild in ev["pids"]
    finally:
        cleanup(grandchild)
