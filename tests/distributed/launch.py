"""Launching real multi-process jobs for the distributed tests: ``torchrun`` on CPU with gloo.

Each launch's c10d rendezvous store binds a port the kernel picks (``127.0.0.1:0``: no free-port-then-bind race
with other processes binding ports meanwhile), runs in its own process group (a hung job is killed
as a whole) and returns what every rank wrote as JSON: a worker writes ``<out>/<scenario>-rank<r>.json``
(see ``worker.py``). Imported by the test modules only (the workers are plain scripts).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
REPO = HERE.parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a launch whose port other processes must know in advance (the
    elastic test's two agents); it can be taken by another binder before it is used: prefer port 0."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_cmd(
    nprocs: int, *argv: str, max_restarts: int | None = None, standalone: bool = False
) -> list[str]:
    """``torchrun`` (of this interpreter's environment) with a private c10d rendezvous on localhost, on a port
    the agent's store binds itself (port 0), or ``--standalone`` (the same, and what users of commands
    relaunched by the supervisor write)."""
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    rdzv = ["--standalone"] if standalone else ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    return [
        *launcher,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nprocs),
        *rdzv,
        *([] if max_restarts is None else ["--max-restarts", str(max_restarts)]),  # torchrun's default: 0
        "--monitor-interval",
        "0.2",
        *argv,
    ]


def job_env(**extra: str) -> dict[str, str]:
    """Environment for a launched job: no supervisor variables leaking in from the test's environment, one
    CPU thread per process (4 processes share 2 cores), unbuffered output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    env.update(extra)
    return env


def run(cmd: list[str], *, timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``cmd`` in a new session and return the CompletedProcess (stdout and stderr merged); on timeout
    the whole process group is killed and AssertionError raised with the output so far."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or job_env(),
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd} ran over {timeout_s} s:\n{out[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def run_workers(
    nprocs: int, scenario: str, out: Path, *, timeout_s: float = 300, worker: Path = WORKER, **params: Any
) -> list[dict[str, Any]]:
    """Run ``worker.py <scenario>`` (or another ``worker`` script built on worker.py's ``main``) on ``nprocs``
    ranks and return the per-rank results, index = rank.

    Raises:
        AssertionError: the job failed (with the job's output and any worker traceback) or a rank wrote no
            result.
    """
    out.mkdir(parents=True, exist_ok=True)
    spec = out / f"{scenario}-spec.json"
    spec.write_text(json.dumps(params))
    r = run(torchrun_cmd(nprocs, str(worker), scenario, str(spec), str(out)), timeout_s=timeout_s)
    results = []
    for rank in range(nprocs):
        f = out / f"{scenario}-rank{rank}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    errors = [res["error"] for res in results if res and "error" in res]
    if r.returncode != 0 or errors or any(res is None for res in results):
        raise AssertionError(
            f"{scenario} at {nprocs} ranks failed (exit {r.returncode}):\n"
            + "\n".join(errors)
            + f"\n--- output ---\n{r.stdout[-6000:]}"
        )
    return results
