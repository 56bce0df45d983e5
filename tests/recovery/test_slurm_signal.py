"""Slurm's ``--signal=USR1@120`` without ``B:`` signals every process of the job step at once: ``trainguard
run``, torchrun's elastic agent and its workers. torchrun's agent has no USR1 handler (its default
``--signals-to-handle`` is SIGTERM,SIGINT,SIGHUP,SIGQUIT), so USR1 ends it at once; its workers (each in its own
session) catch USR1 because ``trainguard run --preempt-signal USR1`` passes ``TRAINGUARD_PREEMPT_SIGNALS=USR1``,
save collectively at the next step as orphans, and ``trainguard run`` stops them after ``--grace-period``.
This runs that delivery with a real torchrun (2 workers on gloo): the preemption checkpoint commits and
``trainguard run`` exits 75 (requeue). docs/multi-node.md ("Slurm") describes the other delivery modes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard.recovery.events import read_events
from trainguard.recovery.lifetime import descendants

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

TRAINER = """
import json, os, sys, time, torch
import torch.distributed as dist
import trainguard as tg
root, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(1000), save_on_preemption=True, async_save=False)
state = {"model": model, "optim": optim}
start = mgr.restore_latest(state) or 0
for step in range(start + 1, 100_000):
    loss = model(torch.randn(2, 8)).pow(2).mean()
    optim.zero_grad(); loss.backward(); optim.step()
    if step == start + 3 and dist.get_rank() == 0:
        open(out, "w").close()
    mgr.maybe_save(step, state)
    time.sleep(0.02)
"""


def test_usr1_to_every_process_of_a_torchrun_job_saves_and_exits_75(tmp_path):
    script, root, ready = tmp_path / "train.py", tmp_path / "ckpts", tmp_path / "ready"
    script.write_text(TRAINER)
    cmd = [sys.executable, "-m", "trainguard", "run", "--root", str(root), "--preempt-signal", "USR1",
           "--grace-period", "60", "--json", "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), str(root), str(ready)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("TRAINGUARD_")}
    sup = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert sup.poll() is None and time.monotonic() < deadline, sup.communicate()
            time.sleep(0.05)
        tree = [sup.pid, *sorted(descendants([sup.pid]))]  # supervisor, agent, 2 workers
        assert len(tree) >= 4, tree
        for pid in tree:  # what Slurm does without B: every process of the step gets USR1
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        stdout, stderr = sup.communicate(timeout=240)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    assert sup.returncode == 75, stderr[-3000:]
    result = json.loads(stdout)
    assert (result["status"], result["reason"]) == ("preempted", "SIGUSR1")
    saves = read_events(root, event="preemption")
    # both ranks, one step (the job's stderr holds the workers' tracebacks if they failed)
    assert len(saves) == 2 and len({s["step"] for s in saves}) == 1, (saves, stderr[-6000:])
    step = saves[0]["step"]
    assert (root / f"step-{step:09d}" / "manifest.json").exists()  # the preemption checkpoint committed
    assert len(read_events(root, event="job_start")) == 1  # not restarted
    [preempted] = read_events(root, event="preempted")
    assert preempted["job_exit_code"] is None  # the agent died of USR1 (no handler) ...
    [left] = read_events(
        root, event="leftovers_stopped"
    )  # ... its workers saved as orphans, then were stopped
    assert len(left["pids"]) == 2 and left["killed"] == []  # they exited (75) within the grace period
