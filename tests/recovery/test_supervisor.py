"""The supervisor against small fake jobs: restarts, hangs, limits, stops, events and the TTR join.

Each fake job is one Python script driven by a per-attempt plan (indexed by TRAINGUARD_RESTART_COUNT); it
needs no torch. Timeouts are short (heartbeat 1 s, backoff 0.01 s, grace 0.5 s) so the module runs fast.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import trainguard
from trainguard.errors import ConfigError
from trainguard.recovery.config import (
    EXIT_MAX_RESTARTS,
    EXIT_NO_PROGRESS,
    EXIT_SPAWN_FAILED,
    Backoff,
    SupervisorConfig,
)
from trainguard.recovery.events import read_events
from trainguard.recovery.supervisor import Supervisor
from trainguard.recovery.ttr import PHASES

# The fake job imports the recovery modules without running trainguard/__init__.py (which imports torch,
# ~2 s per attempt): a stub package with the real __path__ makes `trainguard.recovery.*` load as usual.
# test_heartbeat.py covers the public `trainguard.heartbeat` through the real package.
FAKE_JOB = r"""
import json, os, signal, subprocess, sys, time, types
_pkg = types.ModuleType("trainguard")
_pkg.__path__ = [PACKAGE_DIR]
sys.modules["trainguard"] = _pkg
from trainguard.recovery.events import EventLog
from trainguard.recovery.heartbeat import (
    exit_after_preemption_save, flush_heartbeat, heartbeat, install_preemption_handler, preemption_requested)

workdir, plans = sys.argv[1], json.loads(sys.argv[2])
k = int(os.environ["TRAINGUARD_RESTART_COUNT"])
plan = plans[min(k, len(plans) - 1)]
with open(os.path.join(workdir, "attempts.jsonl"), "a") as f:
    f.write(json.dumps({"k": k, "pid": os.getpid(), "pgid": os.getpgid(0),
                        "env": {n: v for n, v in os.environ.items() if n.startswith("TRAINGUARD_")}}) + "\n")
if plan.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if plan.get("preemption"):
    install_preemption_handler()
if plan.get("grandchild"):  # before the first beat: the hang clock starts at the last beat, so the
    # supervisor cannot kill the job before the pid is published; published whole (beside, then renamed)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(workdir, "grandchild.pid.tmp"), "w") as f:
        f.write(str(child.pid))
    os.replace(os.path.join(workdir, "grandchild.pid.tmp"), os.path.join(workdir, "grandchild.pid"))
log = None
start = plan.get("start", 1)
if plan.get("manager"):
    log = EventLog(os.environ["TRAINGUARD_ROOT"], "manager")
    log.set_context(rank=0)
    time.sleep(0.05)
    log.write("manager_start")
    time.sleep(0.04)  # at least scan_s + load_s + validate_s: restore runs after manager_start
    log.write("restore", step=start - 1 if start > 1 else None, scan_s=0.01, load_s=0.02, validate_s=0.005,
              bytes=1000)
for s in range(start, plan.get("end", 0) + 1):
    time.sleep(plan.get("step_s", 0.0))
    heartbeat(s)
    if log is not None and s == start:
        log.write("first_step", step=s)
flush_heartbeat()
action = plan.get("then", "exit:0")
if action == "hang":
    time.sleep(600)
elif action == "wait_for_stop":
    open(os.path.join(workdir, "ready"), "w").close()
    s = plan.get("end", 0)
    while not preemption_requested():
        s += 1
        heartbeat(s)
        time.sleep(0.01)
    open(os.path.join(workdir, "got_sigterm"), "w").close()
    exit_after_preemption_save()
elif action.startswith("signal:"):
    os.kill(os.getpid(), getattr(signal, action.split(":")[1]))
    time.sleep(5)
else:
    sys.exit(int(action.split(":")[1]))
"""


@pytest.fixture
def job(tmp_path: Path):
    """Return a function building the fake job's command line from a list of per-attempt plans."""
    script = tmp_path / "fake_job.py"
    script.write_text(FAKE_JOB.replace("PACKAGE_DIR", repr(str(Path(trainguard.__file__).parent))))

    def command(*plans: dict) -> list[str]:
        return [sys.executable, str(script), str(tmp_path), json.dumps(list(plans))]

    return command


def attempts_seen(tmp_path: Path) -> list[dict]:
    path = tmp_path / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fast(tmp_path: Path, **overrides) -> SupervisorConfig:
    settings = dict(
        root=tmp_path / "root",
        backoff=Backoff(initial_s=0.01, max_s=0.05, factor=2.0),
        grace_period_s=0.5,
        poll_interval_s=0.05,
        max_restarts=5,
    )
    settings.update(overrides)
    return SupervisorConfig(**settings)


