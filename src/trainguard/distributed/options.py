"""``WriterOptions``: how a save cuts the state into chunks (kept apart from the DCP writer, which imports DCP:
a manager is built without importing it)."""

from __future__ import annotations

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
