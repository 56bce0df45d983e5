"""Integrity: CRC32C per chunk, the verify scrub."""
