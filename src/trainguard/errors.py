"""Exception hierarchy.

Every error trainguard raises derives from :class:`TrainguardError`; where a built-in exception has the same
meaning, the subclass inherits it too, so ``except FileNotFoundError`` keeps working. Messages name the
problem and the fix.
"""

from __future__ import annotations

import errno
import re
from typing import Any

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]")


def plain_text(text: str) -> str:
    """``text`` without terminal escape sequences (torch colours some of its messages), for error messages and
    logs that may be read in a file or a CI log."""
    return _ANSI.sub("", text)


class TrainguardError(Exception):
    """Root of every trainguard error."""


class ConfigError(TrainguardError, ValueError):
    """A setting or argument is invalid (bad unit, negative interval, unknown option)."""


class CheckpointNotFoundError(TrainguardError, FileNotFoundError):
    """The requested step has no committed checkpoint under the run root."""


class NoValidCheckpointError(TrainguardError):
    """Checkpoints exist under the run root but none of them is valid.

    Raised by ``restore_latest`` instead of silently starting from scratch.
    """


class CorruptCheckpointError(TrainguardError):
    """A checkpoint failed an integrity check (manifest, chunk length or CRC32C, unsafe content).

    Attributes:
        step: the step of the checkpoint, when known.
        chunk: the relative path of the corrupt chunk, when the problem is in one chunk.
        tensors: fully qualified names of the state entries stored in that chunk.
        damaged: True when the chunk's bytes are wrong (length or CRC32C), confirmed by a second read; only
            such a finding condemns a chunk (``corrupt.json``, quarantine).
        unreadable: True when the chunk could not be read at all (an I/O error such as EACCES or EIO that
            persisted through the retries): reported, never recorded as corruption.
        state_modified: raised by a restore: True when tensors of the state passed may hold part of this
            checkpoint's bytes (a failure while loading in place, under torch.distributed or with
            ``verify_before_load=False``); False when the objects were not modified (every chunk checked before
            loading, or loaded into never-written memory that was put back); None outside a restore.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        chunk: str | None = None,
        tensors: list[str] | None = None,
        damaged: bool = False,
        unreadable: bool = False,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.chunk = chunk
        self.tensors = list(tensors or [])
        self.damaged = damaged
        self.unreadable = unreadable
        self.state_modified: bool | None = None


class UnsafeCheckpointError(CorruptCheckpointError):
    """A manifest points outside the run root, or carries content that would execute code on load or expand
    beyond its declared size (a pickle payload, a compressed value)."""


class CheckpointExistsError(TrainguardError, FileExistsError):
    """A committed checkpoint already exists for this step; pass ``overwrite=True`` to replace it."""


class RootLockedError(TrainguardError):
    """Another process holds the write lock of this run root (a second writer would corrupt it)."""


class StateMismatchError(TrainguardError, ValueError):
    """The state given to restore does not match what the checkpoint holds (shape, dtype or structure).

    The message lists every difference, the checkpoint's side and the target's: keys on one side only, dtypes
    that differ, shapes, and optimizer state recorded at save time that the checkpoint or the optimizer lacks.
    Key and dtype checks run before anything is loaded; restore into an empty dict to take everything as saved,
    or pass ``strict=False`` to load what matches.
    """


class SaveError(TrainguardError):
    """A save failed; no checkpoint was committed and every earlier checkpoint is intact.

    Attributes:
        step: the step that failed to save.
        rank_errors: mapping of rank to the exception raised there (one entry in a single process).
        pending_save: when a later ``save``/``maybe_save`` raised this error of an earlier background save:
            the :class:`~trainguard.staging.PendingSave` of that later call's own save, which was staged and
            goes on in the background before the error was raised (None: that call saved nothing, or the
            error is the failure of the save the call made itself).
    """

    def __init__(
        self, message: str, *, step: int | None = None, rank_errors: dict[int, BaseException] | None = None
    ):
        super().__init__(message)
        self.step = step
        self.rank_errors = dict(rank_errors or {})
        self.pending_save: Any = None


FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""errnos of a storage out of space (what :class:`StorageFullError` stands for)."""


class StorageFullError(SaveError, OSError):
    """The storage ran out of space (ENOSPC/EDQUOT) during a save. ``errno``, ``strerror`` and ``filename`` are
    those of the underlying OSError (also its ``__cause__``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class MissingDependencyError(TrainguardError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra to install
    (``pip install 'trainguard[safetensors]'``)."""


class ManagerClosedError(TrainguardError):
    """A call on a ``CheckpointManager`` after ``close()``: create a new manager."""


class ReadOnlyManagerError(TrainguardError):
    """A write (``save``, ``maybe_save``, ``log_event``) on a manager opened with ``read_only=True``: open a
    writing manager (one per run root)."""


