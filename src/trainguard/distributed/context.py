"""Rank, world size and the process groups trainguard uses for its own collectives.

A writing manager (and a read-only one opened with ``collective=True``) is collective: every rank must construct
it after ``init_process_group``, in the same order, because it creates two gloo groups with ``dist.new_group``:

- ``io_group``: DCP's save and load collectives. Async saves run them from the background thread, so they never
  share a group with the training loop's collectives (or NCCL).
- ``ctl_group``: small decisions taken from the training thread (a time-based save policy's decision, a
  preemption flag, the step restore_latest chose, the per-rank value digests of a save), so they never
  interleave with a background save on ``io_group``.

Both groups use the timeout the user gave ``init_process_group`` (read from the default group), or the
manager's ``dist_timeout_s``: a dead rank fails trainguard's collectives in the time the user chose, not in
torch's 30-minute default for new groups.

A read-only manager is local by default: it creates no group and calls no collective, so one rank alone may
open it (inspection, export) while the others do something else.

Control messages are int64 / uint8 tensors (no pickle).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist


def default_group_timeout() -> datetime.timedelta | None:
    """The timeout of the default process group (what the user passed to ``init_process_group``), or None when
    it cannot be read (no group, or a backend that does not expose its options)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg: Any = dist.group.WORLD
    for dev in getattr(pg, "_device_types", []) or []:
        try:
            timeout = pg._get_backend(dev).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class DistContext:
    """Single process when torch.distributed is not initialized (or ``collective`` is False); otherwise this
    rank's view of the job.

    Args:
        collective: take part in the job's collectives (create the groups). False: behave as one process.
        timeout_s: timeout of trainguard's own groups, in seconds; None inherits the default group's.

    Attributes:
        timeout: the timeout the groups were created with (None when not enabled).
    """

    def __init__(self, *, collective: bool = True, timeout_s: float | None = None) -> None:
        self.enabled = collective and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world_size = dist.get_world_size() if self.enabled else 1
        self.io_group: Any = None
        self.ctl_group: Any = None
        self.timeout: datetime.timedelta | None = None
        if self.enabled:
            self.timeout = (
                datetime.timedelta(seconds=timeout_s) if timeout_s is not None else default_group_timeout()
            )
            kw: dict[str, Any] = {"backend": "gloo"}
            if self.timeout is not None:
                kw["timeout"] = self.timeout
            self.io_group = dist.new_group(**kw)
            self.ctl_group = dist.new_group(**kw)

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

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (``data`` is ignored elsewhere)."""
        if not self.enabled:
            return bytes(data or b"")
        return bytes(self.broadcast_ints(list(data or b"") if self.rank == 0 else None))

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, index = rank (uint8 tensors: no pickle)."""
        if not self.enabled:
            return [bytes(data)]
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.ctl_group)
        longest = max(int(s) for s in sizes)
        buf = torch.zeros(longest, dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(out, buf, group=self.ctl_group)
        return [o[: int(s)].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]

    def ranks_on_this_node(self) -> int:
        """How many ranks of the job (this one included) run on this rank's host (same ``gethostname``);
        1 when not enabled. Collective on ``ctl_group``."""
        if not self.enabled:
            return 1
        mine = socket.gethostname().encode()
        return sum(1 for h in self.all_gather_bytes(mine) if h == mine)

    def any(self, flag: bool, *, io: bool = False) -> bool:
        """True on every rank if ``flag`` is True on any rank.

        Args:
            flag: this rank's value.
            io: decide on ``io_group`` (from the save/load path, the thread that runs DCP's collectives: the
                background thread of an async save) instead of ``ctl_group`` (the training thread's).
        """
        if not self.enabled:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.io_group if io else self.ctl_group)
        return bool(t.item())
