"""torchrun's agent restarting its workers by itself (``--max-restarts``): no supervisor failure, but every
event a worker writes carries ``elastic_restart`` (the agent's ``TORCHELASTIC_RESTART_COUNT``), so the
restore and first step of each agent restart are told apart in the event log (docs/multi-node.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.recovery.events import read_events

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

WORKER = """
import os, sys, torch
import trainguard as tg
root = sys.argv[1]
model = torch.nn.Linear(4, 4)
mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(3), async_save=False)
state = {"model": model}
start = mgr.restore_latest(state) or 0
for step in range(start + 1, 9):
    mgr.maybe_save(step, state)
    if step == 4 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os._exit(1)  # the worker dies after the save of step 3; torchrun's agent restarts it
mgr.close()
"""


def test_the_agent_s_own_restarts_are_told_apart_in_the_event_log(tmp_path):
    script, root = tmp_path / "worker.py", tmp_path / "ckpts"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_"))}
    env |= {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "--max-restarts=1", "--monitor-interval=0.1", str(script), str(root)]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    restores = sorted((e["elastic_restart"], e["step"]) for e in read_events(root, event="restore"))
    assert restores == [(0, None), (1, 3)]  # the agent's restart resumed from the save of step 3
    firsts = {e["elastic_restart"]: e["step"] for e in read_events(root, event="first_step")}
    assert firsts == {0: 1, 1: 4}
