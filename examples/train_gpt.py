"""Train a small byte-level GPT on the Python standard library's own source code, with trainguard.

    python examples/train_gpt.py --root runs/gpt --steps 300

Alone it trains and checkpoints; under the supervisor it is restarted from the newest valid checkpoint
whenever it dies or hangs:

    trainguard run --root runs/gpt --heartbeat-timeout 60 -- python examples/train_gpt.py --root runs/gpt

Under ``torchrun`` (``WORLD_SIZE`` > 1) it trains data-parallel with FSDP2 on gloo (CPU): every block and then
the whole model are ``fully_shard``-ed (the root group holds the tied embedding/head weight, so it stays one
parameter), the model and optimizer are checkpointed through ``tg.ModelOptimizerState`` (sharded state, keyed
by parameter name, loadable at any world size), and each rank reads its share of every epoch. Rank 0 alone
writes the train log (the loss averaged over ranks) and ``final.json``:

    trainguard run --root runs/gpt -- torchrun --nproc-per-node 2 examples/train_gpt.py --root runs/gpt

The corpus exists on every machine without a download: every ``*.py`` file under ``sysconfig``'s stdlib path,
read in sorted path order, concatenated (capped by --corpus-bytes), split 90/10 into train and validation.
The model is nanoGPT's (Karpathy): pre-norm transformer blocks, causal self-attention, GELU MLP, tied input
and output embeddings, AdamW with weight decay on matrices only, linear warmup + cosine LR, dropout and
gradient clipping. Deterministic on CPU: a run killed at any step and resumed continues bit for bit.

``--fault-plan FILE`` (used by ``trainguard demo``) injects failures: a JSON list of
``{"attempt": k, "step": s, "kind": "kill_step" | "kill_during_save" | "hang" | "corrupt_newest" |
"silent_corruption"}``; the fault
of attempt k (``TRAINGUARD_RESTART_COUNT``) fires at step s. Under torchrun an optional ``"rank": r`` (default 0)
picks the rank that is killed, hangs or corrupts (``corrupt_newest`` and ``silent_corruption`` need rank 0;
``silent_corruption`` flips a mantissa bit of a weight in the newest checkpoint and rewrites its CRC32C, as
memory corrupted before checksumming would: only the probe fingerprint catches it at resume); every rank takes part in
the ``kill_during_save`` save and rank r dies in the middle of writing it. ``"after_commit": true`` on a
``kill_step`` fault first waits for the save in flight to commit, so the newest checkpoint at the kill is the
last one the policy asked for (tests use it; an asynchronous save may otherwise still be persisting).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

import trainguard as tg

# -- configuration ------------------------------------------------------------------------------------------
p = argparse.ArgumentParser(description="byte-level GPT on the Python stdlib, checkpointed by trainguard")
p.add_argument("--root", default="runs/gpt", help="checkpoint run root")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--save-every", type=int, default=25, help="checkpoint interval in steps")
p.add_argument("--keep", type=int, default=3, help="keep the newest N checkpoints")
p.add_argument("--n-layer", type=int, default=4)
p.add_argument("--n-head", type=int, default=4)
p.add_argument("--n-embd", type=int, default=192)
p.add_argument("--block-size", type=int, default=64)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--dropout", type=float, default=0.1)
p.add_argument("--lr", type=float, default=1e-3)
p.add_argument("--min-lr", type=float, default=1e-4)
p.add_argument("--warmup", type=int, default=20)
p.add_argument("--weight-decay", type=float, default=0.1)
p.add_argument("--grad-clip", type=float, default=1.0)
p.add_argument("--eval-iters", type=int, default=8, help="validation batches at the end")
p.add_argument("--corpus-bytes", type=int, default=8 << 20, help="cap on the corpus size in bytes")
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed for determinism)")
p.add_argument("--sync", action="store_true", help="synchronous saves (default: asynchronous)")
p.add_argument("--log", default=None, help="per-step log (JSON lines); default <root>/train_log.jsonl")
p.add_argument("--fault-plan", default=None, help="JSON fault plan (see the module docstring)")
args = p.parse_args()

random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)
torch.set_num_threads(args.threads)
torch.use_deterministic_algorithms(True)
attempt = int(os.environ.get("TRAINGUARD_RESTART_COUNT", "0"))

# -- torchrun: one process per rank, gloo on CPU ---------------------------------------------------------------
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
rank, world_size = 0, 1
if distributed:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()


# -- data: the Python standard library's source, bytes 0-255 --------------------------------------------------
def load_corpus(limit: int) -> bytes:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 100_000:
        sys.exit(f"corpus too small ({total} bytes under {stdlib}); is the standard library installed?")
    return b"".join(parts)[:limit]


corpus = torch.frombuffer(bytearray(load_corpus(args.corpus_bytes)), dtype=torch.uint8).long()
split = int(0.9 * len(corpus))
train_data, val_data = corpus[:split], corpus[split:]


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of block_size + 1 bytes: input x and next-byte targets y."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block : i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


loader = tg.ResumableLoader(
    Windows(train_data, args.block_size),
    batch_size=args.batch_size,
    shuffle=True,
    seed=args.seed,
    drop_last=True,
    rank=rank,
    world_size=world_size,
)


# -- model: nanoGPT ---------------------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(args.n_embd, 3 * args.n_embd)
        self.proj = nn.Linear(args.n_embd, args.n_embd)
        self.drop = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, args.n_head, C // args.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=args.dropout if self.training else 0.0
        )
        return self.drop(self.proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(args.n_embd), nn.LayerNorm(args.n_embd)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(
            nn.Linear(args.n_embd, 4 * args.n_embd),
            nn.GELU(),
            nn.Linear(4 * args.n_embd, args.n_embd),
            nn.Dropout(args.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, args.n_embd)
        self.pos = nn.Embedding(args.block_size, args.n_embd)
        self.drop = nn.Dropout(args.dropout)
        self.blocks = nn.ModuleList(Block() for _ in range(args.n_layer))
        self.ln_f = nn.LayerNorm(args.n_embd)
        self.head = nn.Linear(args.n_embd, 256, bias=False)
        self.head.weight = self.tok.weight  # weight tying: stays tied across save/restore
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


model = GPT()
if distributed:  # the same initial weights on every rank (same seed), then each rank keeps its shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root group: embeddings, ln_f and the tied head weight
    torch.manual_seed(args.seed + rank)  # dropout masks differ across ranks, as in real data parallelism
decay = [p_ for n, p_ in model.named_parameters() if p_.dim() >= 2]
no_decay = [p_ for n, p_ in model.named_parameters() if p_.dim() < 2]
optim = torch.optim.AdamW(
    [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=args.lr,
    betas=(0.9, 0.95),
)


def lr_at(step: int) -> float:  # linear warmup, then cosine down to min_lr (nanoGPT)
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    ratio = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_at(s) / args.lr)


# -- fault injection (trainguard demo) ---------------------------------------------------------------------------
def load_fault():
    if not args.fault_plan:
        return None
    plan = json.loads(Path(args.fault_plan).read_text())
    return next((f for f in plan if f["attempt"] == attempt), None)


fault = load_fault()


def fire(kind: str, step: int, mgr: tg.CheckpointManager, pending) -> None:
    if fault.get("rank", 0) != rank:
        if kind == "kill_during_save":  # a save is collective: every rank takes part, the fault's rank dies
            mgr.save(step, state, metrics={"loss": float("nan")}, overwrite=True).wait()
        return  # the other faults hit one rank; the rest fail in their next collective
    # Recorded where it happens, before it fires: `trainguard report` joins it to the supervisor's failure.
    mgr.log_event("fault_injected", kind=kind, step=step)
    print(
        f"[fault] attempt {attempt}: {kind} after step {step - 1 if kind == 'kill_step' else step}"
        + (f" on rank {rank}" if distributed else ""),
        flush=True,
    )
    if kind == "kill_step":  # SIGKILL in the middle of a training step
        if fault.get("after_commit") and pending is not None:
            pending.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":  # stop beating; the supervisor's heartbeat timeout kills the process group
        while True:
            time.sleep(3600)
    if kind == "kill_during_save":  # SIGKILL while the checkpoint of this step is being written
        import trainguard.storage.local as local

        real = local.write_file

        def write_then_die(*a, **k):
            real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        local.write_file = write_then_die
        mgr.save(step, state, metrics={"loss": float("nan")}, overwrite=True).wait()
    if kind == "corrupt_newest":  # flip one bit in a chunk only the newest checkpoint uses, then die
        from trainguard.catalog import read_manifest

        if pending is not None:
            pending.wait()
        newest = mgr.latest_step()
        m = read_manifest(args.root, newest)
        others = set()
        for info in mgr.checkpoints():
            if info.status == "valid" and info.step != newest:
                others |= set(read_manifest(args.root, info.step).chunks)
        chunk = max((c for h, c in m.chunks.items() if h not in others), key=lambda c: c.length)
        path = Path(args.root) / chunk.path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04
        path.write_bytes(bytes(data))
        print(f"[fault] flipped a bit in {chunk.path} of step {newest}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "silent_corruption":  # a bit flipped before checksumming: bytes and CRC32C both rewritten
        from trainguard.validation.faults import corrupt_silently

        if pending is not None:
            pending.wait()
        newest = mgr.latest_step()
        fqn, chunk_path = corrupt_silently(args.root, newest)
        print(
            f"[fault] silently corrupted {fqn} in {chunk_path} of step {newest} (CRC32C rewritten)",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


# -- checkpointing: the four lines (every rank constructs the manager; saves and restores are collective) ------
_probe_windows = Windows(val_data, args.block_size)
probe_x = torch.stack([_probe_windows[i][0] for i in range(2)])  # a fixed probe batch: 2 validation windows
probe_y = torch.stack([_probe_windows[i][1] for i in range(2)])


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def weights_fingerprint() -> torch.Tensor:
    """One int64 per parameter: the sum of its elements' bit patterns (float32 bits read as int32).

    Integer addition is exact and order-independent, so any changed element changes its parameter's entry, and
    the value is bitwise the same after a bit-exact resume whatever the thread count; under FSDP each rank sums
    its shard and the sums are all-reduced (a collective: every rank calls the probe). A loss alone can miss a
    corrupted weight (a unit inactive on the probe inputs, a change lost in rounding).
    """
    sums = []
    for p_ in model.parameters():
        t = p_.detach()
        if type(t).__name__ == "DTensor":
            t = t.to_local()
        t = t.contiguous().reshape(-1)
        sums.append(t.view(_INT_OF_WIDTH[t.element_size()]).to(torch.int64).sum())
    out = torch.stack(sums)
    if distributed:
        dist.all_reduce(out)
    return out


def probe() -> dict[str, torch.Tensor]:
    """The probe fingerprint: the model's loss on the fixed probe batch and a fingerprint of every weight (eval
    mode, no grad: it changes no state)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(probe_x, probe_y)
    model.train(was_training)
    return {"loss": out, "weights": weights_fingerprint()}


