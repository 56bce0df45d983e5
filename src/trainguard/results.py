"""Records returned by the manager: a committed save, the phases of a restore."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SaveResult:
    """Outcome of one committed save.

    Attributes:
        step: the step saved.
        bytes: stored bytes of every chunk the checkpoint references (delta bases included).
        bytes_written: bytes actually written (chunks already present are not written again).
        block_s: seconds the caller was blocked.
        persist_s: seconds from the start of the save to the commit.
        new_bytes: stored bytes this save added (fixed at save time; ``bytes_written`` of all ranks).
        logical_bytes: bytes of the checkpoint's tensors and stored values as in memory.
    """

    step: int
    bytes: int
    bytes_written: int
    block_s: float
    persist_s: float
    new_bytes: int = 0
    logical_bytes: int = 0


@dataclass
class RestoreTimings:
    """Phases of the last restore, in seconds (joined into time-to-resume by the supervisor)."""

    scan_s: float = 0.0
    load_s: float = 0.0
    validate_s: float = 0.0
    bytes: int = 0
    verify_bytes: int = 0
    """Bytes read by the CRC32C pass before loading (one process; 0 under torch.distributed)."""
    skipped: list[dict[str, Any]] = field(default_factory=list)
