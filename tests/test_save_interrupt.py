"""Ctrl-C (SIGINT) during a synchronous save propagates as KeyboardInterrupt (tester finding: it became a
SaveError "AssertionError: is of type KeyboardInterrupt, not an Exception", which a training loop that catches
SaveError trains on through); the partial save is cleaned up, nothing is committed, earlier checkpoints verify."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import trainguard as tg
from trainguard._text import error_field_text, exception_text
from trainguard.catalog import scan
from trainguard.integrity.verify import verify

CHILD = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    import torch, trainguard as tg
    root = sys.argv[1]
    mgr = tg.CheckpointManager(root, async_save=False, compression="off")
    mgr.save(1, {"w": torch.zeros(1 << 20)})

    def staged_files():  # a save stages its chunks in its partial directory before publishing them
        return sum(len(fs) for d, _, fs in os.walk(root) if ".partial" in d)

    def interrupt_mid_save():  # SIGINT once the save of step 2 has staged its first chunk
        while staged_files() == 0:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_mid_save, daemon=True).start()
    try:
        # 64 MiB: the interrupt lands while it is staged, made durable or published
        mgr.save(2, {"w": torch.randn(1 << 24)})
    except tg.SaveError as e:
        print("SAVEERROR", e, flush=True)
        sys.exit(3)
    print("SAVED", flush=True)
    """
)


def test_sigint_during_a_sync_save_raises_keyboardinterrupt_and_commits_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "root"
    p = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=120)
    assert "SAVEERROR" not in p.stdout, p.stdout
    assert "SAVED" not in p.stdout  # the interrupt landed mid-save (the watcher fired)
    assert p.returncode in (-2, 130), (p.returncode, p.stderr[-2000:])
    assert "KeyboardInterrupt" in p.stderr
    mgr = tg.CheckpointManager(root, read_only=True)
    assert [(i.step, i.status) for i in mgr.checkpoints()] == [(1, "valid")]
    report = verify(root)
    assert report.ok and report.checked == [1]  # the earlier checkpoint re-reads intact
    assert not [x for x in root.iterdir() if ".partial" in x.name]
    # `trainguard ls` lists the interrupted save as the type alone, not "KeyboardInterrupt: ;" (tester finding)
    failed = [i for i in scan(root, failed_saves=True) if i.step == 2]
    assert len(failed) == 1 and "KeyboardInterrupt (interrupted); nothing was committed" in failed[0].problem
    assert ": ;" not in failed[0].problem


def test_an_exception_without_a_message_is_rendered_as_its_type():
    assert exception_text(KeyboardInterrupt()) == "KeyboardInterrupt (interrupted)"
    assert exception_text(MemoryError()) == "MemoryError"
    assert exception_text(OSError(28, "No space left")) == "OSError: [Errno 28] No space left"
    # an event written by an older version reads the same
    assert error_field_text("KeyboardInterrupt: ") == "KeyboardInterrupt (interrupted)"
    assert error_field_text("MemoryError: ") == "MemoryError"
    assert error_field_text("ValueError: bad") == "ValueError: bad"