mgr = tg.CheckpointManager(
    args.root,
    save_policy=tg.EveryNSteps(args.save_every),
    keep=args.keep,
    async_save=not args.sync,
    probe=probe,
)
if distributed:  # sharded model + optimizer state by parameter name: reloads at any world size
    state = {
        "app": tg.ModelOptimizerState(model, optim),
        "sched": sched,
        "loader": loader,
        "rng": tg.RNGState(),
    }
else:
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
start = mgr.restore_latest(state) or 0
log_path = Path(args.log) if args.log else Path(args.root) / "train_log.jsonl"
n_params = sum(p_.numel() for p_ in model.parameters())  # global sizes, also of DTensor shards
if rank == 0:
    print(
        f"attempt {attempt}: {'resumed from step ' + str(start) if start else 'starting fresh'}; "
        f"{n_params / 1e6:.2f}M parameters, {len(corpus) / 1e6:.1f} MB corpus, training to step {args.steps}"
        + (f", {world_size} ranks (FSDP2, gloo)" if distributed else ""),
        flush=True,
    )


def mean_over_ranks(x: torch.Tensor) -> float:
    """The loss averaged over ranks (each rank's own loss when alone)."""
    if not distributed:
        return x.item()
    t = x.detach().clone()
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return (t / world_size).item()


