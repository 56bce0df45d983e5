"""Worker of the elastic tests, run by ``torchrun`` agents (gloo, CPU):
``elastic_worker.py --root R --log-dir L --control-dir C --steps N --save-every K [--stop-at S]
[--kill-at K2] [--hold-at H]``.

A tiny MLP with dropout (the RNG matters), AdamW, a shuffled ``ResumableLoader`` sharded over the current world
size, gradients averaged over the ranks with one all-reduce, and a synchronous save every ``--save-every``
steps. Every rank appends one JSON line per step to ``L/steps-<pid>.jsonl``: step, world size, rank, epoch,
the sample ids of its batch, its loss, and the restart counters of torchrun and trainguard.

Test hooks (the harness acts on the marker files in ``C``):

- ``--kill-at K2``: at world size 2, rank 1 writes ``C/at-kill`` after step K2 and waits to be killed with
  its node.
- ``--hold-at H``: at world size 1, after step H (and its save), rank 0 writes ``C/holding`` and waits
  (beating the heartbeat) until the agent restarts it because a node joined.
- ``--stop-at S``: exit 0 after step S (saved), for the reference run's segments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import trainguard as tg

DATASET_SIZE = 48
BATCH = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--control-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--hold-at", type=int, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    control = Path(a.control_dir)

    random.seed(0)  # every RNG the state captures starts seeded, as in any reproducible run
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(DATASET_SIZE, 8, generator=g), torch.randn(DATASET_SIZE, 1, generator=g)
    ds = torch.utils.data.TensorDataset(x, y, torch.arange(DATASET_SIZE))
    loader = tg.ResumableLoader(ds, batch_size=BATCH, shuffle=True, seed=3, rank=rank, world_size=world)
    state = {"model": model, "optim": optim, "loader": loader, "rng": tg.RNGState()}
    mgr = tg.CheckpointManager(a.root, save_policy=tg.EveryNSteps(a.save_every), async_save=False)
    start = mgr.restore_latest(state) or 0
    log = open(Path(a.log_dir) / f"steps-{os.getpid()}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    batches = loader.forever()
    last = a.steps if a.stop_at is None else a.stop_at
    for step in range(start + 1, last + 1):
        xb, yb, ids = next(batches)
        epoch = loader.epoch  # the epoch the batch came from (forever() moves to the next epoch lazily)
        loss = nn.functional.mse_loss(model(xb), yb)
        optim.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad.div_(world)
        optim.step()
        record = {
            "step": step,
            "world_size": world,
            "rank": rank,
            "epoch": epoch,
            "ids": ids.tolist(),
            "loss": loss.item(),
            "restored": start,
            "torchelastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "run_id": os.environ.get("TRAINGUARD_RUN_ID"),
            "t": time.time(),
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        mgr.maybe_save(step, state, metrics={"loss": loss.item()}, force=step == last)
        if a.kill_at == step and world == 2 and rank == 1:
            # whole or absent (the harness polls for the name, then reads the pid), then killed with its agent
            (control / "at-kill.tmp").write_text(str(os.getpid()))
            os.replace(control / "at-kill.tmp", control / "at-kill")
            while True:
                time.sleep(1)
        if a.hold_at == step and world == 1:
            (control / "holding").write_text(str(step))
            while True:  # until the agent restarts this worker because a node joined
                tg.heartbeat(step)
                time.sleep(0.5)
    mgr.close()
    dist.destroy_process_group()
    # no interpreter finalization after gloo collectives (pytorch/pytorch#179291; see worker.py's main)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
