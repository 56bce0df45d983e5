"""trainguard: fast, verified, resumable checkpoints and crash recovery for PyTorch training jobs.

The public surface is small; everything else is internal::

    import trainguard as tg
    mgr = tg.CheckpointManager("ckpts/run1", save_policy=tg.EveryNSteps(100), keep=3)

Names are imported lazily, so ``trainguard ls``/``verify``/``plan`` start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    MissingDependencyError,
    NonFiniteStateError,
    NoValidCheckpointError,
    ResumeDivergedError,
    ResumeNotExactWarning,
    RootLockedError,
    RunConflictError,
    SaveError,
    StateMismatchError,
    StorageFullError,
    SuspectCheckpointError,
    TierUploadError,
    TrainguardError,
    UnsafeCheckpointError,
    UnsafeFileError,
)

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": ".manager",
    "SaveResult": ".manager",
    "PendingSave": ".staging.pending",
    "PerRank": ".state.per_rank",
    "AnyOf": ".policies",
    "EveryNSteps": ".policies",
    "EveryTSeconds": ".policies",
    "AdaptivePolicy": ".planning.adaptive",
    "AnyOfRetention": ".retention",
    "KeepBest": ".retention",
    "KeepEvery": ".retention",
    "KeepLatest": ".retention",
    "ResumableLoader": ".state.data",
    "ResumableSampler": ".state.data",
    "RNGState": ".state.rng",
    "Tier": ".tiers.config",
    "ModelOptimizerState": ".distributed.state",
    "dcp_reader": ".interop.dcp_reader",  # dcp_reader(root, step): a StorageReader for plain dcp.load
    "heartbeat": ".recovery.heartbeat",  # heartbeat(step): tell `trainguard run` the job is alive at step
}


_SUBMODULES = ("lightning", "hf")  # integrations; each needs its extra (trainguard[lightning], [hf])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'trainguard' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AdaptivePolicy",
    "AnyOf",
    "AnyOfRetention",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ConfigError",
    "CorruptCheckpointError",
    "EveryNSteps",
    "EveryTSeconds",
    "InsufficientMemoryError",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "MissingDependencyError",
    "ModelOptimizerState",
    "NoValidCheckpointError",
    "NonFiniteStateError",
    "ResumeDivergedError",
    "ResumeNotExactWarning",
    "PendingSave",
    "PerRank",
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "RootLockedError",
    "RunConflictError",
    "SaveError",
    "SaveResult",
    "StateMismatchError",
    "StorageFullError",
    "SuspectCheckpointError",
    "Tier",
    "TierUploadError",
    "TrainguardError",
    "UnsafeCheckpointError",
    "UnsafeFileError",
    "dcp_reader",
    "heartbeat",
]
