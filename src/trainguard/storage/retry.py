"""Bounded retries of reads of committed data that failed with a :class:`~trainguard.errors.TransientStorageError`.

Which reads retry (and which do not):

- reads of committed objects (manifests, ``corrupt.json`` markers, check records: :func:`retry_transient`;
  chunks: :class:`~trainguard.incremental.chunkstore.ChunkStore` retries *any* I/O error the same number of
  times, then reports the chunk as unreadable, never as corrupt): reading again has no side effect;
- writes of a save in progress are not retried here: a failed write fails the save (nothing is committed, the
  earlier checkpoints are intact) and the next save writes again.

A retry waits ``backoff_s``, doubling each time: with the defaults, 3 attempts in all over 0.15 s at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import TransientStorageError

T = TypeVar("T")

READ_ATTEMPTS = 3
"""Attempts in all of a read that fails transiently (the chunk reader uses the same count for any I/O error)."""
READ_RETRY_BACKOFF_S = 0.05
"""Seconds before the first retry; doubled before each further one."""


def retry_transient(
    call: Callable[[], T], *, attempts: int = READ_ATTEMPTS, backoff_s: float = READ_RETRY_BACKOFF_S
) -> T:
    """``call()``, retried while it raises :class:`~trainguard.errors.TransientStorageError`.

    Args:
        call: the read (no arguments); it must be safe to repeat.
        attempts: calls in all (at least 1).
        backoff_s: seconds before the first retry, doubled before each further one.

    Returns:
        What ``call`` returned.

    Raises:
        TransientStorageError: the last attempt's, when every attempt failed transiently.
        Exception: anything else ``call`` raised, at once (not retried).
    """
    for attempt in range(1, max(1, attempts) + 1):
        try:
            return call()
        except TransientStorageError:
            if attempt >= attempts:
                raise
            time.sleep(backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")  # pragma: no cover
