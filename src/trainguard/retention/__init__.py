"""Preservation policies: which committed checkpoints to keep.

A policy maps the ascending list of valid steps to the set it wants kept. The manager applies policies only
after a new checkpoint commits, always keeps the newest valid checkpoint whatever the policy says, and deletes
chunks only when no remaining checkpoint references them. (Pattern: orbax ``preservation_policy.py``.)

A policy that ranks checkpoints by their metrics (:class:`KeepBest`) also has
``keep_by_metrics(steps, metrics)``; the manager calls it, through :func:`select`, with the metrics each
manifest recorded (``maybe_save(..., metrics={"loss": ...})``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, steps: list[int]) -> set[int]:
        """Return the subset of ``steps`` (valid steps, ascending) to keep."""
        ...


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``n`` valid checkpoints.

    Args:
        n: how many checkpoints to keep (an int >= 1).

    Raises:
        ConfigError: ``n`` < 1.
    """

    n: int

    def __post_init__(self) -> None:
        if int(self.n) < 1:
            raise ConfigError(f"KeepLatest needs n >= 1, got {self.n}")

    def keep(self, steps: list[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``every_steps`` (long-term snapshots).

    Args:
        every_steps: the interval, in steps (an int >= 1).

    Raises:
        ConfigError: ``every_steps`` < 1.
    """

    every_steps: int

    def __post_init__(self) -> None:
        if int(self.every_steps) < 1:
            raise ConfigError(f"KeepEvery needs every_steps >= 1, got {self.every_steps}")

    def keep(self, steps: list[int]) -> set[int]:
        return {s for s in steps if s % self.every_steps == 0}


class KeepAll:
    """Keep everything (the default when ``keep`` is None)."""

    def keep(self, steps: list[int]) -> set[int]:
        return set(steps)

    def __repr__(self) -> str:
        return "KeepAll()"


@dataclass(frozen=True)
class KeepBest:
    """Keep the ``n`` valid checkpoints with the best value of a recorded metric (Lightning's ``monitor=``).

    Args:
        metric: the name of a metric given to ``save``/``maybe_save`` (``metrics={"val_loss": ...}``).
        n: how many to keep (>= 1).
        mode: ``"min"`` (lower is better, e.g. a loss) or ``"max"`` (e.g. an accuracy).

    A checkpoint whose manifest lacks the metric, or records a value that is not a finite number (NaN loss),
    is never among the best; ties go to the newer step. Combine it with others, e.g.
    ``AnyOfRetention(KeepLatest(2), KeepBest("val_loss", 3))``; the newest valid checkpoint is kept in any case.

    Raises:
        ConfigError: an empty metric name, ``n < 1`` or an unknown mode.
    """

    metric: str
    n: int = 1
    mode: str = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"KeepBest needs the name of a metric, got {self.metric!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"KeepBest needs n >= 1, got {self.n!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"KeepBest mode must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: list[int]) -> set[int]:
        """Without metrics nothing can be ranked: keep all (the manager calls :meth:`keep_by_metrics`)."""
        return set(steps)

    def keep_by_metrics(self, steps: list[int], metrics: Mapping[int, Mapping[str, Any]]) -> set[int]:
        """The ``n`` steps of ``steps`` whose ``metrics[step][metric]`` is best."""
        ranked = []
        for s in steps:
            v = (metrics.get(s) or {}).get(self.metric)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            ranked.append((v if self.mode == "min" else -v, -s))
        ranked.sort()
        return {-neg_step for _, neg_step in ranked[: self.n]}


class AnyOfRetention:
    """Keep a checkpoint if any of the given policies keeps it."""

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ConfigError("AnyOfRetention needs at least one policy")
        self.policies = policies

    def keep(self, steps: list[int]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= p.keep(steps)
        return out

    def keep_by_metrics(self, steps: list[int], metrics: Mapping[int, Mapping[str, Any]]) -> set[int]:
        out: set[int] = set()
        for p in self.policies:
            out |= select(p, steps, metrics)
        return out


def uses_metrics(policy: RetentionPolicy) -> bool:
    """True when ``policy`` ranks checkpoints by their metrics (has ``keep_by_metrics``)."""
    return callable(getattr(policy, "keep_by_metrics", None))


def select(policy: RetentionPolicy, steps: list[int], metrics: Mapping[int, Mapping[str, Any]]) -> set[int]:
    """The steps ``policy`` keeps, giving it the recorded metrics when it ranks by them."""
    if uses_metrics(policy):
        return set(policy.keep_by_metrics(steps, metrics))  # type: ignore[attr-defined]
    return set(policy.keep(steps))


def as_retention(keep: int | RetentionPolicy | None) -> RetentionPolicy:
    """Turn the manager's ``keep`` argument into a policy: None keeps all, an int N keeps the latest N."""
    if keep is None:
        return KeepAll()
    if isinstance(keep, bool):
        raise ConfigError("keep must be an int, a retention policy or None, not a bool")
    if isinstance(keep, int):
        return KeepLatest(keep)
    if isinstance(keep, RetentionPolicy):
        return keep
    raise ConfigError(f"keep must be an int, a retention policy or None, got {type(keep).__name__}")


__all__ = [
    "RetentionPolicy",
    "KeepLatest",
    "KeepEvery",
    "KeepBest",
    "KeepAll",
    "AnyOfRetention",
    "as_retention",
    "select",
    "uses_metrics",
]
