"""Run identity: which run wrote a checkpoint, and the runs it descends from (its lineage).

Every writing ``CheckpointManager`` is a new run with a random id. A run that resumed from a checkpoint
records where it came from: its lineage lists each ancestor run with the step it was resumed at, nearest
first (inherited from the resumed checkpoint, so the chain survives when the ancestors' checkpoints are
deleted). A checkpoint belongs to a run's lineage when that run wrote it, or an ancestor wrote it at or before
the step the lineage branched off that ancestor. Retention orders only a run's own lineage, and a run that did
not resume never interleaves its checkpoints with another run's silently (docs/FORMAT.md "Run identity").
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError

_RUN_ID_RE = re.compile(r"[0-9A-Za-z_-]{1,64}")
MAX_LINEAGE = 100_000
LEGACY_RUN_ID = ""  # checkpoints written before run identity was recorded


def new_run_id() -> str:
    """A fresh run id: 16 lowercase hex digits."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class RunInfo:
    """The run that wrote a checkpoint.

    Attributes:
        run_id: the writing run's id (``""`` for checkpoints written before run ids existed).
        lineage: ``(ancestor run id, step it was resumed at)`` pairs, nearest ancestor first.
    """

    run_id: str
    lineage: tuple[tuple[str, int], ...] = ()

    @property
    def resumed_from(self) -> tuple[str, int] | None:
        """``(run id, step)`` this run resumed from, or None for a run that started fresh."""
        return self.lineage[0] if self.lineage else None

    def owns(self, run_id: str, step: int) -> bool:
        """True when the checkpoint of ``step`` written by ``run_id`` is in this run's lineage."""
        if run_id == self.run_id:
            return True
        return any(run_id == a and step <= s for a, s in self.lineage)

    def resume(self, parent: RunInfo | None, step: int) -> RunInfo:
        """This run after resuming from ``parent``'s checkpoint of ``step`` (None: a checkpoint without a run)."""
        parent = parent or RunInfo(LEGACY_RUN_ID)
        return RunInfo(self.run_id, ((parent.run_id, step), *parent.lineage)[:MAX_LINEAGE])

    def to_json(self) -> dict[str, Any]:
        return {"id": self.run_id, "lineage": [[a, s] for a, s in self.lineage]}

    def describe(self) -> str:
        src = self.resumed_from
        return f"run {self.run_id or '(unnamed)'}" + (
            f" (resumed from run {src[0] or '(unnamed)'} at step {src[1]})" if src else " (started fresh)"
        )


def run_from_json(raw: Any, step: int | None = None) -> RunInfo | None:
    """Parse the manifest's ``run`` object (None when absent).

    Raises:
        CorruptCheckpointError: a wrong type, a malformed id or an absurd lineage.
    """
    if raw is None:
        return None

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"corrupt manifest: run {msg}", step=step)

    if not isinstance(raw, dict):
        raise bad("must be an object")
    rid = raw.get("id")
    if not isinstance(rid, str) or not (rid == LEGACY_RUN_ID or _RUN_ID_RE.fullmatch(rid)):
        raise bad(f"id {str(rid)[:80]!r} is not a run id")
    lineage_raw = raw.get("lineage", [])
    if not isinstance(lineage_raw, list) or len(lineage_raw) > MAX_LINEAGE:
        raise bad(f"lineage must be a list of at most {MAX_LINEAGE} [run id, step] pairs")
    lineage = []
    for el in lineage_raw:
        if (
            not isinstance(el, list)
            or len(el) != 2
            or not isinstance(el[0], str)
            or not (el[0] == LEGACY_RUN_ID or _RUN_ID_RE.fullmatch(el[0]))
            or isinstance(el[1], bool)
            or not isinstance(el[1], int)
            or not 0 <= el[1] < 1 << 62
        ):
            raise bad(f"lineage element {str(el)[:80]} is not a [run id, step] pair")
        lineage.append((el[0], el[1]))
    return RunInfo(rid, tuple(lineage))
