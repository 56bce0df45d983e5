"""Monte Carlo simulation of a training run under failures, for one checkpoint interval or a sweep of them.

Model of one trial (all times in seconds of wall clock):

- The run needs ``work_s`` seconds of compute. It computes for T, then saves; the save blocks training for C
  and is durable L seconds after it started (``L = C`` for synchronous saves, ``L >= C`` for asynchronous
  ones). No save follows the last, shorter, interval.
- Failures form a renewal process: the times between them are independent draws from an exponential or a
  Weibull distribution with mean ``mtbf_s``. A Weibull shape below 1 is the decreasing hazard (failures
  come in bursts) that field studies of large machines report (Schroeder and Gibson, "A large-scale study of
  failures in high-performance computing systems", DSN 2006, found shapes of about 0.7 to 0.8).
- A failure loses the work since the newest durable save, then costs a downtime of ``detect_s + restart_s``;
  a failure during the downtime starts the downtime again.

Trials are vectorized with numpy: each loop iteration advances every unfinished trial by one failure, in
closed form, so the cost grows with the number of failures per run, not with its length. Every interval of
a sweep sees the same failure sequences (common random numbers), which makes the waste curve smooth and
the result of an interval independent of the sweep it is part of.

For exponential failures and synchronous saves the mean wall time converges to Daly's complete model
(:func:`~trainguard.planning.interval.expected_wall_time_s`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError
from .interval import daly_interval_s, expected_wall_time_s

Distribution = Literal["exponential", "weibull"]

_MAX_FAILURES_PER_TRIAL = 1_000_000


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """Inputs of a simulation, except the interval.

    Args:
        work_s: compute seconds the run needs without failures or checkpoints (> 0).
        checkpoint_s: C, seconds each save blocks training (>= 0).
        mtbf_s: M, mean seconds between failures of the job (> 0).
        persist_s: L, seconds from the start of a save until it is durable; None for synchronous saves
            (L = C). Values below C are raised to C.
        restart_s: R, seconds from detection until training runs again (>= 0).
        detect_s: D, seconds from a failure until it is detected (>= 0).
        distribution: ``"exponential"`` or ``"weibull"`` times between failures.
        weibull_shape: the Weibull shape k (> 0; k < 1 is a decreasing hazard, k = 1 is exponential).
        trials: number of simulated runs per interval (>= 1).
        seed: seed of the random generator; equal seeds give equal results.

    Raises:
        ConfigError: on any invalid field.
    """

    work_s: float
    checkpoint_s: float
    mtbf_s: float
    persist_s: float | None = None
    restart_s: float = 0.0
    detect_s: float = 0.0
    distribution: Distribution = "exponential"
    weibull_shape: float = 0.7
    trials: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        def check(name: str, value: float, *, zero_ok: bool) -> None:
            v = float(value)
            if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
                need = ">= 0" if zero_ok else "> 0"
                raise ConfigError(f"{name} must be {need} seconds, got {value!r}")

        check("work_s", self.work_s, zero_ok=False)
        check("checkpoint_s", self.checkpoint_s, zero_ok=True)
        check("mtbf_s", self.mtbf_s, zero_ok=False)
        check("restart_s", self.restart_s, zero_ok=True)
        check("detect_s", self.detect_s, zero_ok=True)
        if self.persist_s is not None:
            check("persist_s", self.persist_s, zero_ok=True)
        if self.distribution not in ("exponential", "weibull"):
            raise ConfigError(
                f"unknown failure distribution {self.distribution!r}; use 'exponential' or 'weibull'"
            )
        if not (float(self.weibull_shape) > 0) or not math.isfinite(float(self.weibull_shape)):
            raise ConfigError(
                f"weibull_shape must be > 0, got {self.weibull_shape!r}; field studies report ~0.7"
            )
        if int(self.trials) < 1:
            raise ConfigError(f"trials must be >= 1, got {self.trials!r}")

    @property
    def effective_persist_s(self) -> float:
        """L as simulated: ``max(persist_s, checkpoint_s)``, or C for synchronous saves."""
        if self.persist_s is None:
            return float(self.checkpoint_s)
        return max(float(self.persist_s), float(self.checkpoint_s))


@dataclass(frozen=True, kw_only=True)
class SimulationResult:
    """Statistics of the simulated runs at one interval.

    Attributes:
        interval_s: T, compute seconds between saves.
        trials: number of runs simulated.
        goodput_mean: mean over trials of ``work_s / wall time``.
        goodput_p5, goodput_p50, goodput_p95: percentiles of the goodput.
        waste_mean: ``1 - goodput_mean``.
        wall_mean_s: mean wall time of a run in seconds.
        wall_p5_s, wall_p50_s, wall_p95_s: percentiles of the wall time.
        failures_mean: mean number of failures per run.
    """

    interval_s: float
    trials: int
    goodput_mean: float
    goodput_p5: float
    goodput_p50: float
    goodput_p95: float
    waste_mean: float
    wall_mean_s: float
    wall_p5_s: float
    wall_p50_s: float
    wall_p95_s: float
    failures_mean: float

    def to_dict(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class SweepResult:
    """Results of a sweep over intervals.

    Attributes:
        results: one :class:`SimulationResult` per interval, in increasing interval order.
        best_interval_s: the swept interval with the lowest mean waste.
        fitted_interval_s: the minimum of a least-squares fit ``waste = a/T + b T + c`` through the swept
            points around the best one (less sensitive to Monte Carlo noise on the flat bottom of the curve);
            None when the fit has no minimum.
    """

    results: tuple[SimulationResult, ...]
    best_interval_s: float
    fitted_interval_s: float | None

    @property
    def best(self) -> SimulationResult:
        """The result at :attr:`best_interval_s`."""
        return min(self.results, key=lambda r: r.waste_mean)

    def to_dict(self) -> dict[str, Any]:
        """Return the sweep as a JSON-ready dict."""
        return {
            "best_interval_s": self.best_interval_s,
            "fitted_interval_s": self.fitted_interval_s,
            "points": [r.to_dict() for r in self.results],
        }


def _sampler(config: SimulationConfig) -> Callable[[np.random.Generator, int], np.ndarray]:
    m = float(config.mtbf_s)
    if config.distribution == "exponential":
        return lambda rng, n: rng.standard_exponential(n) * m
    k = float(config.weibull_shape)
    scale = m / math.gamma(1.0 + 1.0 / k)  # so that the mean is M
    return lambda rng, n: rng.weibull(k, n) * scale


def _check_intervals(
    config: SimulationConfig, intervals_s: Sequence[float] | np.ndarray, source: str | None = None
) -> np.ndarray:
    """The intervals as an array, refused (naming where they came from: ``source``) where the model fails."""
    where = f" ({source})" if source else ""
    taus = np.asarray(intervals_s, dtype=float).reshape(-1)
    if taus.size == 0:
        raise ConfigError("no interval to simulate; give at least one interval in seconds")
    if not np.all(np.isfinite(taus)) or np.any(taus <= 0):
        raise ConfigError(f"intervals must be positive seconds, got {taus.tolist()}")
    if config.persist_s is not None and np.any(taus < config.effective_persist_s):
        raise ConfigError(
            f"interval {float(taus.min()):g} s{where} is shorter than the persist latency L = "
            f"{config.effective_persist_s:g} s; an async save must be durable before the next starts, "
            "so use an interval >= L"
        )
    # Guard against inputs where a run practically never completes (each interval needs e^{(T+C)/M} tries).
    longest = float(taus.max())
    expected = expected_wall_time_s(
        config.work_s,
        longest,
        config.effective_persist_s,
        config.mtbf_s,
        restart_s=config.restart_s,
        detect_s=config.detect_s,
    )
    if not math.isfinite(expected) or expected / config.mtbf_s > _MAX_FAILURES_PER_TRIAL / 20:
        raise ConfigError(
            f"with interval {longest:g} s{where} and MTBF {config.mtbf_s:g} s a run would almost never finish "
            "(each interval would need very many tries); use an interval well below the MTBF"
        )
    return taus


def _simulate_walls(config: SimulationConfig, taus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Wall times and failure counts, both of shape (len(taus), trials)."""
    trials = int(config.trials)
    n = taus.size * trials
    rng = np.random.default_rng(int(config.seed))
    draw = _sampler(config)
    work = float(config.work_s)
    c = float(config.checkpoint_s)
    lat = config.effective_persist_s
    downtime = float(config.restart_s) + float(config.detect_s)

    col = np.tile(np.arange(trials), taus.size)  # which failure sequence each entry follows
    tau = np.repeat(taus, trials)
    f = draw(rng, trials)[col]  # time of the next failure
    w = np.zeros(n)  # durable work
    t_fail = np.zeros(n)  # time of the last failure (0: the start)
    down = np.zeros(n)  # downtime before computing resumes (none at the start)
    failures = np.zeros(n, dtype=np.int64)
    wall = np.full(n, np.nan)
    active = np.arange(n)
    rounds = 0
    while active.size:
        rounds += 1
        if rounds > _MAX_FAILURES_PER_TRIAL:
            raise ConfigError(
                "simulation did not finish: runs keep failing before any progress; shorten the interval"
            )
        nxt = draw(rng, trials)  # drawn every round for every trial, so sequences match across intervals
        a = active
        ta = tau[a]
        fa = f[a]
        t0 = t_fail[a] + down[a]
        rem = work - w[a]
        segments = np.maximum(np.ceil(rem / ta), 1.0)
        t_end = t0 + rem + (segments - 1.0) * c
        in_down = fa < t0
        done = ~in_down & (fa >= t_end)
        wall[a[done]] = t_end[done]
        # Save j (1-based) is durable at t0 + j T + (j - 1) C + L; count those durable before the failure.
        j = np.floor((fa - t0 - lat + c) / (ta + c))
        j = np.where(in_down, 0.0, np.clip(j, 0.0, segments - 1.0))
        fail = ~done
        af = a[fail]
        w[af] += (j * ta)[fail]
        t_fail[af] = fa[fail]
        down[af] = downtime
        f[af] = fa[fail] + nxt[col[af]]
        failures[af] += 1
        active = af
    return wall.reshape(taus.size, trials), failures.reshape(taus.size, trials)


