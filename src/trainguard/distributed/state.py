"""``ModelOptimizerState``: a model and its optimizer as one Stateful, through DCP's ``get_state_dict`` /
``set_state_dict``, which handle sharded parameters (FSDP2 ``fully_shard``, DTensor) and key the optimizer's
state by parameter name (so it reshards across world sizes), and initialize an optimizer that has not stepped
yet so that its state is restored, not silently skipped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..state.matching import canonical_name
from ..state.optim import restore_saved_dtypes


class ModelOptimizerState:
    """Stateful wrapper: ``state = {"app": ModelOptimizerState(model, optim), ...}``.

    Args:
        model: the (possibly FSDP2-sharded) module.
        optimizer: its optimizer, or None for the model alone.
        options: DCP ``StateDictOptions`` (default: sharded state, strict).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            msd, _ = get_state_dict(self.model, [], options=self.options)
            return {"model": msd}
        msd, osd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": msd, "optim": osd}

    def params_by_name(self) -> dict[str, torch.Tensor]:
        """Parameter FQN as in ``state_dict()["optim"]`` (wrapper prefixes removed, as DCP names them) -> the
        live parameter."""
        import torch.distributed.checkpoint.state_dict as dsd

        get_fqns = getattr(dsd, "_get_fqns", None)  # private DCP helper; the same rule without it
        out: dict[str, torch.Tensor] = {}
        for name, p in self.model.named_parameters():
            for fqn in get_fqns(self.model, name) if callable(get_fqns) else {canonical_name(name)}:
                out[fqn] = p
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load ``{"model": ..., "optim": ...}`` through DCP's ``set_state_dict``; optimizer state keeps the dtype
        it was saved with (torch casts it to the parameter dtype; that cast is undone)."""
        if self.optimizer is None:
            set_state_dict(
                self.model, [], model_state_dict=sd["model"], optim_state_dict={}, options=self.options
            )
        else:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optim"],
                options=self.options,
            )
            restore_saved_dtypes(self.optimizer, sd["optim"], self.params_by_name())
