"""Optimal checkpoint interval: Young (1974), Daly (2006), the expected waste, the dollar optimum, async saves.

Notation (all in seconds): ``C`` the time a checkpoint blocks training, ``M`` the mean time between failures
(MTBF) of the whole job, ``R`` the restart time (relaunch, load the checkpoint, warm up), ``D`` the time to
detect a failure, ``T`` the compute time between two checkpoints (the interval), ``L`` the time from the
start of an asynchronous save until it is durable (``L >= C``; for a synchronous save ``L == C``).

Sources:

- J. W. Young, "A first order approximation to the optimum checkpoint interval", Communications of the ACM
  17(9):530-531, 1974: ``T = sqrt(2 C M)``.
- J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
  Generation Computer Systems 22(3):303-312, 2006: for ``C < 2M``,
  ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C``, else ``T = M``; and the complete model
  of the expected wall time under exponential failures, ``M e^{R/M} (e^{(T + C)/M} - 1)`` per interval.

Every function validates its arguments and raises :class:`~trainguard.errors.ConfigError` on bad input.
"""

from __future__ import annotations

import math
from typing import Literal

from ..errors import ConfigError

Method = Literal["daly", "young"]


def _positive(value: float, name: str, example: str) -> float:
    v = float(value)
    if not (v > 0) or not math.isfinite(v):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}; give e.g. {example}")
    return v


def _non_negative(value: float, name: str, example: str) -> float:
    v = float(value)
    if not (v >= 0) or not math.isfinite(v):
        raise ConfigError(f"{name} must be >= 0 seconds, got {value!r}; give e.g. {example}")
    return v


def _persist(persist_s: float | None, checkpoint_s: float) -> float:
    """The persist latency L, at least C (a save is not durable before it stops blocking)."""
    if persist_s is None:
        return checkpoint_s
    return max(_non_negative(persist_s, "persist_s", "120"), checkpoint_s)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval ``sqrt(2 C M)`` (Young 1974).

    Args:
        checkpoint_s: C, seconds a checkpoint blocks training (>= 0).
        mtbf_s: M, mean time between failures of the job in seconds (> 0).

    Returns:
        The optimum compute time between checkpoints, in seconds.

    Raises:
        ConfigError: if C < 0 or M <= 0.

    Example: C = 7 s, M = 72 h gives 1905 s (31.7 min).
    """
    c = _non_negative(checkpoint_s, "checkpoint_s", "7")
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    return math.sqrt(2.0 * c * m)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (Daly 2006).

    ``T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C`` for ``C < 2M``, else ``T = M``.

    Args:
        checkpoint_s: C, seconds a checkpoint blocks training (>= 0).
        mtbf_s: M, mean time between failures of the job in seconds (> 0).

    Returns:
        The optimum compute time between checkpoints, in seconds.

    Raises:
        ConfigError: if C < 0 or M <= 0.

    Example: Daly's own case, C = 5 min, M = 24 h, gives 7001 s (116.7 min).
    """
    c = _non_negative(checkpoint_s, "checkpoint_s", "300")
    m = _positive(mtbf_s, "mtbf_s", "86400 (24 h)")
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def optimal_interval_s(
    checkpoint_s: float, mtbf_s: float, *, persist_s: float | None = None, method: Method = "daly"
) -> float:
    """The optimum interval with the asynchronous-save rule ``T = max(T_opt(C, M), L)``.

    An asynchronous save blocks training only for C (staging to host memory) but needs L seconds from its
    start to become durable; a new save cannot usefully start before the previous one is durable, so the
    interval is never shorter than L.

    Args:
        checkpoint_s: C, the blocking part of a save in seconds (>= 0).
        mtbf_s: M, the job's MTBF in seconds (> 0).
        persist_s: L, seconds from the start of a save until it is durable; None for a synchronous save
            (L = C).
        method: ``"daly"`` (default) or ``"young"``.

    Returns:
        The interval in seconds.

    Raises:
        ConfigError: on bad arguments or an unknown method.
    """
    if method == "daly":
        t = daly_interval_s(checkpoint_s, mtbf_s)
    elif method == "young":
        t = young_interval_s(checkpoint_s, mtbf_s)
    else:
        raise ConfigError(f"unknown interval method {method!r}; use 'daly' or 'young'")
    return max(t, _persist(persist_s, float(checkpoint_s)))