def supervise(command: list[str], config: SupervisorConfig, messages: list[str] | None = None):
    sink = messages if messages is not None else []
    return Supervisor(command, config, echo=sink.append).run()


def test_a_job_that_exits_zero_runs_once_and_is_never_restarted(tmp_path, job):
    result = supervise(job({"end": 3, "then": "exit:0"}), fast(tmp_path))
    assert result.exit_code == 0 and result.status == "succeeded"
    assert len(attempts_seen(tmp_path)) == 1
    assert [a.outcome for a in result.attempts] == ["success"]
    names = [e["event"] for e in read_events(tmp_path / "root")]
    assert names.count("job_start") == 1 and "restart" not in names and names[-1] == "success"


def test_a_job_that_exits_nonzero_is_restarted_and_the_run_succeeds(tmp_path, job):
    result = supervise(
        job({"end": 3, "then": "exit:1"}, {"start": 4, "end": 6, "then": "exit:0"}), fast(tmp_path)
    )
    assert result.exit_code == 0
    assert [(a.outcome, a.exit_code, a.last_step) for a in result.attempts] == [
        ("exit", 1, 3),
        ("success", 0, 6),
    ]
    assert [a["k"] for a in attempts_seen(tmp_path)] == [0, 1]


def test_a_job_killed_by_sigkill_is_restarted_with_the_signal_recorded(tmp_path, job):
    # polling every 60 s: a death noticed by polling would be seen ~60 s after the spawn (the job dies within
    # seconds); the waiter thread sees it at once. No tight wall-clock bound (a loaded machine delays threads).
    config = fast(tmp_path, poll_interval_s=60.0)
    result = supervise(job({"end": 2, "then": "signal:SIGKILL"}, {"start": 3, "end": 4}), config)
    assert result.exit_code == 0
    failure = result.failures[0]
    assert (failure.outcome, failure.signal, failure.exit_code, failure.last_step) == (
        "signal",
        "SIGKILL",
        None,
        2,
    )
    assert failure.detect_s < 30  # a waiter thread reaps the job at once, not the next poll
    [event] = read_events(tmp_path / "root", event="failure")
    assert event["cause"] == "signal" and event["signal"] == "SIGKILL" and event["last_step"] == 2


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return True


