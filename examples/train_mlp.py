"""A small deterministic CPU training job that checkpoints with trainguard.

    python examples/train_mlp.py --root runs/mlp --steps 300

Kill it at any moment (Ctrl-C, `kill -9`) and run the same command again: it resumes from the newest valid
checkpoint and continues bit for bit as if it had never stopped. `--die-at-step N` makes it SIGKILL itself
after step N (used by the tests). Per-step losses go to `<root>/losses.jsonl` (or --log).

The job: an MLP with dropout classifying a fixed synthetic "spirals" dataset, AdamW, linear warmup + cosine
LR, gradient clipping, a shuffled resumable loader, and every RNG captured by trainguard.RNGState.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import trainguard as tg

# -- configuration ------------------------------------------------------------------------------------------
p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--root", default="runs/mlp", help="checkpoint run root")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--save-every", type=int, default=25, help="checkpoint interval in steps")
p.add_argument("--keep", type=int, default=3, help="keep the newest N checkpoints")
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--hidden", type=int, default=128)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--num-workers", type=int, default=0)
p.add_argument("--log", default=None, help="per-step loss log (JSON lines); default <root>/losses.jsonl")
p.add_argument("--die-at-step", type=int, default=None, help="SIGKILL this process right after this step")
args = p.parse_args()
random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)
torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)

# -- data: two interleaved spirals, fixed by the seed ------------------------------------------------------
g = torch.Generator().manual_seed(0)
n = 2048
t = torch.rand(n, generator=g) * 4 * math.pi
label = torch.randint(0, 2, (n,), generator=g)
r = t / (4 * math.pi)
x = torch.stack([r * torch.cos(t + math.pi * label), r * torch.sin(t + math.pi * label)], 1)
x = x + 0.02 * torch.randn(n, 2, generator=g)
dataset = TensorDataset(x, label, torch.arange(n))
loader = tg.ResumableLoader(
    dataset, batch_size=args.batch_size, shuffle=True, seed=args.seed, num_workers=args.num_workers
)

# -- model, optimizer, schedule -----------------------------------------------------------------------------
model = nn.Sequential(
    nn.Linear(2, args.hidden),
    nn.GELU(),
    nn.Dropout(0.1),
    nn.Linear(args.hidden, args.hidden),
    nn.GELU(),
    nn.Dropout(0.1),
    nn.Linear(args.hidden, 2),
)
optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def lr_lambda(step: int) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda)

# -- checkpointing: four lines ------------------------------------------------------------------------------
mgr = tg.CheckpointManager(args.root, save_policy=tg.EveryNSteps(args.save_every), keep=args.keep)
state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
start = mgr.restore_latest(state) or 0
log_path = Path(args.log) if args.log else Path(args.root) / "losses.jsonl"
print(f"{'resumed from step ' + str(start) if start else 'starting fresh'}; training to step {args.steps}")

# -- training loop ------------------------------------------------------------------------------------------
step, loss = start, None
batches = loader.forever()  # epoch after epoch, from the restored position (created after restore_latest)
with open(log_path, "a") as log:
    for step in range(start + 1, args.steps + 1):
        xb, yb, idx = next(batches)
        model.train()
        loss = nn.functional.cross_entropy(model(xb), yb)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        log.write(
            json.dumps(
                {"step": step, "loss": loss.item(), "lr": sched.get_last_lr()[0], "batch": int(idx.sum())}
            )
            + "\n"
        )
        log.flush()
        # the policy decides; the last step is always saved (force), so a normal end loses nothing
        mgr.maybe_save(step, state, metrics={"loss": loss.item()}, force=step == args.steps)
        if args.die_at_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
if loss is not None:
    print(f"done: step {step}, loss {loss.item():.4f}")
else:
    print(f"nothing to do: already at step {step}")
mgr.close()
