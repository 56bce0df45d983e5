"""``PendingSave``: the handle ``save`` returns; the save path resolves it (``resolve``/``fail``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import SaveResult


class PendingSave:
    """A save that may still be persisting in the background.

    Attributes:
        step: the step being saved.
        staging_s: seconds the caller was blocked (waiting for a free buffer set, state_dict(), copying).
        skipped: True when the save was skipped because every buffer set was busy (``when_busy="skip"``).
        on_wait: called (once) when a caller starts waiting for the save before it is done (the persister
            lets the save use every writer thread then: nothing trains while the caller waits).
    """

    def __init__(self, step: int, staging_s: float = 0.0, *, skipped: bool = False) -> None:
        self.step = step
        self.staging_s = staging_s
        self.skipped = skipped
        self._event = threading.Event()
        self._result: SaveResult | None = None
        self._error: BaseException | None = None
        self._error_seen = False
        self.on_wait: Callable[[], None] | None = None
        if skipped:
            self._event.set()

    # -- resolution (the save path) ----------------------------------------------------------------------
    def resolve(self, result: SaveResult) -> None:
        """The save committed: ``wait`` returns ``result`` from now on."""
        self._result = result
        self._event.set()

    def fail(self, error: BaseException, *, seen: bool = False) -> None:
        """The save failed: ``wait`` raises ``error``. ``seen``: it was already raised to the caller (a
        synchronous save), so the manager does not raise it again from a later call."""
        self._error = error
        self._error_seen = seen
        self._event.set()

    def take_error(self) -> BaseException | None:
        """The error, marked as seen (the manager raises a background error once)."""
        if self._error is not None:
            self._error_seen = True
        return self._error

    @property
    def error_seen(self) -> bool:
        """True once the error was raised to the caller (by ``wait`` or by the manager)."""
        return self._error_seen

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the save committed, failed or was skipped, at most ``timeout`` seconds; True if done."""
        return self._event.wait(timeout)

    # -- caller side --------------------------------------------------------------------------------------
    def hurry(self) -> None:
        """Tell the save that a caller waits for it (see ``on_wait``); a no-op once done."""
        fn, self.on_wait = self.on_wait, None
        if fn is not None and not self._event.is_set():
            fn()

    def done(self) -> bool:
        """True once the save committed, failed or was skipped."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the save is durable and return its SaveResult (None if skipped).

        Raises:
            TimeoutError: not done within ``timeout`` seconds.
            SaveError: the background persist failed (nothing was committed for this step).
        """
        if not self._event.is_set():
            self.hurry()
        if not self._event.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still persisting after {timeout} s")
        if self._error is not None:
            self._error_seen = True
            raise self._error
        return self._result

    @property
    def persist_s(self) -> float | None:
        """Seconds from the start of the save to its commit (None until done)."""
        return self._result.persist_s if self._result else None

    @property
    def bytes(self) -> int | None:
        return self._result.bytes if self._result else None

    @property
    def result(self) -> SaveResult | None:
        return self._result

    @property
    def error(self) -> BaseException | None:
        return self._error

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else ("failed" if self._error else ("done" if self.done() else "persisting"))
        )
        return f"PendingSave(step={self.step}, {state}, staging_s={self.staging_s:.4f})"
