"""Victim process of the crash and lock tests: a writer that saves checkpoints until it is SIGKILLed.

``python crash_worker.py serve`` starts a fork server: it imports torch and trainguard once (about 2 s) and
then forks one victim per JSON command read on stdin, so that dozens of kill trials cost milliseconds each.
The server never runs a torch op itself, so forking it is safe. Protocol (one JSON line each way)::

    {"op": "spawn", "args": {...}}  ->  {"pid": 1234}
    {"op": "wait", "pid": 1234}     ->  {"signal": 9, "exit": null}

A victim appends JSON lines to ``args["log"]`` (``ready``, ``begin`` before each save, ``done`` with the
manifest's SHA-256 after ``save`` returned), so the parent knows exactly which steps were committed before it
killed the victim. ``args["hook"]`` = ``{"point", "at", "marker"}`` makes the victim stop at the ``at``-th
occurrence of a kill point: it writes ``marker`` (proof that the point was reached) and sleeps until killed.

Kill points (see ``install_hook``): ``mid_chunk_write`` (half of a chunk's temporary file written),
``chunk_published`` (a chunk renamed into ``chunks/``, the save not committed), ``before_publish`` (every chunk
durable, no step directory yet), ``step_dir_created`` (step directory made, no manifest), ``manifest_tmp_written``
(the manifest's temporary file written, not yet renamed) and ``after_commit`` (manifest published, ``save``
not yet returned).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

_real_replace = os.replace
MAX_STEPS = 500  # saves at full speed; then one save per 50 ms until the parent kills it
MAX_LIFE_S = 120.0  # a victim that was never killed stops by itself


def emit(log_fd: int, **rec: Any) -> None:
    os.write(log_fd, (json.dumps(rec) + "\n").encode())


def install_hook(point: str, at: int, marker: str) -> None:
    """Monkeypatch this process so that it stops at the ``at``-th occurrence of ``point``."""
    from faultlib import is_chunk_tmp

    import trainguard.storage.local as local
    from trainguard.format.layout import parse_step_dir
    from trainguard.storage import LocalStorage

    lock = threading.Lock()
    seen = [0]

    def hit() -> bool:
        with lock:
            seen[0] += 1
            return seen[0] == at

    def fire(**detail: Any) -> None:
        tmp = marker + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"point": point, "pid": os.getpid(), **detail}, f)
        _real_replace(tmp, marker)
        while True:  # the parent SIGKILLs us now
            time.sleep(60)

    if point == "mid_chunk_write":
        real_write_file = local.write_file  # the chunk store writes through it too

        def write_file(path: Path, buf: Any, *, fsync: bool = True, **kw: Any) -> None:  # kw: direct
            if is_chunk_tmp(path) and hit():
                view = memoryview(buf).cast("B")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                os.write(fd, view[: len(view) // 2])
                os.fsync(fd)
                os.close(fd)
                fire(path=str(path), written=len(view) // 2, length=len(view))
            real_write_file(path, buf, fsync=fsync, **kw)

        local.write_file = write_file
    elif point in ("chunk_published", "manifest_tmp_written"):

        def replace(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            name = Path(dst).name
            if point == "manifest_tmp_written" and name == "manifest.json" and hit():
                fire(tmp=str(src), dst=str(dst))
            _real_replace(src, dst, *a, **k)
            if point == "chunk_published" and Path(dst).parent.parent.name == "chunks" and hit():
                fire(chunk=str(dst))

        os.replace = replace
    elif point == "before_publish":  # every chunk durable; the step directory not created yet
        real_make_dir = LocalStorage.make_dir

        def make_dir(self: Any, prefix: str) -> bool:
            parsed = parse_step_dir(prefix)
            if parsed is not None and not parsed[1] and hit():
                fire(step=parsed[0])
            return real_make_dir(self, prefix)

        LocalStorage.make_dir = make_dir  # type: ignore[method-assign]
    elif point == "step_dir_created":
        real_write_file = local.write_file  # what atomic_write calls for the manifest's temporary file

        def write_file_(path: Path, buf: Any, *, fsync: bool = True, **kw: Any) -> None:
            if Path(path).name.startswith(".manifest.json.tmp") and hit():
                fire(step_dir=str(Path(path).parent))
            real_write_file(path, buf, fsync=fsync, **kw)

        local.write_file = write_file_
    elif point == "after_commit":  # the manifest published (committed); retention not run yet
        real_publish = LocalStorage.publish

        def publish(self: Any, key: str, data: bytes, *, durable: bool = True) -> None:
            real_publish(self, key, data, durable=durable)
            if key.endswith("/manifest.json") and hit():
                fire(step=parse_step_dir(key.split("/", 1)[0]))

        LocalStorage.publish = publish  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown kill point {point!r}")


def victim(args: dict[str, Any]) -> None:
    """What a forked victim runs; ``args["mode"]`` picks the role."""
    import torch
    from faultlib import commit_save, make_state, manifest_path, sha256_file

    import trainguard as tg

    torch.set_num_threads(1)
    root = args["root"]
    log_fd = os.open(args["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    mode = args.get("mode", "save_loop")
    if mode == "try_open":
        try:
            mgr = tg.CheckpointManager(root)
        except tg.TrainguardError as e:
            emit(log_fd, ev="refused", error=type(e).__name__, message=str(e))
            return
        emit(log_fd, ev="opened")
        mgr.close()
        return
    hook = args.get("hook")
    if hook:
        install_hook(hook["point"], hook["at"], hook["marker"])
    mgr = tg.CheckpointManager(root, fsync=True, **args.get("manager_kwargs", {}))
    emit(log_fd, ev="ready")
    step = args["start"]
    if mode in ("hold", "hold_fork"):
        commit_save(mgr, step, make_state(step))
        helper = None
        if mode == "hold_fork":  # like a DataLoader worker started with fork after the manager opened
            helper = os.fork()
            if helper == 0:
                time.sleep(args.get("helper_s", 30))
                os._exit(0)
        emit(log_fd, ev="holding", step=step, helper_pid=helper)
        time.sleep(120)
        return
    # a fast writer can finish MAX_STEPS saves before the parent kills it (500 saves of a small state take ~2 s
    # on 2 cores): it must still be alive and saving when killed, so it slows down instead of exiting
    deadline = time.monotonic() + MAX_LIFE_S
    step = args["start"]
    while time.monotonic() < deadline:
        if step >= args["start"] + MAX_STEPS:
            time.sleep(0.05)
        state = make_state(step)
        emit(log_fd, ev="begin", step=step)
        commit_save(mgr, step, state)
        emit(log_fd, ev="done", step=step, sha256=sha256_file(manifest_path(root, step)))
        step += 1


def serve() -> None:
    import faultlib  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401 - the slow imports, once, before any fork

    import trainguard.manager  # noqa: F401

    children: set[int] = set()
    out = sys.stdout
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "spawn":
            out.flush()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    err = os.open(cmd["args"]["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(err, 1)
                    os.dup2(err, 2)
                    victim(cmd["args"])
                except BaseException:  # noqa: BLE001 - reported through the exit code and the stderr file
                    traceback.print_exc()
                    code = 1
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            children.add(pid)
            reply: dict[str, Any] = {"pid": pid}
        elif cmd["op"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            children.discard(cmd["pid"])
            reply = {
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            }
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for pid in children:  # the test ended without killing them
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except OSError:
            pass


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        sys.exit("usage: crash_worker.py serve")