# -- training loop ----------------------------------------------------------------------------------------------
step, pending, loss = start, None, None
batches = iter(loader)
t_train = 0.0
with open(log_path if rank == 0 else os.devnull, "a") as log:  # rank 0 writes the log
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        step += 1
        t0 = time.perf_counter()
        model.train()
        loss = model(x, y)
        if fault and fault["step"] == step and fault["kind"] == "kill_step":
            fire("kill_step", step, mgr, pending)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optim.step()
        sched.step()
        dt = time.perf_counter() - t0
        t_train += dt
        loss_v = mean_over_ranks(loss)
        log.write(
            json.dumps(
                {
                    "step": step,
                    "loss": loss_v,
                    "lr": sched.get_last_lr()[0],
                    "step_s": dt,
                    "attempt": attempt,
                    "t": time.time(),
                }
            )
            + "\n"
        )
        log.flush()
        pending = mgr.maybe_save(step, state, metrics={"loss": loss_v}) or pending
        if fault and fault["step"] == step and fault["kind"] != "kill_step":
            fire(fault["kind"], step, mgr, pending)

# -- end: always checkpoint the final state, report validation loss ---------------------------------------------
# (decided from the save handles, the same on every rank, not from a directory scan each rank makes alone)
if loss is not None and (pending is None or pending.step != step or pending.skipped):
    mgr.save(step, state, metrics={"loss": loss_v})
mgr.close()
model.eval()
with torch.no_grad():
    g = torch.Generator().manual_seed(0)
    val = Windows(val_data, args.block_size)
    idx = torch.randint(0, len(val), (args.eval_iters, args.batch_size), generator=g)
    val_loss = (  # under FSDP every rank runs the same batches (the forward is collective)
        sum(
            model(
                torch.stack([val[int(i)][0] for i in row]), torch.stack([val[int(i)][1] for i in row])
            ).item()
            for row in idx
        )
        / args.eval_iters
    )
summary = {
    "step": step,
    "train_loss": loss_v if loss is not None else None,
    "val_loss": val_loss,
    "train_s": t_train,
    "attempt": attempt,
}
if rank == 0:
    (Path(args.root) / "final.json").write_text(json.dumps(summary))
    print(f"done: step {step}, train loss {summary['train_loss']}, val loss {val_loss:.4f}", flush=True)
if distributed:
    dist.destroy_process_group()
    # Skip interpreter finalization: a gloo worker thread that drops the last reference to a finished
    # collective's tensors while Python shuts down aborts the process (SIGABRT, "terminate called without an
    # active exception") after a successful run, and a supervisor would count that as a failure.
    # pytorch/pytorch#179291.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