def _results(config: SimulationConfig, taus: np.ndarray) -> list[SimulationResult]:
    walls, failures = _simulate_walls(config, taus)
    out = []
    for i, t in enumerate(taus):
        wall = walls[i]
        good = float(config.work_s) / wall
        g5, g50, g95 = np.percentile(good, [5, 50, 95])
        w5, w50, w95 = np.percentile(wall, [5, 50, 95])
        gm = float(good.mean())
        out.append(
            SimulationResult(
                interval_s=float(t),
                trials=int(config.trials),
                goodput_mean=gm,
                goodput_p5=float(g5),
                goodput_p50=float(g50),
                goodput_p95=float(g95),
                waste_mean=1.0 - gm,
                wall_mean_s=float(wall.mean()),
                wall_p5_s=float(w5),
                wall_p50_s=float(w50),
                wall_p95_s=float(w95),
                failures_mean=float(failures[i].mean()),
            )
        )
    return out


def simulate(config: SimulationConfig, interval_s: float, *, source: str | None = None) -> SimulationResult:
    """Simulate ``config.trials`` runs at one interval.

    Args:
        config: the run, failure and cost model.
        interval_s: T, compute seconds between saves (> 0, and >= L for asynchronous saves).
        source: where ``interval_s`` came from (e.g. ``"--interval"``), named in a refusal.

    Returns:
        Goodput and wall-time statistics over the trials.

    Raises:
        ConfigError: on a bad interval, or inputs under which a run would practically never finish.
    """
    return _results(config, _check_intervals(config, [interval_s], source))[0]


