"""Save-decision policies: when to checkpoint.

A policy is a small object with ``should_save(step, now_s=...)``; the manager asks it in ``maybe_save`` and
reports every completed save back through ``record_save`` so adaptive policies can measure their costs.
Policies compose with :class:`AnyOf`. (Pattern: orbax ``save_decision_policy.py``.)

Under torch.distributed every rank must save at the same steps. A policy whose answer depends only on the step
sets ``step_based = True``; for any other policy (time-based, adaptive) the manager broadcasts rank 0's answer.

The manager calls ``policy.bind(root, events)`` once, if the policy has that method, giving it the run root and
the manager's :class:`~trainguard.eventlog.EventLog` (adaptive policies read failures from the log and
record why they chose an interval).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .errors import ConfigError


@runtime_checkable
class SavePolicy(Protocol):
    """Decides at which steps ``maybe_save`` writes a checkpoint."""

    def should_save(self, step: int, *, now_s: float) -> bool:
        """Return True to save at ``step``.

        Args:
            step: the training step just completed (>= 0).
            now_s: a monotonic clock reading in seconds (``time.monotonic()``).
        """
        ...

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        """Told after a save at ``step`` was started (block_s: seconds training was blocked) and, for async
        saves, once it is durable (persist_s: seconds from start to commit; None when not yet known)."""
        ...


@dataclass
class EveryNSteps:
    """Save when ``step`` is a multiple of ``every_steps`` (and never at step 0).

    Args:
        every_steps: the interval in steps, >= 1.

    Raises:
        ConfigError: if ``every_steps`` is not an int >= 1 (``2.5``, ``True`` and ``"2"`` are refused).
    """

    every_steps: int
    step_based = True  # the same answer on every rank: no collective needed under torch.distributed

    def __post_init__(self) -> None:
        n = self.every_steps
        try:
            whole = None if isinstance(n, bool) else operator.index(n)  # int, numpy ints; not 2.5 nor "2"
        except TypeError:
            whole = None
        if whole is None or whole < 1:
            raise ConfigError(
                f"every_steps must be a whole number of steps >= 1 (an int), got {n!r}: saves happen at "
                "multiples of it, so a fraction would save at unintended steps"
            )
        self.every_steps = whole

    def should_save(self, step: int, *, now_s: float) -> bool:
        return step > 0 and step % self.every_steps == 0

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        return None


@dataclass
class EveryTSeconds:
    """Save when at least ``interval_s`` seconds passed since the last save (or since the first call).

    Args:
        interval_s: the interval in seconds, > 0.

    Raises:
        ConfigError: if ``interval_s`` <= 0.
    """

    interval_s: float
    _last_s: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not float(self.interval_s) > 0:
            raise ConfigError(f"interval_s must be > 0 seconds, got {self.interval_s}")

    def should_save(self, step: int, *, now_s: float) -> bool:
        if self._last_s is None:
            self._last_s = now_s
            return False
        return now_s - self._last_s >= self.interval_s

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        if persist_s is None:
            self._last_s = now_s


class AnyOf:
    """Save when any of the given policies says so; every policy is told about every save."""

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise ConfigError("AnyOf needs at least one policy")
        self.policies = policies
        self.step_based = all(getattr(p, "step_based", False) for p in policies)

    def should_save(self, step: int, *, now_s: float) -> bool:
        # Ask every policy (not short-circuit) so time-based ones see every step.
        answers = [p.should_save(step, now_s=now_s) for p in self.policies]
        return any(answers)

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        for p in self.policies:
            p.record_save(step, now_s=now_s, block_s=block_s, persist_s=persist_s)

    def bind(self, root: str, events: object) -> None:
        for p in self.policies:
            bind = getattr(p, "bind", None)
            if bind is not None:
                bind(root, events)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.policies))})"
