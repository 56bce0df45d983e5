"""``AdaptivePolicy``: save at the optimal interval for the costs and failure rate this run actually has.

The policy measures the blocking time C and the persist latency L of the job's own saves (``record_save``),
estimates the job's MTBF from the failures the supervisor recorded in the run's event log, and saves every
``T = max(clamp(T_opt(C, M), min_interval_s, max_interval_s), L)`` seconds, where ``T_opt`` is Daly's
(2006) or Young's (1974) optimum. An asynchronous save must be durable before the next one starts, so T is
never below the measured L, whatever the bounds say.

Failure rate: failures are a Poisson process with rate ``lambda = 1 / M``. The conjugate prior is a Gamma
distribution; with ``a0`` pseudo-failures seen in ``b0`` pseudo-seconds (``b0 = a0 * prior_mtbf_s``) and
``n`` failures observed in ``t`` seconds of the run, the posterior is ``Gamma(a0 + n, b0 + t)`` and the
policy uses ``M = 1 / E[lambda] = (b0 + t) / (a0 + n)`` (Gelman et al., Bayesian Data Analysis, 3rd ed.,
section 2.6). ``n`` counts the ``failure`` events of the log (at their ``t_death`` when recorded), except
preemptions that saved a checkpoint first (``cause == "preempted"``), which lose no work; ``t`` runs from the
earliest event in the log to now. The prior dominates early in a run and fades as the run's own history accumulates; a larger
``prior_failures`` makes it fade more slowly.

Every notable change of the interval, and the first decision based on a measured save, is written to the
event log as an ``adaptive_interval`` event (and to the ``trainguard.planning.adaptive`` logger) with the measured C, L, the MTBF estimate, the failure count and
the reason.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from ..eventlog import read_events
from .interval import Method, daly_interval_s, young_interval_s
from .units import format_duration

log = logging.getLogger(__name__)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def posterior_mtbf_s(
    failures: float, exposure_s: float, *, prior_mtbf_s: float, prior_failures: float
) -> float:
    """MTBF estimate ``1 / E[lambda]`` under a Gamma prior on the failure rate.

    Args:
        failures: n, failures observed (>= 0).
        exposure_s: t, seconds observed (>= 0).
        prior_mtbf_s: the MTBF believed before the run, seconds (> 0).
        prior_failures: a0, the prior's weight in pseudo-failures (> 0); the prior counts as ``a0`` failures
            in ``a0 * prior_mtbf_s`` seconds.

    Returns:
        ``(a0 * prior_mtbf_s + t) / (a0 + n)`` in seconds.

    Raises:
        ConfigError: on negative counts or times, or a non-positive prior.
    """
    if not failures >= 0 or not exposure_s >= 0:
        raise ConfigError(f"failures and exposure_s must be >= 0, got {failures!r} and {exposure_s!r}")
    if not prior_mtbf_s > 0 or not prior_failures > 0:
        raise ConfigError(
            f"prior_mtbf_s and prior_failures must be > 0, got {prior_mtbf_s!r} and {prior_failures!r}; "
            "e.g. prior_mtbf_s=72*3600, prior_failures=1"
        )
    return (prior_failures * prior_mtbf_s + exposure_s) / (prior_failures + failures)


@dataclass(frozen=True, kw_only=True)
class IntervalDecision:
    """The interval :class:`AdaptivePolicy` uses and why.

    Attributes:
        interval_s: seconds between the starts of two saves.
        block_s: measured C (median of recent saves); None before the first save.
        persist_s: measured L (median of recent saves); None before the first durable save.
        mtbf_s: the posterior MTBF estimate.
        failures: failures counted (event log plus :meth:`AdaptivePolicy.observe_failure`).
        exposure_s: seconds of run the failures were counted over.
        reason: a sentence saying how the interval was chosen.
    """

    interval_s: float
    block_s: float | None
    persist_s: float | None
    mtbf_s: float
    failures: int
    exposure_s: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """The decision as a dict (the fields of the ``adaptive_interval`` event)."""
        return asdict(self)


class AdaptivePolicy:
    """Save-decision policy that checkpoints at the current Young/Daly optimum for this run.

    Args:
        prior_mtbf_s: the job's MTBF believed before the run, seconds (e.g. from ``trainguard plan``).
        prior_failures: weight of that belief in pseudo-failures (default 1: as if one failure had been seen
            in ``prior_mtbf_s`` seconds). Larger values trust the prior longer.
        min_interval_s: lower bound on the interval (default 60 s); the measured persist latency L still
            wins when it is longer.
        max_interval_s: upper bound on the interval (default 24 h).
        method: ``"daly"`` (default) or ``"young"``.
        initial_block_s: C to assume before the first save is measured; None: the first save comes after
            ``min_interval_s`` so that C is measured early.
        initial_persist_s: L to assume before the first durable save is measured.
        run_start_s: wall-clock time (``time.time()`` seconds) the run started, to count failures over;
            default the earliest event in the run's log, else the time this policy was created.
        recompute_s: re-estimate at most this often (seconds of ``now_s``; default 5 s).
        log_refresh_s: re-read failures from the event log at most this often (default 60 s).
        window: number of recent saves whose median gives C and L (default 8; robust to one slow save).
        change_ratio: relative change of the interval that is logged as a new decision (default 0.1).
        wall_clock: source of wall-clock time in seconds (default ``time.time``; tests pass a fake).

    Raises:
        ConfigError: on invalid arguments.

    ``should_save`` is cheap (a comparison, plus arithmetic every ``recompute_s``); ``record_save`` may be
    called from a background thread (a lock guards the measurements).
    """

    def __init__(
        self,
        *,
        prior_mtbf_s: float,
        prior_failures: float = 1.0,
        min_interval_s: float = 60.0,
        max_interval_s: float = 24 * 3600.0,
        method: Method = "daly",
        initial_block_s: float | None = None,
        initial_persist_s: float | None = None,
        run_start_s: float | None = None,
        recompute_s: float = 5.0,
        log_refresh_s: float = 60.0,
        window: int = 8,
        change_ratio: float = 0.1,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        posterior_mtbf_s(
            0, 0, prior_mtbf_s=prior_mtbf_s, prior_failures=prior_failures
        )  # validates the prior
        if (
            not (min_interval_s > 0)
            or not (max_interval_s >= min_interval_s)
            or not math.isfinite(max_interval_s)
        ):
            raise ConfigError(
                f"need 0 < min_interval_s <= max_interval_s < inf, got {min_interval_s!r} and {max_interval_s!r}; "
                "e.g. min_interval_s=60, max_interval_s=86400"
            )
        if method not in ("daly", "young"):
            raise ConfigError(f"unknown interval method {method!r}; use 'daly' or 'young'")
        for name, v in (("initial_block_s", initial_block_s), ("initial_persist_s", initial_persist_s)):
            if v is not None and not v >= 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {v!r}")
        if int(window) < 1 or not change_ratio >= 0 or not recompute_s >= 0 or not log_refresh_s >= 0:
            raise ConfigError("window must be >= 1 and change_ratio, recompute_s, log_refresh_s >= 0")
        self.prior_mtbf_s = float(prior_mtbf_s)
        self.prior_failures = float(prior_failures)
        self.min_interval_s = float(min_interval_s)
        self.max_interval_s = float(max_interval_s)
        self.method: Method = method
        self.initial_block_s = initial_block_s
        self.initial_persist_s = initial_persist_s
        self.recompute_s = float(recompute_s)
        self.log_refresh_s = float(log_refresh_s)
        self.change_ratio = float(change_ratio)
        self._clock = wall_clock
        self._created_s = wall_clock()
        self._run_start_s = run_start_s
        self._log_start_s: float | None = None
        self._lock = threading.Lock()
        self._blocks: deque[float] = deque(maxlen=int(window))
        self._persists: deque[float] = deque(maxlen=int(window))
        self._started_steps: set[int] = set()
        self._observed: list[float] = []
        self._log_failures: list[float] = []
        self._root: str | None = None
        self._events: Any = None
        self._last_save_s: float | None = None
        self._next_recompute_s = -math.inf
        self._next_log_read_s = -math.inf
        self._logged_interval_s: float | None = None
        self._logged_measured = False
        self._decision = self._decide()

    # -- wiring -----------------------------------------------------------------------------------------
    def bind(self, root: str, events: Any) -> None:
        """Called once by the manager with the run root and its event log; reads past failures at once."""
        self._root = str(root)
        self._events = events
        self._read_log()
        self._update(force_log=True)

    def observe_failure(self, t_s: float | None = None) -> None:
        """Count one failure at wall-clock time ``t_s`` (default now), in addition to the event log.

        For tests and for callers that learn of failures some other way.
        """
        with self._lock:
            self._observed.append(self._clock() if t_s is None else float(t_s))
        self._next_recompute_s = -math.inf

    # -- SavePolicy protocol ----------------------------------------------------------------------------
    def should_save(self, step: int, *, now_s: float) -> bool:
        """True when ``interval_s`` seconds passed since the start of the last save (or the first call)."""
        if now_s >= self._next_recompute_s:
            self._next_recompute_s = now_s + self.recompute_s
            if self._root is not None and now_s >= self._next_log_read_s:
                self._next_log_read_s = now_s + self.log_refresh_s
                self._read_log()
            self._update()
        if self._last_save_s is None:
            self._last_save_s = now_s
            return False
        return now_s - self._last_save_s >= self._decision.interval_s

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        """Record the blocking time of a save that started, or the persist latency of one that is durable."""
        with self._lock:
            if persist_s is None or step not in self._started_steps:
                # The start of a save (a manager that reports only once reports start and end together).
                self._last_save_s = now_s
                if block_s is not None and block_s >= 0 and math.isfinite(block_s):
                    self._blocks.append(float(block_s))
                if persist_s is None:
                    self._started_steps.add(step)
            if persist_s is not None:
                self._started_steps.discard(step)
                if persist_s >= 0 and math.isfinite(persist_s):
                    self._persists.append(float(persist_s))
        self._update()

    # -- estimate -------------------------------------------------------------------------------------
    @property
    def interval_s(self) -> float:
        """The interval currently in force, seconds."""
        return self._decision.interval_s

    @property
    def decision(self) -> IntervalDecision:
        """The current interval and why it was chosen."""
        return self._decision

    def _read_log(self) -> None:
        # A log that cannot be read must not stop training: keep the previous estimate.
        try:
            records = read_events(self._root) if self._root is not None else []
        except OSError as e:  # pragma: no cover - depends on the file system
            log.warning("adaptive policy could not read the event log under %s: %s", self._root, e)
            return
        times = [float(r["t"]) for r in records if _is_number(r.get("t"))]
        failures = []
        for r in records:
            # A preemption that saved a checkpoint first ("preempted") loses no work: not a failure here.
            if r.get("event") != "failure" or r.get("cause") == "preempted":
                continue
            t: Any = r.get("t_death") if _is_number(r.get("t_death")) else r.get("t")
            if _is_number(t):
                failures.append(float(t))
        with self._lock:
            if times:
                self._log_start_s = min(times)
            self._log_failures = failures

    def _counts(self) -> tuple[int, float]:
        """Failures and the seconds they were counted over."""
        with self._lock:
            failures = self._log_failures + self._observed
            starts = [s for s in (self._run_start_s, self._log_start_s) if s is not None]
        start = min(starts) if starts else self._created_s
        if failures:
            start = min(start, min(failures))
        return len(failures), max(self._clock() - start, 0.0)

    def _decide(self) -> IntervalDecision:
        n, exposure = self._counts()
        mtbf = posterior_mtbf_s(
            n, exposure, prior_mtbf_s=self.prior_mtbf_s, prior_failures=self.prior_failures
        )
        with self._lock:
            block = statistics.median(self._blocks) if self._blocks else self.initial_block_s
            persist = statistics.median(self._persists) if self._persists else self.initial_persist_s
        estimate = (
            f"MTBF {format_duration(mtbf)} from {n} failure(s) in {format_duration(exposure)} "
            f"and a prior of {self.prior_failures:g} in {format_duration(self.prior_failures * self.prior_mtbf_s)}"
        )
        if block is None:
            interval = self.min_interval_s
            reason = f"no save measured yet: saving after min_interval_s to measure its cost; {estimate}"
        else:
            fn = daly_interval_s if self.method == "daly" else young_interval_s
            optimum = fn(block, mtbf)
            interval = min(max(optimum, self.min_interval_s), self.max_interval_s)
            reason = f"{self.method} optimum {format_duration(optimum)} for C = {format_duration(block)}, {estimate}"
            if optimum < self.min_interval_s:
                reason += f"; raised to min_interval_s {format_duration(self.min_interval_s)}"
            elif optimum > self.max_interval_s:
                reason += f"; capped at max_interval_s {format_duration(self.max_interval_s)}"
        if persist is not None and persist > interval:
            interval = persist
            reason += f"; raised to the persist latency L = {format_duration(persist)} (a save must be durable first)"
        return IntervalDecision(
            interval_s=interval,
            block_s=block,
            persist_s=persist,
            mtbf_s=mtbf,
            failures=n,
            exposure_s=exposure,
            reason=reason,
        )

    def _update(self, *, force_log: bool = False) -> None:
        self._decision = d = self._decide()
        prev = self._logged_interval_s
        first_measurement = d.block_s is not None and not self._logged_measured
        if (
            not force_log
            and not first_measurement
            and prev is not None
            and abs(d.interval_s - prev) <= self.change_ratio * prev
        ):
            return
        self._logged_interval_s = d.interval_s
        self._logged_measured = d.block_s is not None
        log.info("adaptive checkpoint interval %s: %s", format_duration(d.interval_s), d.reason)
        if self._events is not None:
            try:
                self._events.write(
                    "adaptive_interval",
                    interval_s=d.interval_s,
                    block_s=d.block_s,
                    persist_s=d.persist_s,
                    mtbf_s=d.mtbf_s,
                    failures=d.failures,
                    exposure_s=d.exposure_s,
                    reason=d.reason,
                )
            except Exception as e:  # noqa: BLE001 - a log write must never stop training
                log.warning("adaptive policy could not write its event: %s", e)

    def __repr__(self) -> str:
        return (
            f"AdaptivePolicy(prior_mtbf_s={self.prior_mtbf_s:g}, prior_failures={self.prior_failures:g}, "
            f"min_interval_s={self.min_interval_s:g}, max_interval_s={self.max_interval_s:g}, "
            f"method={self.method!r}, interval_s={self.interval_s:g})"
        )
