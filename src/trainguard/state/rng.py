"""``RNGState``: every random number generator a training step draws from, as one Stateful object."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RNGState:
    """Captures and restores Python ``random``, numpy's global RNG, the torch CPU RNG and every CUDA device's RNG.

    ``state_dict()`` returns tensors (uint8 torch states, int64 Mersenne Twister keys) and plain numbers, so the
    state is stored without pickle. Restoring onto a machine with fewer CUDA devices than were saved restores
    the devices that exist (and logs nothing: the rest cannot be used there anyway).
    """

    def state_dict(self) -> dict[str, Any]:
        """This process's RNG states; under torch.distributed keyed ``rank_<r>`` (ranks draw different numbers,
        so each rank's state is saved on its own)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return {f"rank_{dist.get_rank()}": self._local_state()}
        return self._local_state()

    def _local_state(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        out: dict[str, Any] = {
            "python": {
                "version": int(version),
                "state": torch.tensor(internal, dtype=torch.int64),
                "gauss": gauss,
            },
            "numpy": {
                "name": str(name),
                "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore this process's RNGs. From a per-rank state, this rank's entry is used; a rank that did not
        exist when the checkpoint was saved (the world grew) takes rank 0's and logs a warning, since no exact
        continuation exists for it."""
        if any(str(k).startswith("rank_") for k in sd):
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            if f"rank_{rank}" not in sd:
                import logging

                logging.getLogger("trainguard").warning(
                    "no RNG state saved for rank %d (saved: %s); using rank 0's", rank, sorted(sd)
                )
            sd = sd.get(f"rank_{rank}", sd.get("rank_0", next(iter(sd.values()))))
        py = sd["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        n = sd["numpy"]
        np.random.set_state(
            (
                n["name"],
                n["keys"].numpy().astype(np.uint32),
                int(n["pos"]),
                int(n["has_gauss"]),
                float(n["cached_gaussian"]),
            )
        )
        torch.set_rng_state(sd["torch"].to(torch.uint8).cpu())
        cuda = sd.get("cuda")
        if cuda and torch.cuda.is_available():
            for i, st in enumerate(cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(st.to(torch.uint8).cpu(), i)

    def __repr__(self) -> str:
        return "RNGState()"
