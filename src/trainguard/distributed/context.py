"""Rank, world size and the process groups trainguard uses for its own collectives.

Every rank must construct its ``CheckpointManager`` (collectively, in the same order), because the manager
creates two gloo groups with ``dist.new_group``:

- ``io_group``: DCP's save and load collectives. Async saves run them from the background thread, so they never
  share a group with the training loop's collectives (or NCCL).
- ``ctl_group``: small decisions taken from the training thread (a time-based save policy's decision, a
  preemption flag, the step restore_latest chose), so they never interleave with a background save on
  ``io_group``.

Control messages are int64 tensors (no pickle).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class DistContext:
    """Single process when torch.distributed is not initialized; otherwise this rank's view of the job."""

    def __init__(self) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.io_group: Any = None
        self.ctl_group: Any = None
        if self.enabled:
            self.io_group = dist.new_group(backend="gloo")
            self.ctl_group = dist.new_group(backend="gloo")

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def dcp_kwargs(self) -> dict[str, Any]:
        """How ``dcp.save``/``dcp.load`` reach the other ranks: our ``io_group``, or ``no_dist`` alone."""
        return {"process_group": self.io_group} if self.enabled else {"no_dist": True}

    def broadcast_ints(self, values: list[int] | None) -> list[int]:
        """Rank 0's list of ints on every rank (``values`` is ignored elsewhere)."""
        if not self.enabled:
            return list(values or [])
        n = torch.tensor([len(values or []) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.ctl_group)
        buf = (
            torch.tensor(values or [], dtype=torch.int64)
            if self.rank == 0
            else torch.empty(int(n), dtype=torch.int64)
        )
        if int(n):
            dist.broadcast(buf, src=0, group=self.ctl_group)
        return [int(x) for x in buf.tolist()]

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any rank."""
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctl_group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.ctl_group)