def default_intervals_s(config: SimulationConfig, *, points: int = 24, span: float = 3.0) -> np.ndarray:
    """A geometric grid of intervals around Daly's optimum, from ``T*/span`` to ``T* * span``.

    With an even number of points (the default) the grid straddles T* without containing it, so the best
    swept interval is found by the simulation, not handed to it.

    Intervals below the persist latency L are dropped (the grid then starts at L).

    Args:
        config: the simulation inputs.
        points: number of grid points (>= 3).
        span: ratio between the center and either end (> 1).

    Returns:
        The intervals in seconds, increasing.
    """
    if int(points) < 3:
        raise ConfigError(f"a sweep needs at least 3 points, got {points}")
    if not float(span) > 1:
        raise ConfigError(f"sweep span must be > 1, got {span}")
    center = daly_interval_s(config.checkpoint_s, config.mtbf_s)
    if center <= 0:
        center = config.effective_persist_s or config.mtbf_s / 100.0
    grid = center * np.geomspace(1.0 / span, span, int(points))
    if config.persist_s is not None:
        lat = config.effective_persist_s
        grid = np.unique(np.maximum(grid, lat))
    return grid


def _fit_minimum(taus: np.ndarray, waste: np.ndarray, best: int) -> float | None:
    """Minimum of a least-squares fit ``a/T + b T + c`` over the points within a factor 2 of the best."""
    sel = (taus >= taus[best] / 2.0) & (taus <= taus[best] * 2.0)
    if int(sel.sum()) < 3:
        return None
    t = taus[sel]
    design = np.column_stack([1.0 / t, t, np.ones_like(t)])
    (a, b, _), *_ = np.linalg.lstsq(design, waste[sel], rcond=None)
    if not (a > 0 and b > 0):
        return None
    return float(math.sqrt(a / b))


def sweep(
    config: SimulationConfig,
    intervals_s: Sequence[float] | np.ndarray | None = None,
    *,
    points: int = 24,
    span: float = 3.0,
    batch: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> SweepResult:
    """Simulate every interval of a sweep and find the best.

    Args:
        config: the simulation inputs.
        intervals_s: the intervals to try, in seconds; default :func:`default_intervals_s`.
        points: grid points when ``intervals_s`` is None.
        span: grid span when ``intervals_s`` is None.
        batch: intervals simulated together (results do not depend on it; it sets how often ``progress``
            is called).
        progress: called as ``progress(done, total)`` after each batch, e.g. to move a progress bar.

    Returns:
        The per-interval results and the best interval.

    Raises:
        ConfigError: on bad intervals or inputs.
    """
    if intervals_s is None:
        taus = default_intervals_s(config, points=points, span=span)
        source = f"the longest of the sweep, {span:g} x Daly's optimum"
    else:
        taus = np.unique(np.asarray(intervals_s, dtype=float))
        source = "the longest interval given to the sweep"
    taus = _check_intervals(config, taus, source)
    results: list[SimulationResult] = []
    step = max(int(batch), 1)
    for start in range(0, taus.size, step):
        results.extend(_results(config, taus[start : start + step]))
        if progress is not None:
            progress(len(results), int(taus.size))
    waste = np.array([r.waste_mean for r in results])
    best = int(np.argmin(waste))
    return SweepResult(
        results=tuple(results),
        best_interval_s=float(taus[best]),
        fitted_interval_s=_fit_minimum(taus, waste, best),
    )
