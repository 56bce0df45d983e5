"""Monte Carlo failure simulator against the analytic model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trainguard.errors import ConfigError
from trainguard.planning.interval import (
    daly_interval_s,
    expected_wall_time_s,
    expected_waste_fraction,
    expected_waste_fraction_exact,
)
from trainguard.planning.simulate import SimulationConfig, default_intervals_s, simulate, sweep

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0

# Daly's example: checkpoint 5 min, restart 10 min, MTBF 24 h; a 100-day run sees ~110 failures.
DALY = {"work_s": 100 * DAY, "checkpoint_s": 5 * MIN, "restart_s": 10 * MIN, "mtbf_s": 24 * HOUR}


def test_simulated_waste_for_exponential_failures_matches_the_analytic_waste() -> None:
    config = SimulationConfig(**DALY, trials=2000, seed=1)
    t = daly_interval_s(5 * MIN, 24 * HOUR)
    result = simulate(config, t)
    exact = expected_waste_fraction_exact(t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN)
    first_order = expected_waste_fraction(t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN)
    # Daly's complete model is what the simulation converges to; the first-order formula is within 5 %.
    assert result.waste_mean == pytest.approx(exact, rel=0.02)
    assert result.waste_mean == pytest.approx(first_order, rel=0.05)
    assert result.wall_mean_s == pytest.approx(
        expected_wall_time_s(100 * DAY, t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN), rel=0.005
    )
    assert result.failures_mean == pytest.approx(result.wall_mean_s / (24 * HOUR), rel=0.03)
    assert result.goodput_p5 < result.goodput_p50 < result.goodput_p95
    assert result.wall_p5_s < result.wall_p50_s < result.wall_p95_s


def test_the_best_swept_interval_is_within_10_percent_of_dalys_optimum() -> None:
    config = SimulationConfig(**DALY, trials=2000, seed=2)
    target = daly_interval_s(5 * MIN, 24 * HOUR)
    # A plain grid from 30 min to 5 h in 5-minute steps, not centered on the answer.
    res = sweep(config, np.arange(30 * MIN, 5 * HOUR, 5 * MIN))
    assert res.best_interval_s == pytest.approx(target, rel=0.10)
    assert res.fitted_interval_s == pytest.approx(target, rel=0.05)
    assert res.best.interval_s == res.best_interval_s


def test_equal_seeds_give_equal_results_and_a_sweep_point_equals_a_single_run() -> None:
    config = SimulationConfig(**{**DALY, "work_s": 20 * DAY}, trials=300, seed=7)
    a = simulate(config, 2 * HOUR)
    assert simulate(config, 2 * HOUR) == a
    res = sweep(config, [1 * HOUR, 2 * HOUR, 3 * HOUR], batch=1)
    assert res.results[1] == a


def test_without_failures_goodput_is_compute_over_compute_plus_checkpoints() -> None:
    config = SimulationConfig(work_s=10 * HOUR, checkpoint_s=MIN, mtbf_s=1e15, trials=10)
    result = simulate(config, HOUR)
    assert result.wall_mean_s == pytest.approx(10 * HOUR + 9 * MIN)
    assert result.failures_mean == 0


def test_async_saves_agree_with_the_first_order_waste_with_the_persist_lag() -> None:
    c, lat, m = 10.0, 10 * MIN, 24 * HOUR
    config = SimulationConfig(
        work_s=100 * DAY, checkpoint_s=c, persist_s=lat, restart_s=10 * MIN, mtbf_s=m, trials=2000
    )
    for t in (10 * MIN, 25 * MIN, 50 * MIN):
        waste = expected_waste_fraction(t, c, m, restart_s=10 * MIN, persist_s=lat)
        assert simulate(config, t).waste_mean == pytest.approx(waste, rel=0.05)


def test_an_async_save_that_persists_slowly_costs_more_than_a_fast_one() -> None:
    base = {"work_s": 50 * DAY, "checkpoint_s": 10.0, "mtbf_s": 24 * HOUR, "trials": 1000}
    fast = simulate(SimulationConfig(**base, persist_s=10.0), HOUR)
    slow = simulate(SimulationConfig(**base, persist_s=50 * MIN), HOUR)
    assert slow.waste_mean > fast.waste_mean


def test_weibull_with_shape_one_is_the_exponential_case() -> None:
    config = SimulationConfig(**DALY, distribution="weibull", weibull_shape=1.0, trials=2000, seed=3)
    t = daly_interval_s(5 * MIN, 24 * HOUR)
    exact = expected_waste_fraction_exact(t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN)
    assert simulate(config, t).waste_mean == pytest.approx(exact, rel=0.02)


def test_weibull_failures_with_a_decreasing_hazard_keep_the_mean_failure_rate() -> None:
    config = SimulationConfig(**DALY, distribution="weibull", weibull_shape=0.7, trials=1000, seed=4)
    result = simulate(config, 2 * HOUR)
    # A renewal process fails wall / MTBF times on average whatever the shape (elementary renewal theorem).
    assert result.failures_mean == pytest.approx(result.wall_mean_s / (24 * HOUR), rel=0.05)
    assert 0 < result.waste_mean < 0.2


def test_thousands_of_trials_take_well_under_a_few_seconds() -> None:
    config = SimulationConfig(**DALY, trials=5000)
    start = time.perf_counter()
    simulate(config, 2 * HOUR)
    assert time.perf_counter() - start < 3.0


def test_the_default_sweep_grid_surrounds_daly_and_respects_the_persist_latency() -> None:
    grid = default_intervals_s(SimulationConfig(**DALY), points=25, span=3.0)
    target = daly_interval_s(5 * MIN, 24 * HOUR)
    assert grid[0] == pytest.approx(target / 3) and grid[-1] == pytest.approx(target * 3)
    grid = default_intervals_s(SimulationConfig(**DALY, persist_s=3 * HOUR), points=25)
    assert grid.min() == pytest.approx(3 * HOUR)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"mtbf_s": -1.0}, "mtbf_s must be > 0"),
        ({"work_s": 0.0}, "work_s must be > 0"),
        ({"checkpoint_s": -1.0}, "checkpoint_s must be >= 0"),
        ({"trials": 0}, "trials must be >= 1"),
        ({"distribution": "lognormal"}, "unknown failure distribution"),
        ({"distribution": "weibull", "weibull_shape": 0.0}, "weibull_shape must be > 0"),
    ],
)
def test_bad_simulation_inputs_raise_config_error(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SimulationConfig(**{**DALY, **kwargs})


def test_an_interval_shorter_than_the_persist_latency_is_rejected() -> None:
    with pytest.raises(ConfigError, match="shorter than the persist latency"):
        simulate(SimulationConfig(**DALY, persist_s=HOUR), 30 * MIN)


def test_a_run_that_could_never_finish_is_rejected_instead_of_looping() -> None:
    with pytest.raises(ConfigError, match="almost never finish"):
        simulate(SimulationConfig(work_s=100 * DAY, checkpoint_s=MIN, mtbf_s=HOUR), 100 * DAY)
