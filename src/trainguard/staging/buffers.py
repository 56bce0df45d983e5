"""Double-buffered staging of a flat state (``{fqn: tensor | value}``) into host memory.

Invariants:
- After :meth:`BufferSet.stage` returns, the staged copy shares no memory with the live state: an optimizer
  step right after cannot leak into the checkpoint. Tensors are copied into buffers owned by the set; values
  are encoded (JSON or weights-only torch bytes) at once, so a value that cannot be stored fails in the
  caller's thread.
- Buffers are allocated once per (fqn, shape, dtype) and reused by later saves (first-touch page faults cost
  5-10x a memcpy into reused memory: NOTES.md). Entries that disappear from the state are released.
- On CUDA, buffers are pinned and copies are non-blocking, each on the current stream of its source tensor's
  device (where ``copy_`` runs it), then every such stream is synchronized once: a tensor on a device other
  than the current one (``model.to(f"cuda:{local_rank}")`` without ``torch.cuda.set_device``) is waited for
  too.
- A staged DTensor keeps its staged local tensor in host memory: it is rebuilt from the buffer and the source's
  spec (``DTensor.from_local`` would move the buffer back to the mesh's device, a second device copy of
  every shard held while the save persists).
- At most ``num_sets`` buffer sets exist; host memory used is ``num_sets`` x the state's tensor bytes at most
  and is reported by :attr:`Stager.nbytes`.

DCP's ``BlockingAsyncStager(cache_staged_state_dict=True)`` is close, but it keeps one cache that never adapts
when the state's structure changes (an optimizer's state appears after its first step), always pins (fails on
CPU-only builds) and shares non-tensor values by reference; so trainguard stages itself.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._lazy import dtensor_type, is_dtensor
from ..state.values import EncodedValue, encode_value
from ..storage.local import DIRECT_IO_MIN_BYTES, aligned_empty


class BufferSet:
    """One set of staging buffers. Not thread-safe by itself: the Stager hands a set to one save at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.buffers: dict[str, torch.Tensor] = {}
        self._pinned: dict[str, bool] = {}  # fqn -> whether its buffer was allocated pinned

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _buffer(self, fqn: str, src: torch.Tensor) -> torch.Tensor:
        """The buffer for ``fqn``: reused while shape, dtype and pinning (pinned for a CUDA source) match;
        a tensor that moved between host and device gets a new one."""
        pin = src.device.type == "cuda" and torch.cuda.is_available()
        buf = self.buffers.get(fqn)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or self._pinned.get(fqn) != pin:
            buf = _empty(src, pin)
            self.buffers[fqn] = buf
            self._pinned[fqn] = pin
        return buf

    def stage(self, flat: dict[str, Any]) -> dict[str, Any]:
        """Copy ``flat`` into this set's buffers and return the staged flat dict (same keys)."""
        out: dict[str, Any] = {}
        devices: set[torch.device] = set()  # CUDA devices with copies in flight
        for fqn, v in flat.items():
            if is_dtensor(v):
                local = v.to_local()
                buf = self._copy(fqn, local, devices)
                # the source's spec as it is (mesh, placements, global shape and stride), the buffer as the local
                # tensor: ``from_local`` would copy a host buffer back to a CUDA mesh's device
                out[fqn] = dtensor_type()(buf, v._spec, requires_grad=False)  # noqa: SLF001 - no public way
            elif isinstance(v, torch.Tensor):
                out[fqn] = self._copy(fqn, v, devices)
            else:
                out[fqn] = EncodedValue(
                    encode_value(v, fqn)
                )  # a snapshot, and unsafe values fail here, early
        for stale in set(self.buffers) - set(flat):
            del self.buffers[stale]
            self._pinned.pop(stale, None)
        synchronize(devices)
        return out

    def _copy(self, fqn: str, src: torch.Tensor, devices: set[torch.device]) -> torch.Tensor:
        """Copy ``src`` into its buffer (non-blocking from a CUDA device, whose device joins ``devices``)."""
        buf = self._buffer(fqn, src)
        cuda = src.device.type == "cuda"
        if cuda:
            devices.add(src.device)
        buf.copy_(src.detach(), non_blocking=cuda)
        return buf


def _empty(src: torch.Tensor, pin: bool) -> torch.Tensor:
    """A new contiguous buffer shaped like ``src``. One in pageable host memory of ``DIRECT_IO_MIN_BYTES`` or
    more starts on a ``DIRECT_IO_ALIGN`` boundary (:func:`~trainguard.storage.local.aligned_empty`), so its
    chunks are written with direct I/O straight from it, without a bounce copy (pinned memory comes
    page-aligned from the CUDA host allocator)."""
    if pin or src.numel() * src.element_size() < DIRECT_IO_MIN_BYTES:
        return torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
    return torch.from_numpy(aligned_empty(src.numel() * src.element_size())).view(src.dtype).view(src.shape)


def synchronize(devices: set[torch.device]) -> None:
    """Wait for the non-blocking copies from each CUDA device of ``devices``: a device-to-host ``copy_`` runs
    on the current stream of its source's device (not of the current device), so each of those streams is
    synchronized."""
    for d in sorted(devices, key=str):
        torch.cuda.current_stream(d).synchronize()


class Stager:
    """Hands out free buffer sets: ``acquire`` blocks (or returns None) while all ``num_sets`` are in use.

    Args:
        num_sets: 2 for double buffering (a save can stage while the previous one persists), 1 to stage only
            when no save is persisting.
    """

    def __init__(self, num_sets: int = 2) -> None:
        if num_sets < 1:
            raise ValueError(f"num_sets must be >= 1, got {num_sets}")
        self.sets = [BufferSet(i) for i in range(num_sets)]
        self._free = list(self.sets)
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Host bytes held by all staging buffers."""
        return sum(s.nbytes for s in self.sets)

    def acquire(self, *, block: bool = True, timeout: float | None = None) -> BufferSet | None:
        with self._cond:
            if not block and not self._free:
                return None
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                return None
            return self._free.pop(0)

    def release(self, s: BufferSet) -> None:
        with self._cond:
            if not any(x is s for x in self.sets):  # replaced after its save was abandoned: never reused
                return
            self._free.append(s)
            self._free.sort(key=lambda x: x.index)
            self._cond.notify_all()

    def replace(self, s: BufferSet) -> None:
        """Put a fresh, free set in place of ``s``, whose save was abandoned while a stuck thread may still
        read it (``s`` is never handed out again; its memory goes when that thread drops it)."""
        with self._cond:
            for i, x in enumerate(self.sets):
                if x is s:
                    self.sets[i] = BufferSet(s.index)
                    self._free.append(self.sets[i])
                    self._free.sort(key=lambda b: b.index)
                    self._cond.notify_all()
                    return
