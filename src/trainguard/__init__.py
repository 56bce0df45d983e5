"""trainguard: fast, verified, resumable checkpoints and crash recovery for PyTorch training jobs.

The public surface is small; everything else is internal::

    import trainguard as tg
    mgr = tg.CheckpointManager("ckpts/run1", save_policy=tg.EveryNSteps(100), keep=3)
"""

__version__ = "0.1.0"

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NoValidCheckpointError,
    RootLockedError,
    SaveError,
    StateMismatchError,
    StorageFullError,
    TrainguardError,
)
from .manager import CheckpointManager, SaveResult
from .policies import AnyOf, EveryNSteps, EveryTSeconds
from .retention import AnyOfRetention, KeepEvery, KeepLatest
from .state.data import ResumableLoader, ResumableSampler
from .state.rng import RNGState


def heartbeat(step: int) -> None:
    """Tell the supervisor (``trainguard run``) the job is alive at ``step``; a no-op outside it."""
    from .recovery.heartbeat import heartbeat as _hb

    _hb(step)


def __getattr__(name: str):  # lazy: planning is not needed by most jobs
    if name == "AdaptivePolicy":
        from .planning.adaptive import AdaptivePolicy

        return AdaptivePolicy
    raise AttributeError(name)


__all__ = [
    "AdaptivePolicy",
    "AnyOf",
    "AnyOfRetention",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "EveryNSteps",
    "EveryTSeconds",
    "KeepEvery",
    "KeepLatest",
    "NoValidCheckpointError",
    "RNGState",
    "ResumableLoader",
    "ResumableSampler",
    "RootLockedError",
    "SaveError",
    "SaveResult",
    "StateMismatchError",
    "StorageFullError",
    "TrainguardError",
    "heartbeat",
]