def lost_work_per_failure_s(
    interval_s: float, checkpoint_s: float = 0.0, *, persist_s: float | None = None
) -> float:
    """Expected work lost to one failure, first order: ``T/2 + (L - C)``.

    A failure strikes at a uniformly random point of an interval and loses the work since the last durable
    checkpoint: T/2 on average. With asynchronous saves a failure in the ``L - C`` seconds while the newest
    save is still persisting also loses the interval before it, which adds ``L - C`` (about ``T/2 + L`` when
    C is small against L). For synchronous saves (L = C) this is T/2, as in Young (1974).

    Args:
        interval_s: T, compute seconds between checkpoints (> 0).
        checkpoint_s: C, blocking seconds per save (>= 0).
        persist_s: L, seconds from save start to durable; None for synchronous saves.

    Returns:
        Seconds of work lost per failure.
    """
    t = _positive(interval_s, "interval_s", "1800")
    c = _non_negative(checkpoint_s, "checkpoint_s", "7")
    return t / 2.0 + (_persist(persist_s, c) - c)


def expected_waste_fraction(
    interval_s: float,
    checkpoint_s: float,
    mtbf_s: float,
    *,
    restart_s: float = 0.0,
    detect_s: float = 0.0,
    persist_s: float | None = None,
) -> float:
    """First-order expected fraction of wall time wasted: ``C/T + (T/2 + (L - C) + D + R) / M``.

    The first term is the blocking cost of checkpoints, the second the work lost and the downtime per
    failure times the failure rate (Young 1974; Daly 2006 to first order). ``1 - waste`` is the
    goodput. The formula is accurate while ``T + C`` is small against M; :func:`expected_waste_fraction_exact`
    is exact for exponential failures.

    Args:
        interval_s: T, compute seconds between checkpoints (> 0).
        checkpoint_s: C, blocking seconds per save (>= 0).
        mtbf_s: M, the job's MTBF in seconds (> 0).
        restart_s: R, seconds from detection until training runs again (>= 0).
        detect_s: D, seconds from the failure until it is detected (>= 0).
        persist_s: L for asynchronous saves (see :func:`lost_work_per_failure_s`).

    Returns:
        The expected waste fraction (may exceed 1 when the inputs are far from sane).
    """
    t = _positive(interval_s, "interval_s", "1800")
    c = _non_negative(checkpoint_s, "checkpoint_s", "7")
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    r = _non_negative(restart_s, "restart_s", "600")
    d = _non_negative(detect_s, "detect_s", "60")
    return c / t + (lost_work_per_failure_s(t, c, persist_s=persist_s) + d + r) / m


def expected_wall_time_s(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    mtbf_s: float,
    *,
    restart_s: float = 0.0,
    detect_s: float = 0.0,
) -> float:
    """Expected wall time of a run with synchronous saves under exponential failures (Daly 2006, complete model).

    The run needs ``work_s`` seconds of compute, split into intervals of T followed by a blocking checkpoint
    of C (no checkpoint after the last, shorter, interval). A failure loses the current interval and costs
    a downtime of ``D + R``; a failure during the downtime starts it again. Each interval of length
    ``s`` (T + C, or the remainder) then takes ``M e^{(D+R)/M} (e^{s/M} - 1)`` seconds on average.

    Args:
        work_s: compute seconds the run needs without failures or checkpoints (> 0).
        interval_s: T (> 0).
        checkpoint_s: C (>= 0).
        mtbf_s: M (> 0).
        restart_s: R (>= 0).
        detect_s: D (>= 0).

    Returns:
        The expected wall time in seconds (``inf`` if it overflows).
    """
    w = _positive(work_s, "work_s", "2592000 (30 d)")
    t = _positive(interval_s, "interval_s", "1800")
    c = _non_negative(checkpoint_s, "checkpoint_s", "7")
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    down = _non_negative(restart_s, "restart_s", "600") + _non_negative(detect_s, "detect_s", "60")
    n_full = max(math.ceil(w / t) - 1, 0)
    rest = w - n_full * t
    try:
        per = m * math.exp(down / m)
        return per * (n_full * math.expm1((t + c) / m) + math.expm1(rest / m))
    except OverflowError:
        return math.inf


