"""Hugging Face Transformers Trainer with trainguard checkpoints: kill it with ``kill -9`` and rerun the same command.

    python examples/train_hf.py --root runs/hf          # needs: pip install 'trainguard[hf]'

A small deterministic CPU job: a 2-layer GPT-2 built from a config (no download; dropout on, so the RNG state
matters) trained on random token sequences by ``tg.hf.TrainguardTrainer`` (AdamW, linear warmup/decay, a
shuffled dataset over several epochs). Every ``--save-every`` steps the Trainer saves through trainguard (async,
CRC32C, atomic commit), and ``train(resume_from_checkpoint=True)`` resumes from the newest valid checkpoint
with the optimizer, scheduler, RNG states and data position, so the losses continue bit for bit. Under the
supervisor: ``trainguard run --root runs/hf -- python examples/train_hf.py --root runs/hf`` (every step beats
its heartbeat; SIGTERM or a ``--preempt-signal`` saves the current step and exits 75). ``--kill-at N`` SIGKILLs
the process after step N once its pending saves committed (the tests use it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

import trainguard as tg

SEQ, VOCAB, SAMPLES = 16, 64, 48


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences (seeded); labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordLosses(TrainerCallback):
    """One line per logged step (``logging_steps=1``: that step's loss, exact); a resumed run appends the steps
    it redoes."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if self.path and logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": float(logs["loss"]).hex()}) + "\n")


class KillAt(TrainerCallback):
    """SIGKILL this process when step ``step`` is done, after its pending saves committed (so the resume point
    is known: the newest checkpoint before ``step``)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.trainer: tg.hf.TrainguardTrainer | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step and self.trainer is not None:
            self.trainer.trainguard_manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, help="trainguard run root")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps in all (6 per epoch)")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--losses", help="append {step, loss} lines to this file")
    p.add_argument("--final", help="torch.save the final model state_dict here")
    p.add_argument("--kill-at", type=int, help="SIGKILL after this step (fault injection)")
    a = p.parse_args()

    torch.manual_seed(0)  # the model's initial weights (a resumed run loads the checkpoint's)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    kill = KillAt(a.kill_at) if a.kill_at else None
    with tempfile.TemporaryDirectory() as out:  # the Trainer's output_dir: logs only, no checkpoint-N dirs
        args = TrainingArguments(
            output_dir=out, max_steps=a.steps, per_device_train_batch_size=8, learning_rate=3e-3,
            warmup_steps=3, lr_scheduler_type="linear", logging_steps=1, save_strategy="steps",
            save_steps=a.save_every, seed=0, use_cpu=True, report_to="none", disable_tqdm=True,
            dataloader_num_workers=0,
        )  # fmt: skip
        callbacks: list[TrainerCallback] = [RecordLosses(a.losses)] + ([kill] if kill else [])
        trainer = tg.hf.TrainguardTrainer(
            model=model,
            args=args,
            train_dataset=TokenDataset(),
            callbacks=callbacks,
            trainguard_root=a.root,
            trainguard_options={"save_on_preemption": True},  # SIGTERM: save this step, exit 75
        )
        if kill:
            kill.trainer = trainer
        trainer.train(resume_from_checkpoint=True)  # newest valid checkpoint, or a fresh start
    if a.final:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.final)


if __name__ == "__main__":
    main()
