"""The heartbeat channel (job side and supervisor side) and the preemption flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

import trainguard
from trainguard.errors import ConfigError
from trainguard.recovery import heartbeat as hb
from trainguard.recovery.heartbeat import (
    EXIT_PREEMPTED,
    HEARTBEAT_FILE_ENV,
    RECORD_SIZE_BYTES,
    flush_heartbeat,
    heartbeat,
    install_preemption_handler,
    preemption_requested,
    read_heartbeat,
    read_heartbeats,
    uninstall_preemption_handler,
)

# Runs a snippet with trainguard.recovery importable but without trainguard/__init__.py (which imports torch).
PRELUDE = f"""
import sys, types
_pkg = types.ModuleType("trainguard")
_pkg.__path__ = [{str(Path(trainguard.__file__).parent)!r}]
sys.modules["trainguard"] = _pkg
from trainguard.recovery.heartbeat import *
from trainguard.recovery.heartbeat import exit_after_preemption_save, flush_heartbeat
"""


NO_MMAP = "import mmap\ndef _no_mmap(*a, **k):\n    raise OSError('no mmap')\nmmap.mmap = _no_mmap  # the pwrite path\n"


def run_snippet(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,  # a bound against a hang only (Python starts slowly on a loaded 2-core machine)
    )


@pytest.fixture
def channel(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "heartbeat"
    monkeypatch.setenv(HEARTBEAT_FILE_ENV, str(path))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return path


def test_heartbeat_is_a_no_op_without_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(HEARTBEAT_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    heartbeat(1)
    assert list(tmp_path.iterdir()) == []


def test_a_heartbeat_records_the_step_the_wall_time_and_the_pid(channel):
    before = time.time()
    heartbeat(5)
    [beat] = read_heartbeats(channel)
    assert (beat.step, beat.pid, beat.slot, beat.first_step) == (5, os.getpid(), 0, 5)
    assert before <= beat.t <= time.time() and beat.first_t == beat.t
    assert read_heartbeat(channel) == (5, beat.t)
    assert channel.stat().st_size == RECORD_SIZE_BYTES


def test_a_new_step_is_recorded_at_once_and_same_step_beats_are_rate_limited(channel):
    for step in range(1, 1001):
        heartbeat(step)
        assert read_heartbeat(channel)[0] == step
    t_written = read_heartbeat(channel)[1]
    heartbeat(1000)
    assert read_heartbeat(channel)[1] == t_written  # the same step again within 0.1 s: held back
    flush_heartbeat()
    assert read_heartbeat(channel)[1] > t_written


def test_without_mmap_writes_are_rate_limited_and_the_held_back_step_is_flushed(channel, monkeypatch):
    def no_mmap(*args, **kwargs):
        raise OSError("mmap not supported here")

    monkeypatch.setattr(hb.mmap, "mmap", no_mmap)
    heartbeat(1)
    for step in range(2, 1002):
        heartbeat(step)
    assert read_heartbeat(channel)[0] == 1  # within 0.1 s of the first write: held back
    flush_heartbeat()
    assert read_heartbeat(channel)[0] == 1001
    time.sleep(hb.MIN_WRITE_INTERVAL_S + 0.02)
    heartbeat(1002)
    assert read_heartbeat(channel)[0] == 1002  # the first call after the interval writes at once


def test_a_heartbeat_is_cheap_when_the_channel_is_set(channel, monkeypatch):
    """A beat is a memory store into the mapped slot, not a system call: 100,000 beats cost at most the one
    pwrite that creates the slot (a wall-clock bound here flaked on loaded 2-core machines; counting the
    writes checks the same thing without timing)."""
    import trainguard.recovery.heartbeat as hb_module

    writes = []
    real_pwrite = os.pwrite

    def counting_pwrite(fd: int, data: bytes, offset: int) -> int:
        writes.append(offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(hb_module.os, "pwrite", counting_pwrite)
    for step in range(100_000):
        heartbeat(step)
    flush_heartbeat()
    assert len(writes) <= 2, f"{len(writes)} pwrite calls for 100,000 beats: a write per beat"
    assert read_heartbeat(channel)[0] == 99_999


def test_a_heartbeat_never_raises_when_the_file_cannot_be_written(tmp_path, monkeypatch):
    monkeypatch.setenv(HEARTBEAT_FILE_ENV, str(tmp_path / "missing-dir" / "heartbeat"))
    for step in range(3):
        heartbeat(step)
    flush_heartbeat()
    assert not (tmp_path / "missing-dir").exists()


def test_the_public_trainguard_heartbeat_writes_the_channel(channel):
    trainguard.heartbeat(42)
    flush_heartbeat()
    assert read_heartbeat(channel)[0] == 42


def test_read_heartbeat_returns_none_for_a_missing_empty_or_garbage_file(tmp_path):
    assert read_heartbeat(tmp_path / "missing") is None
    (tmp_path / "empty").write_bytes(b"")
    assert read_heartbeat(tmp_path / "empty") is None
    (tmp_path / "garbage").write_bytes(os.urandom(3 * RECORD_SIZE_BYTES))
    assert read_heartbeat(tmp_path / "garbage") is None


def test_a_torn_slot_fails_its_checksum_and_is_ignored(tmp_path):
    body = "tg1 7 1700000000.000000 123 7 1700000000.000000"
    good = f"{body} {zlib.crc32(body.encode()):08x}".ljust(RECORD_SIZE_BYTES - 1) + "\n"
    torn = good.replace("tg1 7 ", "tg1 9 ", 1)  # half of a newer write over an older record
    (tmp_path / "hb").write_bytes((good + torn).encode())
    assert [(b.slot, b.step) for b in read_heartbeats(tmp_path / "hb")] == [(0, 7)]


def test_every_local_rank_beats_into_its_own_slot_and_the_reader_takes_the_newest(tmp_path):
    path = tmp_path / "heartbeat"
    for rank, step in ((1, 7), (0, 8), (3, 6)):
        done = run_snippet(f"heartbeat({step})", **{HEARTBEAT_FILE_ENV: str(path), "LOCAL_RANK": str(rank)})
        assert done.returncode == 0, done.stderr
    beats = read_heartbeats(path)
    assert sorted((b.slot, b.step) for b in beats) == [(0, 8), (1, 7), (3, 6)]
    assert read_heartbeat(path)[0] == 6  # rank 3 beat last


def test_the_last_step_survives_a_sigkill_right_after_the_beat(tmp_path):
    path = tmp_path / "heartbeat"
    code = "import os, signal\nfor s in range(1, 1001): heartbeat(s)\nos.kill(os.getpid(), signal.SIGKILL)"
    done = run_snippet(code, **{HEARTBEAT_FILE_ENV: str(path)})
    assert done.returncode == -signal.SIGKILL
    assert read_heartbeat(path)[0] == 1000


def test_a_held_back_beat_is_flushed_when_the_job_exits(tmp_path):
    path = tmp_path / "heartbeat"
    code = NO_MMAP + "heartbeat(1); heartbeat(2); sys.exit(1)"
    done = run_snippet(code, **{HEARTBEAT_FILE_ENV: str(path)})
    assert done.returncode == 1
    assert read_heartbeat(path)[0] == 2


def test_exit_after_preemption_save_flushes_and_exits_with_the_preempted_code(tmp_path):
    path = tmp_path / "heartbeat"
    code = NO_MMAP + "heartbeat(1); heartbeat(2); exit_after_preemption_save()"
    done = run_snippet(code, **{HEARTBEAT_FILE_ENV: str(path)})
    assert done.returncode == EXIT_PREEMPTED == 75
    assert read_heartbeat(path)[0] == 2


def test_the_preemption_handler_turns_sigterm_into_a_flag():
    install_preemption_handler()
    try:
        assert not preemption_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not preemption_requested() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert preemption_requested()
    finally:
        uninstall_preemption_handler()
    assert not preemption_requested()
    assert signal.getsignal(signal.SIGTERM) is not hb._on_preemption_signal


def test_installing_the_preemption_handler_outside_the_main_thread_is_a_config_error():
    errors: list[BaseException] = []

    def install() -> None:
        try:
            install_preemption_handler()
        except ConfigError as e:
            errors.append(e)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


SIGNAL_STORM = """
import os, signal, subprocess, sys, time
from trainguard.recovery import heartbeat as hb
hb.install_preemption_handler((signal.SIGUSR1, signal.SIGTERM))
sender = subprocess.Popen([sys.executable, "-c", f'''
import os, signal, time
end = time.monotonic() + 1.5
while time.monotonic() < end:
    os.kill({os.getpid()}, signal.SIGUSR1)
    os.kill({os.getpid()}, signal.SIGTERM)
'''])
while sender.poll() is None:  # the training loop: checks the flag between steps
    seen = hb.preemption_requested()
print("alive", seen)
"""


def test_signals_arriving_together_never_deadlock_the_handler(tmp_path):
    """Python runs a signal's handler inside the previous one when both arrive together (Slurm's USR1 and
    the agent's or the supervisor's SIGTERM). The handler used to set a threading.Event, whose lock the
    nested handler then waited for on the same thread: the job hung (or hit RecursionError) instead of
    saving. A storm of both signals must leave the process running with the flag set."""
    import subprocess
    import sys

    script = tmp_path / "storm.py"
    script.write_text(SIGNAL_STORM)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["alive", "True"]), (r.returncode, r.stderr[-2000:])