def expected_waste_fraction_exact(
    interval_s: float,
    checkpoint_s: float,
    mtbf_s: float,
    *,
    restart_s: float = 0.0,
    detect_s: float = 0.0,
) -> float:
    """Steady-state waste fraction of Daly's complete model for exponential failures and synchronous saves.

    ``1 - T / (M e^{(D+R)/M} (e^{(T+C)/M} - 1))`` (Daly 2006, the complete model per interval). This is what the
    Monte Carlo simulator converges to; the first-order :func:`expected_waste_fraction` is within a few
    percent of it while ``T + C`` is small against M.

    Args:
        interval_s: T (> 0).
        checkpoint_s: C (>= 0).
        mtbf_s: M (> 0).
        restart_s: R (>= 0).
        detect_s: D (>= 0).

    Returns:
        The expected waste fraction in [0, 1).
    """
    t = _positive(interval_s, "interval_s", "1800")
    c = _non_negative(checkpoint_s, "checkpoint_s", "7")
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    down = _non_negative(restart_s, "restart_s", "600") + _non_negative(detect_s, "detect_s", "60")
    try:
        per_interval = m * math.exp(down / m) * math.expm1((t + c) / m)
    except OverflowError:
        return 1.0
    return 1.0 - t / per_interval


def dollar_optimal_interval_s(
    checkpoint_cost_usd: float,
    cluster_usd_per_s: float,
    mtbf_s: float,
    *,
    persist_s: float | None = None,
) -> float:
    """The interval that minimizes dollars rather than seconds: ``T = sqrt(2 K M / c)``, at least L.

    The expected cost per second is ``K / T + c (T/2 + ...) / M`` where K is the full cost of one checkpoint
    (the cluster idling for C, ``c * C``, plus any direct charge such as object-store requests) and c the
    cluster's cost per second; its minimum is Young's formula with C replaced by ``K / c``. With
    ``K = c * C`` it is exactly Young's interval.

    Args:
        checkpoint_cost_usd: K, dollars per checkpoint (> 0).
        cluster_usd_per_s: c, dollars per second of the whole job (> 0).
        mtbf_s: M (> 0).
        persist_s: L for asynchronous saves; the result is never below it.

    Returns:
        The interval in seconds.
    """
    k = float(checkpoint_cost_usd)
    if not (k > 0) or not math.isfinite(k):
        raise ConfigError(f"checkpoint_cost_usd must be > 0, got {checkpoint_cost_usd!r}; give e.g. 1.5")
    c = float(cluster_usd_per_s)
    if not (c > 0) or not math.isfinite(c):
        raise ConfigError(
            f"cluster_usd_per_s must be > 0, got {cluster_usd_per_s!r}; give GPUs and a GPU-hour price"
        )
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    t = math.sqrt(2.0 * k * m / c)
    if persist_s is not None:
        t = max(t, _non_negative(persist_s, "persist_s", "120"))
    return t


def expected_cost_usd_per_s(
    interval_s: float,
    checkpoint_cost_usd: float,
    cluster_usd_per_s: float,
    mtbf_s: float,
    *,
    checkpoint_s: float = 0.0,
    restart_s: float = 0.0,
    detect_s: float = 0.0,
    persist_s: float | None = None,
) -> float:
    """Expected dollars wasted per second of run at interval T, first order.

    ``K / T + c (T/2 + (L - C) + D + R) / M`` with K the cost of one checkpoint and c the cluster's cost per
    second (see :func:`dollar_optimal_interval_s`).

    Returns:
        Dollars per second.
    """
    t = _positive(interval_s, "interval_s", "1800")
    m = _positive(mtbf_s, "mtbf_s", "259200 (72 h)")
    lost = lost_work_per_failure_s(t, checkpoint_s, persist_s=persist_s)
    down = _non_negative(restart_s, "restart_s", "600") + _non_negative(detect_s, "detect_s", "60")
    return float(checkpoint_cost_usd) / t + float(cluster_usd_per_s) * (lost + down) / m
