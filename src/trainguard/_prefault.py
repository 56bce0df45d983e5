"""Fault in a restore's destination pages before a read fills them (Linux 5.14+, ``MADV_POPULATE_WRITE``).

A relaunched job restores into tensors it has just allocated (``torch.empty``, a model built on the meta device
then materialized): none of their pages exists yet, so the ``read`` that fills them takes one page fault per
4 KiB page inside the kernel's copy. On the 2-core VM of benchmarks/RESULTS.md a 500 MiB read from the page
cache took 0.27 s into fresh memory and 0.09 s into touched memory. ``madvise(MADV_POPULATE_WRITE)`` on the
range first (one system call per block: the kernel maps the block's pages in one walk, without a trap into
the kernel per page, and changes no byte) cut it to 0.20 s ("Restore into fresh memory" there).

Memory that is already there (a live model restored in place, a rollback, pinned host buffers) gains nothing and
the walk would cost ~15% of a cached read, so a chunk's destination is populated (block by block) only when
``mincore`` says its first whole page is not resident. Where the calls are missing (not Linux, no libc, a
kernel before 5.14: probed once per process on a page of its own), this does nothing and the read faults as
before.

Who gains: tensors allocated and not yet written (``torch.empty``, a model built on the meta device and
materialized with ``to_empty``), of more than glibc's mmap threshold (up to 32 MiB; smaller ones may reuse
freed, resident heap memory). A model whose weights were initialized (``nn.Linear(...)``) is resident already:
its restore reads as before. With transparent huge pages set to ``always``, one block's call may map a whole
2 MiB page, which can make the next chunk's first page look resident; that chunk then faults as before (a
2 MiB fault each, cheap), never wrongly.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
import threading
from typing import Any

MADV_POPULATE_WRITE = 23
"""``include/uapi/asm-generic/mman-common.h`` (Linux 5.14)."""
PAGE = mmap.PAGESIZE

_libc: Any = None
_enabled = sys.platform.startswith("linux")
_lock = threading.Lock()


def _open_libc() -> Any:
    lib = ctypes.CDLL(None, use_errno=True)  # the interpreter's own symbols, libc's among them
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


def _supported(lib: Any) -> bool:
    """One ``madvise(MADV_POPULATE_WRITE)`` on a page of private anonymous memory: a kernel before 5.14
    answers EINVAL. (EINVAL later, on a real destination, means that range only: read-only or I/O memory.)"""
    page = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        anchor = ctypes.c_char.from_buffer(page)
        try:
            return bool(lib.madvise(ctypes.addressof(anchor), PAGE, MADV_POPULATE_WRITE) == 0)
        finally:
            del anchor
    finally:
        page.close()


def _load() -> Any:
    """libc with ``mincore`` and ``madvise``, once the kernel was found to know the advice; else None."""
    global _libc, _enabled
    if _libc is None and _enabled:
        with _lock:
            if _libc is None and _enabled:
                try:
                    lib = _open_libc()
                    _enabled = _supported(lib)
                    _libc = lib
                except (OSError, AttributeError, ValueError):
                    _enabled = False
    return _libc if _enabled else None


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (a writable, C-contiguous buffer of at least one byte)."""
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # releases the export: the caller may release ``view`` afterwards


def _target(view: memoryview, min_bytes: int) -> tuple[Any, int] | None:
    """libc and the address of ``view``, or None where the calls are missing, ``view`` is read-only or it is
    shorter than ``min_bytes``."""
    if not _enabled or view.readonly or len(view) < min_bytes:
        return None
    lib = _load()
    return None if lib is None else (lib, address(view))


def unmapped(view: memoryview) -> bool:
    """Whether ``view`` looks like fresh memory: its first whole page is not resident (``mincore``).

    False where the calls are missing, for a read-only view, and for a view shorter than two pages (a range
    that small gains nothing). One system call.
    """
    target = _target(view, 2 * PAGE)
    if target is None:
        return False
    lib, start = target
    first = -(-start // PAGE) * PAGE  # the first whole page: the page before may hold other data already
    resident = (ctypes.c_ubyte * 1)()  # per call: reading threads run this side by side
    return lib.mincore(first, PAGE, resident) == 0 and not resident[0] & 1


def populate_for_write(view: memoryview) -> bool:
    """Map the pages under ``view`` for writing, in one ``madvise(MADV_POPULATE_WRITE)`` call, without changing
    a byte. Meant for a block of a range that :func:`unmapped` found fresh, right before a read fills it (the
    pages are zeroed while the block is still in the CPU cache).

    Returns:
        True when the range was populated; False where the calls are missing or the kernel refused this range
        (out of memory, read-only or I/O memory: the read that follows faults as it would have, and reports
        what it meets).
    """
    target = _target(view, 1)
    if target is None:
        return False
    lib, start = target
    begin = start - start % PAGE
    return bool(lib.madvise(begin, start + len(view) - begin, MADV_POPULATE_WRITE) == 0)


class MemoryMaps:
    """A snapshot of this process's memory mappings (``/proc/self/maps``): which address ranges are read-only.

    Built once per restore (a process with torch has a few thousand mappings: ~1-3 ms), before anything is
    written, so that a destination tensor over a read-only mapping (``np.memmap(mode="r")``, a file mapped
    read-only) is refused with a clear error instead of crashing the process in a copy (SIGSEGV) or failing
    a read with EFAULT. Where ``/proc/self/maps`` cannot be read (not Linux), every range counts as writable.
    """

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.write: list[bool] = []
        try:
            with open("/proc/self/maps", "rb") as f:
                for line in f:
                    span, perms = line.split(None, 2)[:2]
                    a, _, b = span.partition(b"-")
                    self.starts.append(int(a, 16))
                    self.ends.append(int(b, 16))
                    self.write.append(perms[1:2] == b"w")
        except (OSError, ValueError):
            self.starts, self.ends, self.write = [], [], []

    def read_only(self, start: int, nbytes: int) -> bool:
        """True when a mapping overlapping ``[start, start + nbytes)`` has no write permission. Addresses in no
        mapping (or no snapshot) are not reported: only what is known to be read-only is."""
        end = start + nbytes
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.starts) and self.starts[i] < end:
            if self.ends[i] > start and not self.write[i]:
                return True
            i += 1
        return False
