"""The on-disk format: manifest records, JSON (de)serialization, path layout and path validation.

docs/FORMAT.md is the contract; this package is its only implementation.
"""

from .layout import (
    CHUNKS_DIR,
    MANIFEST_NAME,
    chunk_relpath,
    parse_step_dir,
    partial_dir_name,
    step_dir_name,
    validate_relpath,
)
from .manifest import (
    FORMAT_VERSION,
    ChunkRecord,
    Manifest,
    Segment,
    ShardRecord,
    TensorEntry,
    ValueEntry,
    manifest_from_json,
    manifest_to_json,
)

__all__ = [
    "CHUNKS_DIR",
    "MANIFEST_NAME",
    "FORMAT_VERSION",
    "ChunkRecord",
    "Manifest",
    "Segment",
    "ShardRecord",
    "TensorEntry",
    "ValueEntry",
    "chunk_relpath",
    "manifest_from_json",
    "manifest_to_json",
    "parse_step_dir",
    "partial_dir_name",
    "step_dir_name",
    "validate_relpath",
]
