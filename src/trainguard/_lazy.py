"""What the single-process restart path must not import: ``torch.distributed.checkpoint`` (DCP) and DTensor.

Importing DCP pulls DTensor, ``torch.fx`` symbolic shapes and sympy: about 0.7 s (2-3 s on a loaded 2-core
machine) on every relaunch, while a single-process restore needs none of it (benchmarks/RESULTS.md, "Restart
imports"). Modules that use DCP import it inside the functions that need it; a check for a DTensor asks
:func:`dtensor_type`, which never imports: no DTensor can exist before ``torch.distributed.tensor`` was
imported by whoever made it.
"""

from __future__ import annotations

import sys
from typing import Any


def dtensor_type() -> Any:
    """``torch.distributed.tensor.DTensor`` when that module is imported, else None (never imports it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor, without importing DTensor."""
    cls = dtensor_type()
    return cls is not None and isinstance(x, cls)
