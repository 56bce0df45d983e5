"""Preservation policies: which committed checkpoints to keep.

A policy maps the ascending list of valid steps to the set it wants kept. The manager applies policies only
after a new checkpoint commits, always keeps the newest valid checkpoint whatever the policy says, and deletes
chunks only when no remaining checkpoint references them. (Pattern: orbax ``preservation_policy.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import ConfigError


@runtime_checkable
class RetentionPolicy(Protocol):
    def keep(self, steps: list[int]) -> set[int]:
        """Return the subset of ``steps`` (valid steps, ascending) to keep."""
        ...


@dataclass(frozen=True)
class KeepLatest:
    """Keep the newest ``n`` valid checkpoints (n >= 1)."""

    n: int

    def __post_init__(self) -> None:
        if int(self.n) < 1:
            raise ConfigError(f"KeepLatest needs n >= 1, got {self.n}")

    def keep(self, steps: list[int]) -> set[int]:
        return set(sorted(steps)[-self.n :])


@dataclass(frozen=True)
class KeepEvery:
    """Keep every checkpoint whose step is a multiple of ``every_steps`` (long-term snapshots)."""

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


__all__ = ["RetentionPolicy", "KeepLatest", "KeepEvery", "KeepAll", "AnyOfRetention", "as_retention"]
