"""Settings, exit codes and environment names of the recovery supervisor (:mod:`.supervisor`)."""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .job import validate_run_id

EARLY_DEATH_S = 60.0  # an attempt that dies this soon without a heartbeat counts against --no-progress-limit
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_MAX_RESTARTS = 3
EXIT_NO_PROGRESS = 4
EXIT_NO_VALID_CHECKPOINT = 5
EXIT_SPAWN_FAILED = 127
EXIT_SIGNAL_BASE = 128

EXIT_CODES: dict[str, str] = {
    "0": "COMMAND exited 0 (possibly after restarts)",
    "2": "usage error (no COMMAND, bad option)",
    "3": "gave up: the job failed again after --max-restarts restarts",
    "4": "gave up: --no-progress-limit restarts in a row made no progress (heartbeat step did not advance, or "
    "the job died within 60 s of starting without any heartbeat)",
    "5": "gave up: the job failed with NoValidCheckpointError (checkpoints exist under its root but none is valid; "
    "a relaunch would fail the same way): `trainguard verify ROOT --all` says why",
    "75": "preempted: a --preempt-signal arrived, the job was told to save (SIGTERM) and was not restarted; "
    "requeue it",
    "127": "COMMAND could not be started (not found or not executable)",
    "128+N": "stopped by signal N, forwarded to the job, no restart (129 SIGHUP, 130 SIGINT, 138 SIGUSR1, 143 "
    "SIGTERM)",
}
"""Exit codes of ``trainguard run``, documented in ``--help``."""

RESTART_COUNT_ENV = "TRAINGUARD_RESTART_COUNT"
RUN_ID_ENV = "TRAINGUARD_RUN_ID"
ROOT_ENV = "TRAINGUARD_ROOT"
DEFAULT_ROOT = "trainguard-run"
"""Run root when neither ``--root`` nor ``TRAINGUARD_ROOT`` is given (relative to the working directory)."""

TAIL_INTERVAL_S = 0.5
"""How often the event log is read while a recovery waits for the manager's events."""


def default_root() -> Path:
    """Return ``$TRAINGUARD_ROOT`` if set, else ``./trainguard-run``, as an absolute path."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT).absolute()


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
        forward_signals: forward SIGTERM/SIGINT to the job (only possible from the main thread).
        env: extra environment for the job.
        run_id: the run id; None: torchrun's ``--rdzv-id`` in the command, else generated
            (``YYYYmmdd-HHMMSS-<6 hex>``). Supervisors of one run id on one root share one restart budget
            (see :mod:`.job`).
        preempt_signals: signals that mean "the scheduler is about to stop this job" (e.g. Slurm's
            ``--signal=USR1@120``): the job gets SIGTERM (with ``save_on_preemption=True`` it saves and
            exits 75) and the supervisor exits 75 without restarting, so the batch script can requeue.
        metrics_port: serve Prometheus metrics of the run (:mod:`trainguard.observe.metrics`) on this TCP
            port of 127.0.0.1 (this machine only) while it runs (0: any free port, see
            :attr:`Supervisor.metrics_url`); None: off.
        prefetch: while each attempt starts (imports, model build), have the chunk files of the newest
            usable checkpoint under ``root`` read into this node's page cache, so the job's restore reads
            memory instead of the disk (:mod:`.prefetch`: at most half the available memory, not for a
            manifest over 1 MiB; the restore still checks every chunk). None (default): on, except for a
            multi-node command (:func:`.prefetch.multi_node_command`: ``srun``/``mpirun``/... or torchrun's
            ``--nnodes`` other than 1), where every node would read the whole checkpoint; True/False: on/off.
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
    preempt_signals: tuple[int, ...] = ()
    metrics_port: int | None = None
    prefetch: bool | None = None

    def __post_init__(self) -> None:
        if self.metrics_port is not None:
            from ..observe.metrics import check_port

            check_port(self.metrics_port)
        if self.run_id is not None:
            validate_run_id(self.run_id)
        for sig in self.preempt_signals:
            if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGTERM):
                raise ConfigError(
                    f"{signal.Signals(sig).name} cannot be a preemption signal (SIGTERM and SIGINT already stop "
                    "the job; SIGKILL and SIGSTOP cannot be caught); use SIGUSR1 or SIGUSR2"
                )
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


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def config_fields(cfg: SupervisorConfig) -> dict[str, Any]:
    """The settings as JSON for the ``supervisor_start`` event (environment names only: values may be
    secrets)."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    out["backoff"] = asdict(cfg.backoff)
    out["root"] = str(cfg.root) if cfg.root is not None else None
    out["env"] = sorted(cfg.env)  # names only: values may be secrets
    return out
