"""`trainguard run` from the command line: usage errors, help, JSON summary, table, signal forwarding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainguard.cli.main import main
from trainguard.recovery.events import read_events

FAST = ["--backoff", "0.01", "--max-backoff", "0.05", "--grace-period", "5", "--poll-interval", "0.05"]


def flaky_job(tmp_path: Path) -> list[str]:
    """A job that beats nothing, fails on its first attempt and succeeds on the second."""
    script = tmp_path / "flaky.py"
    script.write_text("import os, sys\nsys.exit(0 if os.environ['TRAINGUARD_RESTART_COUNT'] == '1' else 9)\n")
    return [sys.executable, str(script)]


def test_run_without_a_command_is_a_usage_error():
    result = CliRunner().invoke(main, ["run", "--max-restarts", "1"])
    assert result.exit_code == 2 and "no COMMAND" in result.output


@pytest.mark.parametrize(
    "option", [["--max-restarts", "-1"], ["--heartbeat-timeout", "0"], ["--backoff", "-2"]]
)
def test_run_with_a_bad_option_value_is_a_usage_error(option, tmp_path):
    result = CliRunner().invoke(main, ["run", *option, "--root", str(tmp_path), "--", "true"])
    assert result.exit_code == 2


def test_run_help_documents_every_exit_code():
    text = CliRunner().invoke(main, ["run", "--help"]).output
    documented = {line.split()[0] for line in text.split("Exit codes:")[1].splitlines() if line.strip()}
    assert documented == {"0", "2", "3", "4", "5", "75", "127", "128+N"}
    assert "--heartbeat-timeout" in text and "--no-progress-limit" in text


def test_run_json_prints_attempts_failures_recoveries_and_the_exit_code(tmp_path):
    args = ["run", *FAST, "--root", str(tmp_path / "root"), "--json", "--", *flaky_job(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["exit_code"], summary["attempts"], summary["restarts"]) == (0, 2, 1)
    assert [(f["outcome"], f["exit_code"]) for f in summary["failures"]] == [("exit", 9)]
    [rec] = summary["recoveries"]
    assert rec["restart_count"] == 1 and set(rec["phases"]) >= {"detection_s", "relaunch_s", "first_step_s"}


def test_run_prints_a_summary_table_and_stops_after_max_restarts(tmp_path):
    args = ["run", *FAST, "--max-restarts", "0", "--root", str(tmp_path / "root"), "--", *flaky_job(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3
    assert "attempts" in result.stdout and "gave_up (max_restarts)" in result.stdout


STOPPABLE_JOB = """
import os, signal, sys, time
def on_signal(signum, frame):
    open(os.path.join({dir!r}, "got-" + signal.Signals(signum).name), "w").close()
    sys.exit(75)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
with open(os.path.join({dir!r}, "started"), "a") as f:
    f.write(os.environ["TRAINGUARD_RESTART_COUNT"] + "\\n")
open(os.path.join({dir!r}, "ready"), "w").close()
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_supervisor_is_forwarded_to_the_job_and_nothing_restarts(tmp_path, sig):
    job = tmp_path / "job.py"
    job.write_text(STOPPABLE_JOB.format(dir=str(tmp_path)))
    supervisor = subprocess.Popen(
        [sys.executable, "-c", "from trainguard.cli.main import main; main()", "run", *FAST]
        + ["--root", str(tmp_path / "root"), "--", sys.executable, str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120  # Python starting twice (supervisor, job) on a loaded machine
        while not (tmp_path / "ready").exists():
            assert supervisor.poll() is None and time.monotonic() < deadline, supervisor.communicate()
            time.sleep(0.02)
        os.kill(supervisor.pid, sig)
        out, err = supervisor.communicate(timeout=120)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    assert supervisor.returncode == 128 + sig, err
    assert (tmp_path / f"got-{sig.name}").exists()
    assert (tmp_path / "started").read_text() == "0\n"
    assert [e["event"] for e in read_events(tmp_path / "root", event="job_start")] == ["job_start"]
    [stop] = read_events(tmp_path / "root", event="stop")
    assert stop["signal"] == sig.name and stop["job_exit_code"] == 75
    assert "stopped" in out


def test_run_of_a_missing_command_says_command_not_found_and_prints_no_empty_table(tmp_path):
    result = CliRunner().invoke(main, ["run", "--root", str(tmp_path / "root"), "--", "/nonexistent/cmd"])
    assert result.exit_code == 127
    assert "command not found: '/nonexistent/cmd'" in result.output
    assert "attempts" not in result.output.split("status:")[0]  # no empty attempts table before the status
    assert "event log: " + str(tmp_path / "root" / "events") in result.output


def test_run_without_a_double_dash_says_where_the_event_log_went_and_why(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINGUARD_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("import sys\n")
    result = CliRunner().invoke(main, ["run", sys.executable, str(script), "--root", str(tmp_path / "ckpt")])
    assert result.exit_code == 0, result.output
    assert "the --root after COMMAND goes to the job" in result.output
    log = tmp_path / "trainguard-run" / "events"
    assert f"event log {log}" in result.output and any(log.iterdir())
