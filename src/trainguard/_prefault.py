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
MADV_DONTNEED = 4
"""Drop a private anonymous range's pages: the next touch maps zero-filled ones, as if never written."""
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


def _whole_pages(start: int, nbytes: int) -> tuple[int, int]:
    """The first and the end address of the whole pages inside ``[start, start + nbytes)`` (equal when there
    is none): the partial pages at the two ends may hold other data (an allocator's header, a neighbour)."""
    return -(-start // PAGE) * PAGE, (start + nbytes) // PAGE * PAGE


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
    first, _ = _whole_pages(start, len(view))
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


_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore's residency bit of each page (the others are reserved)


def _field_kib(path: str, name: bytes) -> int | None:
    """The value in KiB of the line ``name`` (``b"SwapTotal:"``) of a /proc file; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.startswith(name):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def swap_configured() -> bool:
    """Whether pages of this process may be swapped out: the machine has swap space (``SwapTotal`` in
    ``/proc/meminfo``) or this process has pages in swap now (``VmSwap`` in ``/proc/self/status``: a container
    whose ``/proc/meminfo`` is rewritten, e.g. by LXCFS, can show no swap on a host that swaps). True where
    either cannot be read: a page swapped out is not resident either, so :func:`never_written` cannot tell it
    from a page never written."""
    total = _field_kib("/proc/meminfo", b"SwapTotal:")
    mine = _field_kib("/proc/self/status", b"VmSwap:")
    return total != 0 or mine != 0  # None (unknown) counts as swap


def never_written(view: memoryview, maps: MemoryMaps) -> bool:
    """Whether ``view``'s whole pages (at least one) are memory this process allocated and never wrote: they
    lie in private anonymous mappings (``maps``: not a file, not shared memory, whose absent pages would hold
    data), none is resident (one ``mincore`` over the range), and the machine has no swap (a page swapped out
    is absent too; checked by the caller once, :func:`swap_configured`), and they are not locked (the
    ``madvise(MADV_DONTNEED)`` that :func:`put_back` needs is tried on them: absent, they lose nothing). Such
    pages hold nothing but zeros, and :func:`put_back` can return them to that state after a read into them
    failed its CRC32C.

    The partial pages at the two ends are not looked at (they hold an allocator's header or a neighbour's
    bytes, so they are resident anyway): a caller that writes there keeps their bytes (:func:`edges`) to
    write them back. False where the calls are missing, for a read-only view or one without a whole page,
    outside such mappings, and when any whole page is resident. Memory whose absent pages are filled by
    someone else on first touch (``userfaultfd``, CRIU's lazy restore) is not told apart.
    """
    target = _target(view, PAGE)
    if target is None:
        return False
    lib, start = target
    first, end = _whole_pages(start, len(view))
    if end <= first or not maps.anonymous_private(start, len(view)):
        return False
    pages = (end - first) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if lib.mincore(first, end - first, vec) != 0 or 1 in bytes(vec).translate(_LOW_BIT):
        return False
    # locked memory (mlock, mlockall(MCL_FUTURE): absent until touched with MCL_ONFAULT) refuses the drop
    # that put_back needs: try it now, on pages that are absent, so it changes nothing
    return bool(lib.madvise(first, end - first, MADV_DONTNEED) == 0)


def edges(view: memoryview) -> tuple[bytes, bytes]:
    """Copies of ``view``'s bytes before its first whole page and after its last (each shorter than a page),
    for :func:`put_back`. ``view``: a writable view with at least one whole page (:func:`never_written`)."""
    start = address(view)
    first, end = _whole_pages(start, len(view))
    if end <= first:  # no whole page: all of it is edge
        return bytes(view), b""
    return bytes(view[: first - start]), bytes(view[end - start :])


def put_back(view: memoryview, kept: tuple[bytes, bytes]) -> bool:
    """Return ``view``, found :func:`never_written` before a read into it, to that state after the read failed:
    its whole pages dropped (``madvise(MADV_DONTNEED)``: zero-filled on the next touch, as before the read),
    the bytes of its partial end pages written back from ``kept`` (:func:`edges`, taken before the read).

    Returns:
        False when the kernel refused to drop the pages (they then hold the read's bytes).
    """
    head, tail = kept
    view[: len(head)] = head
    if tail:
        view[len(view) - len(tail) :] = tail
    target = _target(view, 1)
    if target is None:
        return False
    lib, start = target
    first, end = _whole_pages(start, len(view))
    return end <= first or lib.madvise(first, end - first, MADV_DONTNEED) == 0


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
        self.anonymous: list[bool] = []  # private, writable, no file or shared memory behind it
        try:
            with open("/proc/self/maps", "rb") as f:
                for line in f:
                    fields = line.split(None, 5)
                    span, perms, inode = fields[0], fields[1], fields[4]
                    path = fields[5].strip() if len(fields) > 5 else b""
                    a, _, b = span.partition(b"-")
                    self.starts.append(int(a, 16))
                    self.ends.append(int(b, 16))
                    self.write.append(perms[1:2] == b"w")
                    self.anonymous.append(
                        perms[1:2] == b"w"
                        and perms[3:4] == b"p"
                        and inode == b"0"
                        and path in (b"", b"[heap]")
                    )
        except (OSError, ValueError, IndexError):
            self.starts, self.ends, self.write, self.anonymous = [], [], [], []

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

    def anonymous_private(self, start: int, nbytes: int) -> bool:
        """True when ``[start, start + nbytes)`` lies in private anonymous writable mappings only (the heap, or
        ``mmap(MAP_PRIVATE | MAP_ANONYMOUS)``: what ``malloc`` and torch's CPU allocator hand out). False for
        file mappings, shared memory, gaps, and where the snapshot is empty."""
        end = start + nbytes
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0 or self.ends[i] <= start:
            return False
        while True:
            if not self.anonymous[i]:
                return False
            if self.ends[i] >= end:
                return True
            if i + 1 >= len(self.starts) or self.starts[i + 1] != self.ends[i]:
                return False  # a gap: not one allocation
            i += 1
