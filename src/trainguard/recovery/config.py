"""Settings of the recovery supervisor (:class:`~trainguard.recovery.supervisor.Supervisor`): the restart
backoff and the supervisor's configuration, validated on construction."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """Delay before a relaunch: ``min(max_s, initial_s * factor ** n)``, n = restarts in a row without progress.

    Attributes:
        initial_s: delay after a failure of an attempt that made progress (seconds, >= 0).
        max_s: upper bound (seconds, >= initial_s).
        factor: growth per restart without progress (>= 1).
    """

    initial_s: float = 1.0
    max_s: float = 60.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not self.initial_s >= 0:
            raise ConfigError(f"backoff initial_s must be >= 0 seconds, got {self.initial_s}")
        if not self.max_s >= self.initial_s:
            raise ConfigError(f"backoff max_s ({self.max_s}) must be >= initial_s ({self.initial_s})")
        if not self.factor >= 1:
            raise ConfigError(f"backoff factor must be >= 1, got {self.factor}")

    def delay_s(self, no_progress_streak: int) -> float:
        """Return the delay (seconds) after ``no_progress_streak`` restarts in a row without progress."""
        return min(self.max_s, self.initial_s * self.factor ** min(no_progress_streak, 64))


@dataclass(frozen=True, kw_only=True)
class SupervisorConfig:
    """Settings of a :class:`Supervisor`.

    Attributes:
        max_restarts: restarts allowed before giving up (0: never restart).
        heartbeat_timeout_s: a job whose newest heartbeat is older than this is hung (seconds); None turns
            hang detection off. Armed by the attempt's first heartbeat (startup is covered by
            ``startup_timeout_s``).
        startup_timeout_s: a job that has not beaten this long after its spawn is hung (seconds); None: no
            limit on startup (imports, restore).
        grace_period_s: SIGTERM to SIGKILL delay when killing a hung job or stopping (seconds).
        backoff: the relaunch delay.
        max_no_progress_restarts: give up after this many restarts in a row without progress (0: never).
        root: run root for the event log; must be the job's checkpoint root for the TTR join. None:
            :func:`default_root`.
        poll_interval_s: how often the heartbeat file is read (seconds). Exits are noticed at once.
        forward_signals: forward SIGTERM, SIGINT and the other terminating signals to the job (only possible
            from the main thread).
        env: extra environment for the job.
        run_id: the run id; None: generated (``YYYYmmdd-HHMMSS-<6 hex>``).
    """

    max_restarts: int = 10
    heartbeat_timeout_s: float | None = None
    startup_timeout_s: float | None = None
    grace_period_s: float = 30.0
    backoff: Backoff = field(default_factory=Backoff)
    max_no_progress_restarts: int = 3
    root: str | os.PathLike[str] | None = None
    poll_interval_s: float = 0.1
    forward_signals: bool = True
    env: Mapping[str, str] = field(default_factory=dict)
    run_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {self.max_restarts!r}")
        if not isinstance(self.max_no_progress_restarts, int) or self.max_no_progress_restarts < 0:
            raise ConfigError(
                f"max_no_progress_restarts must be an int >= 0 (0 turns it off), got {self.max_no_progress_restarts!r}"
            )
        for name in ("heartbeat_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds or None (off), got {value}")
        if not self.grace_period_s >= 0:
            raise ConfigError(f"grace_period_s must be >= 0 seconds, got {self.grace_period_s}")
        if not 0 < self.poll_interval_s <= 60:
            raise ConfigError(f"poll_interval_s must be in (0, 60] seconds, got {self.poll_interval_s}")
        if self.heartbeat_timeout_s is not None and self.heartbeat_timeout_s <= self.poll_interval_s:
            raise ConfigError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed poll_interval_s ({self.poll_interval_s})"
            )
