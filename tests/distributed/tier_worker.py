"""Worker of the tier tests under torchrun (gloo, CPU): ``tier_worker.py SCENARIO SPEC.json OUT``, run by
tests/tiers/test_tiers_distributed.py; the job, the result files and ``main`` are worker.py's. Scenarios:

- ``tier_save``: the FSDP2 job of worker.py saves step 2 to a shared hot root with an S3 tier (moto), each
  rank's tier given as a Storage that records this rank's PUTs in order; rank 0 writes the full state of the
  step to ``OUT/ref-2.pt``; after close every rank reports its PUTs, and rank 0 the step's chunks and who
  uploaded (the ``tier_upload`` events' ranks).
- ``tier_load``: a new node (an empty hot root) restores the newest step from the tier at this world size
  into a fresh job (a writing manager); rank 0 compares the full state with ``ref-<step>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.recovery.events import read_events
from trainguard.storage import FaultyStorage, open_object_storage

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker  # noqa: E402 - a plain script beside this one

PROBE = ".trainguard-write-probe-"


class Recording(FaultyStorage):
    """A FaultyStorage without faults that records the keys this rank PUT, in order."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.puts: list[str] = []

    def publish(self, key: str, data: bytes, *, durable: bool = True) -> None:
        super().publish(key, data, durable=durable)
        if not key.startswith(PROBE):  # each writing rank's construction check
            self.puts.append(key)


def scenario_tier_save(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    job = worker.build(rank, ws)
    tier = Recording(open_object_storage(spec["url"]))
    mgr = tg.CheckpointManager(root, tiers=[tg.Tier(tier)])
    for _ in range(2):
        worker.train_step(job)
    mgr.save(2, job["state"]).wait()
    saved = {"rng": worker.rng_digest(), "loader": job["loader"].state_dict()}
    full = worker.full_state(job)
    if rank == 0:
        torch.save(full, out / "ref-2.pt")
    mgr.close()  # rank 0 waits for its uploads here
    res: dict[str, Any] = {"puts": tier.puts, "saved": saved}
    if rank == 0:
        res["chunks"] = sorted(rec.path for rec in read_manifest(root, 2).chunks.values())
        res["uploaders"] = [e.get("rank") for e in read_events(root, event="tier_upload")]
    return res


def scenario_tier_load(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    hot = Path(spec["root"])
    job = worker.build(rank, ws, seed=7)  # other initial weights than the saved job's
    with tg.CheckpointManager(hot, tiers=[tg.Tier(spec["url"])]) as mgr:
        step = mgr.restore_latest(job["state"])
    full = worker.full_state(job)
    diff = (
        worker.differences(full, torch.load(out / f"ref-{step}.pt", weights_only=True)) if rank == 0 else None
    )
    return {
        "step": step,
        "differences": diff,
        "rng": worker.rng_digest(),
        "loader": job["loader"].state_dict(),
        "restored_from_tier": [
            e["step"] for e in read_events(hot, event="tier_restore") if e.get("rank") == rank
        ],
    }


worker.SCENARIOS.update(tier_save=scenario_tier_save, tier_load=scenario_tier_load)

if __name__ == "__main__":
    sys.exit(worker.main())
