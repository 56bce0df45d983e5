"""``WriterOptions``: how a save cuts the state into chunks (kept apart from the DCP writer, which imports DCP:
a manager is built without importing it)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """Chunking of a save. Units in bytes; ``threads`` writer threads per rank."""

    chunk_size_bytes: int = 64 << 20
    pack_threshold_bytes: int = 1 << 20
    inline_value_bytes: int = 16 << 10
    threads: int = 4

    def __post_init__(self) -> None:
        if self.chunk_size_bytes < 4096:
            raise ValueError(f"chunk_size_bytes must be >= 4096, got {self.chunk_size_bytes}")
        if not 0 <= self.pack_threshold_bytes <= self.chunk_size_bytes:
            raise ValueError("pack_threshold_bytes must be between 0 and chunk_size_bytes")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")

    def background(self) -> WriterOptions:
        """These options for a save persisted in the background while the training thread runs: at most one
        writer thread fewer than the CPUs this process may use (at least one), so that the training thread
        keeps a core. Measured on 2 cores (benchmarks/RESULTS.md, async overhead): with 4 writer threads the
        training thread waited for a CPU 0.08 s per save (run queue) and lost +1.1-1.5% of throughput; with
        one, 0.0001 s and +0.5%, as ``dcp.async_save`` (one thread). On 5 or more CPUs nothing changes."""
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
        n = max(1, min(self.threads, cpus - 1))
        return self if n == self.threads else dataclasses.replace(self, threads=n)
