"""An optimizer whose moments have a dtype of their own (bf16 moments of fp32 parameters, ...), shared by the restore-fidelity tests (issue 16)."""

from __future__ import annotations

import torch


class BF16MomentsAdamW(torch.optim.Optimizer):
    """AdamW that keeps its moments in ``moment_dtype`` whatever the parameter dtype (math in fp32): bf16
    moments of fp32 parameters, as memory-saving optimizers do, or fp32 moments of bf16 parameters; torch's stock AdamW cannot step with moments of another dtype. Its
    ``load_state_dict`` is torch's own, which casts floating-point state to the parameter dtype."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        moment_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.moment_dtype = moment_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype)
                st["step"] += 1
                t = st["step"].item()
                m = st["exp_avg"].float().mul_(b1).add_(p.grad, alpha=1 - b1)
                v = st["exp_avg_sq"].float().mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                st["exp_avg"].copy_(m)  # rounded to bf16 here: an fp32 moment would not round
                st["exp_avg_sq"].copy_(v)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                denom = (st["exp_avg_sq"].float() / (1 - b2**t)).sqrt_().add_(g["eps"])
                p.addcdiv_(st["exp_avg"].float(), denom, value=-g["lr"] / (1 - b1**t))
