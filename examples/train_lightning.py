"""PyTorch Lightning with trainguard checkpoints: kill it with ``kill -9`` and rerun the same command.

    python examples/train_lightning.py --root runs/lightning          # needs: pip install 'trainguard[lightning]'

A small deterministic CPU job (MLP with dropout, AdamW, StepLR, a shuffled ``tg.ResumableLoader``) trained by
``lightning``'s ``Trainer`` with ``tg.lightning.TrainguardCheckpointIO``: every ``--save-every`` steps
``ModelCheckpoint`` saves through trainguard (async, CRC32C, atomic commit), and ``fit(ckpt_path="last")``
resumes from the newest valid checkpoint with the RNG states and the data position, so the losses continue bit
for bit. Under the supervisor: ``trainguard run --root runs/lightning -- python examples/train_lightning.py
--root runs/lightning``. ``--kill-at N`` SIGKILLs the process after step N once its pending saves committed (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import TensorDataset

import trainguard as tg


class MLP(pl.LightningModule):
    def __init__(self, losses: str | None, data: TensorDataset) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
        self.losses = losses
        self.data = data

    def train_dataloader(self) -> tg.lightning.LightningLoader:
        # each rank takes its share of every epoch; the position is saved in `loops` and restored mid-epoch
        return tg.lightning.LightningLoader(
            self.data,
            batch_size=4,
            shuffle=True,
            seed=0,
            rank=self.global_rank,
            world_size=self.trainer.world_size,
        )

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.losses:  # one line per step done and rank; a resumed run appends the steps it redoes
            with open(self.losses, "a") as f:
                row = {"step": self.global_step + 1, "loss": loss.item().hex()}
                if self.trainer.world_size > 1:
                    row["rank"] = self.global_rank
                f.write(json.dumps(row) + "\n")
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 7, 0.5),
                                                   "interval": "step"}}  # fmt: skip


class KillAt(Callback):
    """SIGKILL this process once step ``step`` is done, after its pending saves have committed (so the resume
    point is known: the newest checkpoint at or before ``step``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == self.step:
            trainer.strategy.checkpoint_io.wait()
            trainer.strategy.barrier()  # under DDP: every rank's part is written and rank 0 has committed
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="trainguard run root")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL after this step (fault injection)")
    ap.add_argument("--losses", default=None, help="append each step's loss (float.hex) to this JSONL file")
    ap.add_argument("--final", default=None, help="write the final model state_dict here (torch.save)")
    ap.add_argument("--devices", type=int, default=1, help="CPU processes (> 1: DDP on gloo)")
    args = ap.parse_args()

    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1234)
    data = TensorDataset(torch.randn(40, 16, generator=g), torch.randint(0, 4, (40,), generator=g))
    model = MLP(args.losses, data)
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=Path(args.root) / "lightning",
            every_n_train_steps=args.save_every,
            save_top_k=-1,
            save_last=True,
        )
    ]
    if args.kill_at is not None:
        callbacks.append(KillAt(args.kill_at))
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=args.devices,
        strategy=tg.lightning.TrainguardDDPStrategy(process_group_backend="gloo")
        if args.devices > 1
        else "auto",
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[tg.lightning.TrainguardCheckpointIO(args.root, keep=3)],
        callbacks=callbacks,
    )
    trainer.fit(model, ckpt_path="last")
    if args.final and trainer.is_global_zero:
        torch.save(model.state_dict(), args.final)
    print(f"done: step {trainer.global_step}, checkpoints in {args.root}")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # --devices > 1: each DDP rank (Lightning relaunches this script)
        torch.distributed.destroy_process_group()
        # Skip interpreter finalization: a gloo worker thread that drops the last reference to a finished
        # collective's tensors while Python shuts down aborts the process (SIGABRT, "terminate called without
        # an active exception") after a successful run; a supervisor would count that as a failure.
        # pytorch/pytorch#179291 (examples/train_gpt.py does the same).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
