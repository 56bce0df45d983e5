"""One writer per run root: a second writer gets RootLockedError, readers work alongside, and a SIGKILLed
writer leaves no stale lock."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from faultlib import (
    ForkServer,
    assert_state_is,
    blank_state,
    commit_save,
    make_state,
    read_log,
    require,
    wait_until,
)

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.integrity.verify import verify


def start_victim(fs: ForkServer, tmp_path: Path, name: str, **args: Any) -> tuple[int, Path]:
    log = tmp_path / f"{name}.log"
    pid = fs.spawn(log=str(log), stderr=str(tmp_path / f"{name}.stderr"), **args)
    return pid, log


def wait_for_event(fs: ForkServer, pid: int, log: Path, ev: str) -> dict[str, Any]:
    err = log.with_suffix(".stderr")
    wait_until(lambda: any(e["ev"] == ev for e in read_log(log)) or "Traceback" in _text(err), 60, ev)
    found = [e for e in read_log(log) if e["ev"] == ev]
    assert found, _text(err)
    return found[0]


def kill(fs: ForkServer, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    status = fs.wait(pid)
    assert status["signal"] == signal.SIGKILL, status


def _text(p: Path) -> str:
    try:
        return p.read_text()
    except FileNotFoundError:
        return ""


def test_a_second_manager_in_the_same_process_gets_root_locked_error(tmp_path):
    root = tmp_path / "root"
    first = tg.CheckpointManager(root)
    holder = (root / ".lock").read_text()
    for _ in range(2):  # a refused attempt neither steals nor releases the lock
        with pytest.raises(tg.RootLockedError) as ei:
            tg.CheckpointManager(root)
        msg = str(ei.value)
        assert str(root) in msg and f"pid {os.getpid()}" in msg
        assert "read_only=True" in msg and "different root" in msg
        assert (root / ".lock").read_text() == holder
    commit_save(first, 1, make_state(1))
    first.close()
    with tg.CheckpointManager(root) as second:  # closing released it
        commit_save(second, 2, make_state(2))
    assert verify(root).ok


def test_a_writer_in_another_process_locks_out_this_one_and_readers_work_alongside(forkserver, tmp_path):
    root = tmp_path / "root"
    pid, log = start_victim(forkserver, tmp_path, "holder", root=str(root), start=7, mode="hold")
    try:
        wait_for_event(forkserver, pid, log, "holding")
        with pytest.raises(tg.RootLockedError) as ei:
            tg.CheckpointManager(root)
        assert f"pid {pid}" in str(ei.value), "the message names the process holding the lock"

        ro = tg.CheckpointManager(root, read_only=True)
        assert [(i.step, i.status) for i in ro.checkpoints()] == [(7, "valid")]
        state = blank_state()
        assert ro.restore_latest(state) == 7
        assert_state_is(state, 7)
        assert verify(root).ok
        with pytest.raises(tg.TrainguardError, match="read_only=True"):
            ro.save(8, make_state(8))
        result = CliRunner().invoke(cli, ["ls", str(root), "--json"])
        assert result.exit_code == 0 and '"step": 7' in result.output
    finally:
        kill(forkserver, pid)
    # The kernel released the dead writer's lock: a new writer opens, saves and restores.
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 8, make_state(8))
        state = blank_state()
        assert mgr.restore_latest(state) == 8
        assert_state_is(state, 8)


def test_this_process_locks_out_a_writer_in_another_process(forkserver, tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, make_state(1))
        pid, log = start_victim(forkserver, tmp_path, "second", root=str(root), mode="try_open")
        status = forkserver.wait(pid)
        assert status["exit"] == 0, _text(tmp_path / "second.stderr")
        [rec] = read_log(log)
        assert rec["ev"] == "refused" and rec["error"] == "RootLockedError"
        assert f"pid {os.getpid()}" in rec["message"]
    pid, log = start_victim(forkserver, tmp_path, "third", root=str(root), mode="try_open")
    assert forkserver.wait(pid)["exit"] == 0
    assert [e["ev"] for e in read_log(log)] == ["opened"]


def test_a_reader_alongside_a_busy_writer_only_sees_committed_checkpoints(forkserver, tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, make_state(1))
    pid, log = start_victim(forkserver, tmp_path, "writer", root=str(root), start=2)
    restored = set()
    try:
        wait_for_event(forkserver, pid, log, "ready")
        # at least 1.5 s of reading, and on until the writer committed while the reader read (a loaded machine
        # may take longer for that; 60 s at most)
        start = time.monotonic()
        while time.monotonic() < start + 1.5 or (len(restored) < 2 and time.monotonic() < start + 60):
            ro = tg.CheckpointManager(root, read_only=True)
            infos = ro.checkpoints()
            valid = [i.step for i in infos if i.status == "valid"]
            committed_or_publishing = {e["step"] for e in read_log(log) if e["ev"] in ("begin", "done")} | {1}
            assert set(valid) <= committed_or_publishing
            state = blank_state()
            step = ro.restore_latest(state)
            assert step is not None and step >= max(valid)
            assert_state_is(state, step)
            restored.add(step)
    finally:
        kill(forkserver, pid)
    require(len(restored) >= 2, f"the writer committed while the reader read (restored {sorted(restored)})")
    assert verify(root, sorted(restored)).ok


def test_a_killed_writer_leaves_no_lock_even_if_it_had_forked_a_helper(forkserver, tmp_path):
    root = tmp_path / "root"
    pid, log = start_victim(
        forkserver, tmp_path, "forker", root=str(root), start=1, mode="hold_fork", helper_s=20
    )
    helper = None
    try:
        helper = wait_for_event(forkserver, pid, log, "holding")["helper_pid"]
        require(helper, "the writer forked a helper")
    finally:
        kill(forkserver, pid)
    try:
        with tg.CheckpointManager(root) as mgr:
            commit_save(mgr, 2, make_state(2))
    finally:
        if helper:  # orphaned (reaped by init), and it exits by itself after helper_s anyway
            try:
                os.kill(helper, signal.SIGKILL)
            except ProcessLookupError:
                pass
