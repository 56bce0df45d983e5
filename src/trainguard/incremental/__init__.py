"""Content-addressed chunk store (and, later, delta/compression codecs)."""

from .chunkstore import ChunkStore

__all__ = ["ChunkStore"]
