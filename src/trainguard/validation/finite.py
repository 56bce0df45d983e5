"""NaN/Inf scans of floating tensors (the save path's ``check_finite`` and the scan after a load).

The scan runs where the data already is: in the persist path on the staged copy (the background thread for
async saves, so the training thread gains no stall) and on the tensors a restore just loaded. It works in
blocks of ``BLOCK_ELEMS`` elements so that its temporary memory stays bounded (a few MiB) whatever the tensor
size.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

BLOCK_ELEMS = 1 << 22  # elements per block of the exact count (bounded temporary memory: 4 Mi bools)
NAMES_SHOWN = 8  # tensors named in an error message (the rest are counted)
SCAN_BLOCK_BYTES = (
    1 << 20
)  # bytes per block of the certain-finite test (two reductions, the second from cache)
HALF_BLOCK_ELEMS = SCAN_BLOCK_BYTES // 2  # 16-bit floats: elements per block of that test
# 16-bit floats whose bits, sign cleared, are at least this are NaN or +-Inf (the exponent all ones)
_HALF_NONFINITE = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.complex32: 0x7C00}
# the NumPy view of a dtype's bytes that :func:`_numpy_finite` tests (16-bit floats as their bit patterns)
_NUMPY_VIEW = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.float32,
    torch.complex128: np.float64,
    torch.bfloat16: np.uint16,
    torch.float16: np.uint16,
    torch.complex32: np.uint16,  # two float16 parts per element
}
# floating dtypes with no NaN or Inf encoding (and no conversion to float32 on CPU to count them with)
_NO_NONFINITE = frozenset(d for d in (getattr(torch, "float4_e2m1fn_x2", None),) if d is not None)


def _local(v: Any) -> torch.Tensor | None:
    """The local tensor of ``v`` (a tensor or a DTensor's local shard), or None for anything else."""
    if isinstance(v, torch.Tensor):
        to_local = getattr(v, "to_local", None)
        if callable(to_local) and type(v).__name__ == "DTensor":
            v = to_local()
        return v
    return None


def count_nonfinite(t: torch.Tensor) -> int:
    """Number of NaN/+Inf/-Inf values in ``t`` (0 for non-floating dtypes).

    Args:
        t: any tensor (floating or complex ones are scanned; integer and bool ones hold no NaN).

    Returns:
        The count of non-finite elements.
    """
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0 or t.dtype in _NO_NONFINITE:
        return 0
    flat = t.detach().reshape(-1)
    if all_finite_cpu(flat):
        return 0
    bad = 0
    for start in range(0, flat.numel(), BLOCK_ELEMS):
        block = flat[start : start + BLOCK_ELEMS]
        if block.element_size() == 1:  # float8: CPU has no reductions for it; float32 holds every value
            block = block.float()
        elif block.dtype == torch.complex32:  # no CPU reductions either; complex64 holds every value
            block = block.to(torch.complex64)
        # Fast path: one reduction, no temporary: a NaN or Inf anywhere makes the sum non-finite. A non-finite
        # sum of finite values (overflow) falls through to the exact count, which then finds none.
        if bool(torch.isfinite(block.sum())):
            continue
        bad += int((~torch.isfinite(block)).sum())
    return bad


def all_finite_cpu(flat: torch.Tensor) -> bool:
    """True when a 1-D CPU tensor of a common float dtype holds no NaN/Inf; False when it does (or when the
    dtype, device or layout is not handled here: the caller then counts exactly).

    Runs in NumPy in the calling thread: no intra-op worker threads, which on a busy machine spin and multiply
    the CPU time of this memory-bound pass (measured: 1 GiB of fp32/bf16 tensors, torch reductions with 2
    threads 0.13-0.63 s of CPU, this 0.07-0.08 s). See :func:`_numpy_finite` for the test."""
    if flat.device.type != "cpu" or flat.is_conj() or flat.is_neg() or not flat.is_contiguous():
        return False
    np_dtype = _NUMPY_VIEW.get(flat.dtype)
    if np_dtype is None:
        return False
    return _numpy_finite(byte_view(flat).numpy().view(np_dtype), flat.dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor (no conjugate or negative bit) as a 1-D uint8 tensor of ``t.nbytes``
    elements sharing its memory (writes through it land in ``t``).

    A one-element tensor is contiguous whatever its stride (``x[:, 0]`` of a ``(1, n)`` ``x`` has stride
    ``(n,)``), which ``Tensor.view(torch.uint8)`` refuses: it is given stride 1 first (same element)."""
    if not t.numel():
        return torch.empty(0, dtype=torch.uint8)
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def count_nonfinite_buffer(view: memoryview, dtype: torch.dtype) -> int:
    """Number of NaN/+Inf/-Inf values among the elements of ``dtype`` packed in ``view`` (CPU bytes, a whole
    number of elements; 0 for non-floating dtypes).

    The restore's reading threads call this on each block of a chunk as it lands (1 MiB, see
    ``ChunkStore.readinto``): the certain-finite test runs on the bytes themselves in NumPy, with no tensor
    made per block (measured: 2 GiB of fp32/bf16 in 1 MiB blocks, 4 threads on 2 cores, 0.43-0.73 s of CPU
    against 0.97-1.30 s through :func:`count_nonfinite`); only a block it cannot clear is counted exactly by
    :func:`count_nonfinite`.

    Raises:
        ValueError: ``len(view)`` is not a multiple of ``dtype``'s element size.
    """
    if not (dtype.is_floating_point or dtype.is_complex) or len(view) == 0 or dtype in _NO_NONFINITE:
        return 0
    np_dtype = _NUMPY_VIEW.get(dtype)
    if np_dtype is not None and _numpy_finite(np.frombuffer(view, dtype=np_dtype), dtype):
        return 0
    return count_nonfinite(torch.frombuffer(view, dtype=torch.uint8).view(dtype))


def _numpy_finite(values: np.ndarray, dtype: torch.dtype) -> bool:
    """True when ``values`` (the elements of a ``dtype`` tensor as :data:`_NUMPY_VIEW` gives them) hold no
    NaN/Inf; exact (no false alarm), in blocks of :data:`SCAN_BLOCK_BYTES` so that each block's second
    reduction reads it from the CPU cache.

    32/64-bit floats (complex ones as their real and imaginary parts): the block's largest and smallest value
    are finite (NumPy's ``max``/``min`` propagate NaN; +Inf is the largest, -Inf the smallest). bfloat16,
    float16 and complex32 (two float16 parts), as their bit patterns: a non-finite value has every exponent bit
    set, which makes the pattern at least ``limit`` (``0x7F80``/``0x7C00``) read as a signed 16-bit integer
    when positive, and at least ``limit | 0x8000`` read as an unsigned one when negative; every finite pattern
    is below both (no float arithmetic on 16-bit values).

    Measured on this project's 2-core VM (benchmarks/RESULTS.md, "NaN/Inf scan by max and min"): 1.4-2x the
    block sums and bit masks this replaced, e.g. bfloat16 from memory 8.5 vs 4.5 GB/s, float32 from the CPU
    cache 19 vs 10.5 GB/s."""
    if values.size == 0:
        return True
    step = max(1, SCAN_BLOCK_BYTES // values.itemsize)
    limit = _HALF_NONFINITE.get(dtype)
    if limit is not None:
        signed = values.view(np.int16)
        negative = limit | 0x8000
        for start in range(0, values.size, step):
            end = start + step
            if int(values[start:end].max()) >= negative or int(signed[start:end].max()) >= limit:
                return False
        return True
    for start in range(0, values.size, step):
        block = values[start : start + step]
        if not (np.isfinite(block.max()) and np.isfinite(block.min())):
            return False
    return True


def scan(
    flat: Mapping[str, Any], only: Sequence[str] | None = None, known: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Every floating tensor of ``flat`` holding NaN or Inf, with its count of bad values.

    Args:
        flat: fully qualified name -> value (tensors, DTensors; other values are ignored).
        only: scan only the names equal to or under one of these entries (``"lightning.state_dict"`` covers
            ``"lightning.state_dict.layer.weight"``); None: every name. See :func:`in_scope`.
        known: name -> count for tensors already scanned (a restore's reading threads scan each tensor as
            its chunks land): taken as is, not scanned again.

    Returns:
        name -> count of non-finite values, only for tensors with at least one (empty when all are finite).
    """
    out: dict[str, int] = {}
    for name, v in flat.items():
        if not in_scope(name, only):
            continue
        if known is not None and name in known:
            n = known[name]
        else:
            t = _local(v)
            if t is None:
                continue
            n = count_nonfinite(t)
        if n:
            out[name] = n
    return out


def in_scope(name: str, only: Sequence[str] | None) -> bool:
    """Whether the flat name ``name`` is checked when the check is scoped to the entries ``only``.

    Args:
        name: a fully qualified name (``"lightning.state_dict.layer.weight"``).
        only: entry names (dotted prefixes, ``"lightning.state_dict"``); None: everything is in scope.

    Returns:
        True for ``only=None`` or a name equal to an entry or under it (a prefix followed by ``"."``).
    """
    if only is None:
        return True
    return any(name == p or name.startswith(p + ".") for p in only)


def describe(bad: Mapping[str, int]) -> str:
    """``"model.w (3 non-finite values), ..."`` for an error message (at most NAMES_SHOWN names)."""
    items = sorted(bad.items())
    parts = [f"{name} ({n} non-finite value{'s' if n != 1 else ''})" for name, n in items[:NAMES_SHOWN]]
    if len(items) > NAMES_SHOWN:
        parts.append(f"and {len(items) - NAMES_SHOWN} more tensors")
    return ", ".join(parts)


class SaveScan:
    """The ``check_finite`` scan of one save's own-chunk tensors, run by the writer threads as each tensor's
    chunks are stored (beside the other threads' writes), with a memory across saves: a tensor whose chunks
    (content hashes, one per piece) and dtype equal those it had when it was last scanned finite is finite
    without a scan, so an unchanged state costs its hashing only.

    Args:
        memory: fqn -> (dtype, chunk hashes) of tensors found finite, kept by the caller across saves (a chunk
            hash names one decoded content, so equal hashes mean equal bytes).
        only: the names in scope (:func:`in_scope`).

    Thread-safe: :meth:`tensor` may run from many threads at once.
    """

    def __init__(self, memory: dict[str, tuple[str, tuple[str, ...]]], only: Sequence[str] | None) -> None:
        self.known: dict[str, int] = {}  # fqn -> count of non-finite values, for :func:`scan`'s ``known``
        self.skipped = 0  # tensors found finite by the memory, not scanned
        self._memory = memory
        self._only = only
        self._lock = threading.Lock()

    def tensor(self, fqn: str, t: torch.Tensor, hashes: tuple[str, ...]) -> None:
        """Scan ``t`` (the tensor saved as ``fqn``, stored as the chunks ``hashes``) unless the memory says its
        bytes were found finite before; record the count in :attr:`known`."""
        if not in_scope(fqn, self._only):
            return
        key = (str(t.dtype), hashes)
        with self._lock:
            same = self._memory.get(fqn) == key
        n = 0 if same else count_nonfinite(t)
        with self._lock:
            self.known[fqn] = n
            self.skipped += same
            if n == 0:
                self._memory[fqn] = key
            else:
                self._memory.pop(fqn, None)