class TransientStorageError(TrainguardError, OSError):
    """A storage operation failed in a way that may succeed when retried (timeout, 5xx, throttling; on local
    storage the errnos of ``trainguard.storage.local.TRANSIENT_ERRNOS``: EINTR, EAGAIN, EBUSY, ETIMEDOUT,
    ESTALE, ECONNRESET, ECONNABORTED). Readers of committed data retry it a bounded number of times with a
    backoff; ``errno`` and ``filename`` are those of the failure when it had them."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class UnsafeFileError(TrainguardError, OSError):
    """A file under a run root is a symlink, not a regular file (a directory, named pipe, device, socket) or
    larger than its kind of file may be; it was neither followed nor read. ``filename`` is its path."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class InsufficientMemoryError(TrainguardError, MemoryError):
    """A restore would need more memory than is available for the tensors it must allocate; nothing was
    allocated. ``restore_latest`` falls back to the next older checkpoint.

    Attributes:
        step: the checkpoint's step.
        need_bytes: bytes the new tensors need.
        available_bytes: bytes available (system memory and the address-space limit).
    """

    def __init__(
        self, message: str, *, step: int | None = None, need_bytes: int = 0, available_bytes: int = 0
    ):
        super().__init__(message)
        self.step = step
        self.need_bytes = need_bytes
        self.available_bytes = available_bytes


class RunConflictError(TrainguardError):
    """The run root holds checkpoints of another run that this manager did not resume: saving would interleave
    two runs' checkpoints (and let retention delete one run's for the other's). Resume it
    (``restore_latest``), use a new run root, or pass ``new_run=True``."""


class NonFiniteStateError(SaveError):
    """A save was rejected because a floating tensor of the state holds NaN or Inf (``check_finite="error"``).
    Nothing was committed, retention did not run and every earlier checkpoint is intact.

    Attributes:
        step: the step whose save was rejected.
        tensors: fully qualified tensor name -> count of non-finite values (this rank's; empty on a rank that
            found none while another rank did).
    """

    def __init__(self, message: str, *, step: int | None = None, tensors: dict[str, int] | None = None):
        super().__init__(message, step=step)
        self.tensors = dict(tensors or {})


class SuspectCheckpointError(TrainguardError):
    """A checkpoint's bytes are intact but its content failed validation after the load (NaN/Inf in a
    restored tensor, or the probe fingerprint differs). It is marked ``suspect`` (``step-N/suspect.json``);
    ``restore_latest`` falls back to the next older checkpoint, ``restore(step)`` raises this.

    Attributes:
        step: the checkpoint's step.
        reason: what failed (names the tensors or the probe outputs).
    """

    def __init__(self, message: str, *, step: int | None = None, reason: str = ""):
        super().__init__(message)
        self.step = step
        self.reason = reason or message


class ResumeDivergedError(TrainguardError):
    """After a resume, the loss left the trajectory recorded before the failure (within ``trajectory_steps``
    steps of the restore). The restored checkpoint, and every checkpoint this launch saved since, are marked
    ``suspect``; the next launch's ``restore_latest`` resumes from an older one.

    Attributes:
        restored_step: the step this launch resumed from.
        steps: the steps whose loss violated the check.
        values: the losses logged at those steps.
        expected: what each was compared with (the loss recorded for that step, or the band's upper bound).
        suspect_steps: the checkpoints marked suspect.
    """

    def __init__(
        self,
        message: str,
        *,
        restored_step: int | None = None,
        steps: list[int] | None = None,
        values: list[float] | None = None,
        expected: list[float] | None = None,
        suspect_steps: list[int] | None = None,
    ):
        super().__init__(message)
        self.restored_step = restored_step
        self.steps = list(steps or [])
        self.values = list(values or [])
        self.expected = list(expected or [])
        self.suspect_steps = list(suspect_steps or [])


class ResumeNotExactWarning(RuntimeWarning):
    """A resume that is likely not bit-exact, found without stopping the run: a ``ResumableSampler`` restored
    mid-epoch inside a ``DataLoader`` that draws its seed from the global torch RNG, or (trajectory check) a
    same-step loss after a restore that stayed within the trip tolerance but was not reproduced. Filter it with
    ``warnings.filterwarnings("ignore", category=tg.ResumeNotExactWarning)`` where that is intended."""


class TierUploadError(TrainguardError):
    """Checkpoints were not uploaded to a tier within ``upload_timeout_s`` (or every retry failed). The hot
    checkpoints are intact; a new manager with the same tiers uploads what is missing.

    Attributes:
        missing: tier URL -> the steps not uploaded there.
    """

    def __init__(self, message: str, *, missing: dict[str, list[int]] | None = None):
        super().__init__(message)
        self.missing = dict(missing or {})
