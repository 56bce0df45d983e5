"""``WriterThreads``: how many of a background save's writer threads run at once.

An async save persists while the training thread trains, so its writer threads leave that thread a core
(:meth:`WriterOptions.background <trainguard.distributed.options.WriterOptions.background>`: one writer on 2
CPUs). Once a caller *waits* for the save (``PendingSave.wait``, ``CheckpointManager.wait`` or ``close``, or a
``save`` that needs the save's staging buffers), nothing trains until it is durable, and the limit is lifted:
every writer thread of the save runs, as in a synchronous save. Measured on 2 cores (benchmarks/RESULTS.md,
"A waited-on async save persists with every writer thread"): 0.5 GiB saved and waited for at 76% of the raw
write with one thread, 94% with four.

Lives outside ``staging`` and ``distributed`` (siblings that may not import each other: .importlinter): the
persister lifts it, the DCP writer obeys it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class WriterThreads:
    """A lifted-on-wait limit on the writer threads of one save.

    ``low`` threads may work at once until :meth:`lift`, then ``high`` (set by :meth:`configure` when the
    save's writer starts; 1 and 1 before). Thread-safe: :meth:`slot` runs in the writer threads, :meth:`lift`
    in any thread, at any time (before the writer starts too).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._low = 1
        self._high = 1
        self._active = 0
        self._lifted = False

    def configure(self, *, low: int, high: int) -> None:
        """``low`` writer threads at once while nobody waits for the save, ``high`` once someone does.

        Raises:
            ValueError: ``low`` < 1 or ``high`` < ``low``.
        """
        if low < 1 or high < low:
            raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
        with self._cond:
            self._low, self._high = low, high
            self._cond.notify_all()

    def lift(self) -> None:
        """A caller waits for this save: from now on ``high`` threads may work at once."""
        with self._cond:
            if not self._lifted:
                self._lifted = True
                self._cond.notify_all()

    @property
    def lifted(self) -> bool:
        """True once :meth:`lift` was called."""
        return self._lifted

    @property
    def limit(self) -> int:
        """How many threads may work at once now."""
        return self._high if self._lifted else self._low

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one of the :attr:`limit` working slots for the duration of the block (waits for one)."""
        with self._cond:
            while self._active >= self.limit:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify()