def _dies(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` is dead within ``timeout_s``: a SIGKILLed process on a loaded machine exits when it is
    next scheduled, not at the instant the signal is sent (an unkilled one sleeps for 600 s)."""
    end = time.monotonic() + timeout_s
    while not _dead(pid):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_a_hung_job_is_killed_with_its_whole_process_group_and_restarted(tmp_path, job):
    hang = {"end": 3, "then": "hang", "ignore_term": True, "grandchild": True}
    config = fast(tmp_path, heartbeat_timeout_s=1.0, grace_period_s=0.3)
    result = supervise(job(hang, {"start": 4, "end": 5}), config)
    assert result.exit_code == 0
    failure = result.failures[0]
    assert failure.outcome == "hang" and failure.signal == "SIGKILL" and failure.last_step == 3
    assert failure.detect_s >= 1.0 and failure.teardown_s >= 0.25  # it waited the grace period, then SIGKILL
    assert _dies(int((tmp_path / "grandchild.pid").read_text()))
    [event] = read_events(tmp_path / "root", event="failure")
    assert event["cause"] == "hang" and event["t_death"] < event["t"] - 1.0


def test_startup_timeout_kills_a_job_that_never_beats(tmp_path, job):
    config = fast(tmp_path, startup_timeout_s=0.5, grace_period_s=0.2, max_restarts=0)
    result = supervise(job({"end": 0, "then": "hang"}), config)
    assert result.exit_code == EXIT_MAX_RESTARTS
    assert result.failures[0].outcome == "hang" and result.failures[0].signal == "SIGTERM"


def test_a_job_that_never_progresses_gives_up_with_the_no_progress_exit_code(tmp_path, job):
    config = fast(tmp_path, max_restarts=10, max_no_progress_restarts=2)
    result = supervise(job({"end": 5, "then": "exit:1"}), config)
    assert result.exit_code == EXIT_NO_PROGRESS == 4
    assert result.reason == "no_progress" and len(result.attempts) == 3
    [give_up] = read_events(tmp_path / "root", event="give_up")
    assert give_up["reason"] == "no_progress" and give_up["exit_code"] == 4


def test_a_job_that_always_fails_gives_up_after_max_restarts(tmp_path, job):
    plans = [{"start": 10 * k + 1, "end": 10 * k + 5, "then": "exit:7"} for k in range(5)]
    result = supervise(job(*plans), fast(tmp_path, max_restarts=2))
    assert result.exit_code == EXIT_MAX_RESTARTS == 3
    assert result.reason == "max_restarts"
    assert [a.exit_code for a in result.attempts] == [7, 7, 7]
    assert len(read_events(tmp_path / "root", event="restart")) == 2


def test_max_restarts_zero_never_restarts(tmp_path, job):
    result = supervise(job({"end": 1, "then": "exit:1"}, {"then": "exit:0"}), fast(tmp_path, max_restarts=0))
    assert result.exit_code == EXIT_MAX_RESTARTS
    assert len(attempts_seen(tmp_path)) == 1


def test_every_attempt_gets_the_restart_count_run_id_heartbeat_file_and_root(tmp_path, job):
    result = supervise(job({"end": 1, "then": "exit:1"}, {"end": 2, "then": "exit:0"}), fast(tmp_path))
    first, second = (a["env"] for a in attempts_seen(tmp_path))
    assert (first["TRAINGUARD_RESTART_COUNT"], second["TRAINGUARD_RESTART_COUNT"]) == ("0", "1")
    assert first["TRAINGUARD_RUN_ID"] == second["TRAINGUARD_RUN_ID"] == result.run_id
    assert first["TRAINGUARD_HEARTBEAT_FILE"] != second["TRAINGUARD_HEARTBEAT_FILE"]
    assert first["TRAINGUARD_ROOT"] == str((tmp_path / "root").absolute())


def test_the_job_runs_in_its_own_process_group(tmp_path, job):
    supervise(job({"then": "exit:0"}), fast(tmp_path))
    [seen] = attempts_seen(tmp_path)
    assert seen["pgid"] == seen["pid"] != os.getpgid(0)


def test_events_record_start_failure_restart_recovery_and_success(tmp_path, job):
    result = supervise(job({"end": 2, "then": "exit:3"}, {"start": 3, "end": 3}), fast(tmp_path))
    events = read_events(tmp_path / "root")
    names = [e["event"] for e in events if e["source"] == "supervisor"]
    assert names == [
        "supervisor_start",
        "job_start",
        "failure",
        "restart",
        "job_start",
        "recovery",
        "success",
    ]
    assert all(e["run_id"] == result.run_id for e in events)
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["cause"] == "exit" and failure["exit_code"] == 3 and failure["restart_count"] == 0
    restart = next(e for e in events if e["event"] == "restart")
    assert restart["restart_count"] == 1 and restart["backoff_s"] == pytest.approx(0.01)


def test_a_command_that_cannot_start_exits_127(tmp_path):
    result = supervise([str(tmp_path / "no-such-program")], fast(tmp_path))
    assert result.exit_code == EXIT_SPAWN_FAILED == 127 and result.attempts == ()
    assert read_events(tmp_path / "root", event="give_up")[0]["reason"] == "spawn_failed"


def test_a_job_that_saved_on_preemption_is_restarted_when_the_supervisor_was_not_stopped(tmp_path, job):
    command = job({"end": 2, "then": "wait_for_stop", "preemption": True}, {"start": 3, "end": 4})
    config = fast(tmp_path)

    def preempt_the_job_only() -> None:
        while not (tmp_path / "ready").exists():
            time.sleep(0.01)
        os.kill(attempts_seen(tmp_path)[0]["pid"], signal.SIGTERM)

    threading.Thread(target=preempt_the_job_only, daemon=True).start()
    result = supervise(command, config)
    assert (tmp_path / "got_sigterm").exists()
    assert result.exit_code == 0
    assert (result.failures[0].outcome, result.failures[0].exit_code) == ("preempted", 75)


def test_a_stop_request_is_forwarded_to_the_job_and_nothing_is_restarted(tmp_path, job):
    command = job({"end": 1, "then": "wait_for_stop", "preemption": True})
    supervisor = Supervisor(command, fast(tmp_path, grace_period_s=10.0), echo=lambda msg: None)

    def stop_when_ready() -> None:
        while not (tmp_path / "ready").exists():
            time.sleep(0.01)
        supervisor.request_stop(signal.SIGTERM)

    threading.Thread(target=stop_when_ready, daemon=True).start()
    result = supervisor.run()
    assert (tmp_path / "got_sigterm").exists()
    assert result.exit_code == 128 + signal.SIGTERM and result.status == "stopped"
    assert [(a.outcome, a.exit_code) for a in result.attempts] == [("stopped", 75)]
    assert len(attempts_seen(tmp_path)) == 1
    [stop] = read_events(tmp_path / "root", event="stop")
    assert stop["signal"] == "SIGTERM" and stop["job_exit_code"] == 75


def test_recovery_phases_join_manager_events_and_ttr_covers_them(tmp_path, job):
    plans = ({"end": 6, "then": "exit:1", "manager": True}, {"start": 5, "end": 8, "manager": True})
    messages: list[str] = []
    result = supervise(job(*plans), fast(tmp_path), messages)
    assert result.exit_code == 0
    [rec] = result.recoveries
    assert rec.complete and rec.first_step_source == "manager"
    assert (rec.last_step, rec.restored_step, rec.steps_lost) == (6, 4, 2)
    assert all(rec.phases[p] is not None and rec.phases[p] >= 0 for p in PHASES)
    assert (rec.phases["identification_s"], rec.phases["load_s"], rec.phases["validation_s"]) == (
        0.01,
        0.02,
        0.005,
    )
    assert rec.phases["relaunch_s"] >= 0.05  # the fake manager starts 50 ms after the spawn
    assert rec.ttr_s >= sum(rec.phases.values())
    [event] = read_events(tmp_path / "root", event="recovery")
    assert event["restart_count"] == 1 and event["steps_lost"] == 2 and event["phases"] == rec.phases
    assert any(m.startswith("[trainguard] recovery 1: ttr ") for m in messages)


def test_a_job_without_manager_events_gets_supervisor_phases_and_a_heartbeat_ttr(tmp_path, job):
    result = supervise(job({"end": 3, "then": "exit:1"}, {"start": 4, "end": 5}), fast(tmp_path))
    [rec] = result.recoveries
    assert rec.first_step_source == "heartbeat" and rec.ttr_s is not None
    assert rec.restored_step is None and rec.steps_lost is None and rec.last_step == 3
    for name in ("detection_s", "teardown_s", "backoff_s"):
        assert rec.phases[name] is not None and rec.phases[name] >= 0
    for name in ("relaunch_s", "identification_s", "load_s", "validation_s", "first_step_s"):
        assert rec.phases[name] is None
    assert rec.ttr_s >= rec.phases["detection_s"] + rec.phases["teardown_s"] + rec.phases["backoff_s"]


def test_backoff_doubles_while_restarts_make_no_progress_and_is_capped():
    backoff = Backoff(initial_s=0.5, max_s=3.0, factor=2.0)
    assert [backoff.delay_s(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert Backoff(initial_s=1.0, max_s=1.0).delay_s(10_000) == 1.0


@pytest.mark.parametrize(
    "settings",
    [
        {"max_restarts": -1},
        {"max_no_progress_restarts": -1},
        {"heartbeat_timeout_s": 0},
        {"startup_timeout_s": -5.0},
        {"grace_period_s": -1.0},
        {"poll_interval_s": 0},
        {"heartbeat_timeout_s": 0.05, "poll_interval_s": 0.1},
    ],
)
def test_the_config_rejects_bad_values_with_a_config_error(settings):
    with pytest.raises(ConfigError):
        SupervisorConfig(**settings)


@pytest.mark.parametrize("settings", [{"initial_s": -1.0}, {"initial_s": 2.0, "max_s": 1.0}, {"factor": 0.5}])
def test_backoff_rejects_bad_values_with_a_config_error(settings):
    with pytest.raises(ConfigError):
        Backoff(**settings)


def test_an_empty_command_is_a_config_error():
    with pytest.raises(ConfigError, match="no command"):
        Supervisor([])


def _stop_when_ready(tmp_path: Path, supervisor: Supervisor, times: int) -> None:
    def stop() -> None:
        while not (tmp_path / "grandchild.pid").exists():
            time.sleep(0.01)
        for _ in range(times):
            supervisor.request_stop(signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()


def test_a_job_that_ignores_the_forwarded_sigterm_is_killed_after_the_grace_period(tmp_path, job):
    command = job({"end": 1, "then": "hang", "ignore_term": True, "grandchild": True})
    supervisor = Supervisor(command, fast(tmp_path, grace_period_s=0.3), echo=lambda msg: None)
    _stop_when_ready(tmp_path, supervisor, times=1)
    result = supervisor.run()
    assert result.exit_code == 128 + signal.SIGTERM
    assert [(a.outcome, a.signal) for a in result.attempts] == [("stopped", "SIGKILL")]
    assert _dies(int((tmp_path / "grandchild.pid").read_text()))


def test_a_second_stop_request_kills_the_job_at_once(tmp_path, job):
    command = job({"end": 1, "then": "hang", "ignore_term": True, "grandchild": True})
    supervisor = Supervisor(command, fast(tmp_path, grace_period_s=600.0), echo=lambda msg: None)
    _stop_when_ready(tmp_path, supervisor, times=2)
    t0 = time.monotonic()
    result = supervisor.run()
    assert time.monotonic() - t0 < 300  # not the 600 s grace period (a loose bound: a loaded machine is slow)
    assert result.exit_code == 128 + signal.SIGTERM
    assert [(a.outcome, a.signal) for a in result.attempts] == [("stopped", "SIGKILL")]


REAL_TRAINER = """
import os, sys, torch
import trainguard as tg

root, crash_at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(10), async_save=False)
state = {"model": model, "optim": optim}
start = mgr.restore_latest(state)
for step in range((start or 0) + 1, 41):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    optim.zero_grad(); loss.backward(); optim.step()
    mgr.maybe_save(step, state, metrics={"loss": loss.item()})
    if os.environ["TRAINGUARD_RESTART_COUNT"] == "0" and step == crash_at:
        os.kill(os.getpid(), 9)
mgr.close()
"""


@pytest.mark.slow
def test_a_real_manager_job_killed_mid_run_resumes_and_reports_every_phase(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(REAL_TRAINER)
    root = tmp_path / "ckpts"
    config = fast(tmp_path, root=root, max_restarts=1)
    result = supervise([sys.executable, str(script), str(root), "25"], config)
    assert result.exit_code == 0
    assert (result.failures[0].signal, result.failures[0].last_step) == ("SIGKILL", 25)
    [rec] = result.recoveries
    assert (rec.restored_step, rec.steps_lost, rec.first_step_source) == (20, 5, "manager")
    assert all(rec.phases[p] is not None and rec.phases[p] >= 0 for p in PHASES)
    assert rec.ttr_s >= sum(rec.phases.values())


def test_a_job_that_dies_before_its_first_heartbeat_gives_up_after_the_no_progress_limit(tmp_path):
    from trainguard.recovery.config import EXIT_NO_PROGRESS, Backoff, SupervisorConfig
    from trainguard.recovery.supervisor import Supervisor

    cfg = SupervisorConfig(
        max_restarts=10,
        max_no_progress_restarts=2,
        root=tmp_path,
        backoff=Backoff(initial_s=0.01, max_s=0.02, factor=2.0),
    )
    result = Supervisor([sys.executable, "-c", "raise SystemExit(1)"], cfg, echo=lambda m: None).run()
    assert result.exit_code == EXIT_NO_PROGRESS and result.reason == "no_progress"
    assert len(result.attempts) == 3, "the first attempt and two restarts, not ten"


@pytest.mark.parametrize("program", ["no-such-program-xyz", "/nonexistent/cmd"])
def test_a_command_that_is_not_found_is_named_as_not_found_in_the_message_result_and_event(tmp_path, program):
    messages: list[str] = []
    result = supervise([program], fast(tmp_path), messages)
    assert result.exit_code == 127 and result.error is not None
    assert result.error.startswith("command not found") and repr(program) in result.error
    assert any("command not found" in m for m in messages)
    assert read_events(tmp_path / "root", event="spawn_error")[0]["error"] == result.error
    assert result.to_dict()["error"] == result.error


def test_a_file_that_is_not_executable_is_named_as_such(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = supervise([str(script)], fast(tmp_path))
    assert result.exit_code == 127 and "not executable" in (result.error or "")


def test_the_supervisor_says_where_its_event_log_is(tmp_path, job, monkeypatch):
    monkeypatch.delenv("TRAINGUARD_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    messages: list[str] = []
    result = supervise(job({"end": 1}), fast(tmp_path, root=None), messages)
    assert result.event_log is not None and Path(result.event_log).is_file()
    assert Path(result.event_log).parent == tmp_path / "trainguard-run" / "events"
    first = messages[0]
    assert result.event_log in first and "no --root given" in first


def test_the_step_a_failure_hit_is_the_last_heartbeat_in_the_message_event_and_recovery(tmp_path, job):
    messages: list[str] = []
    result = supervise(
        job({"end": 91, "then": "signal:SIGKILL"}, {"start": 92, "end": 93}), fast(tmp_path), messages
    )
    assert result.exit_code == 0
    assert any("failed (killed by SIGKILL), after step 91" in m for m in messages), messages
    assert read_events(tmp_path / "root", event="failure")[0]["last_step"] == 91
    assert result.failures[0].last_step == 91 and result.recoveries[0].last_step == 91
