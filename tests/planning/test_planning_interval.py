"""Young and Daly optimum intervals, expected waste, dollar optimum, async rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import ConfigError
from trainguard.planning.interval import (
    daly_interval_s,
    dollar_optimal_interval_s,
    expected_cost_usd_per_s,
    expected_wall_time_s,
    expected_waste_fraction,
    expected_waste_fraction_exact,
    lost_work_per_failure_s,
    optimal_interval_s,
    young_interval_s,
)

MIN, HOUR = 60.0, 3600.0


def test_daly_published_example_gives_an_optimum_of_117_minutes() -> None:
    # Daly (2006): checkpoint 5 min, restart 10 min, MTBF 24 h. The restart time does not move the optimum.
    t = daly_interval_s(5 * MIN, 24 * HOUR)
    assert t / MIN == pytest.approx(116.7, abs=0.05)
    assert round(t / MIN) == 117


def test_young_for_a_7_second_checkpoint_and_72_hour_mtbf_gives_31_7_minutes() -> None:
    assert young_interval_s(7, 72 * HOUR) / MIN == pytest.approx(31.7, abs=0.05)


def test_daly_falls_back_to_the_mtbf_when_a_checkpoint_takes_more_than_twice_the_mtbf() -> None:
    assert daly_interval_s(3 * HOUR, 1 * HOUR) == 1 * HOUR


def test_daly_approaches_young_when_checkpoints_are_cheap() -> None:
    assert daly_interval_s(1e-3, 72 * HOUR) == pytest.approx(young_interval_s(1e-3, 72 * HOUR), rel=1e-3)


@settings(max_examples=100, deadline=None)
@given(
    checkpoint_s=st.floats(min_value=0.1, max_value=3600),
    mtbf_s=st.floats(min_value=3600, max_value=1e7),
    factor=st.floats(min_value=0.2, max_value=5.0),
)
def test_first_order_waste_is_minimized_at_the_young_interval(
    checkpoint_s: float, mtbf_s: float, factor: float
) -> None:
    t = young_interval_s(checkpoint_s, mtbf_s)
    best = expected_waste_fraction(t, checkpoint_s, mtbf_s, restart_s=600)
    assert best <= expected_waste_fraction(t * factor, checkpoint_s, mtbf_s, restart_s=600) + 1e-12


@settings(max_examples=40, deadline=None)
@given(
    ratio=st.floats(min_value=1e-5, max_value=0.5),
    mtbf_s=st.floats(min_value=3600, max_value=1e7),
    restart_s=st.floats(min_value=0, max_value=3600),
)
def test_daly_interval_is_within_one_percent_of_the_minimum_of_the_exact_exponential_model(
    ratio: float, mtbf_s: float, restart_s: float
) -> None:
    c = ratio * mtbf_s
    t = daly_interval_s(c, mtbf_s)
    grid = np.geomspace(t / 2, t * 2, 2001)
    waste = [expected_waste_fraction_exact(x, c, mtbf_s, restart_s=restart_s) for x in grid]
    assert t == pytest.approx(float(grid[int(np.argmin(waste))]), rel=0.01)


def test_first_order_waste_is_close_to_the_exact_model_for_the_daly_example() -> None:
    t = daly_interval_s(5 * MIN, 24 * HOUR)
    first = expected_waste_fraction(t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN)
    exact = expected_waste_fraction_exact(t, 5 * MIN, 24 * HOUR, restart_s=10 * MIN)
    assert first == pytest.approx(0.0903, abs=5e-4)
    assert exact == pytest.approx(0.0874, abs=5e-4)


def test_detection_and_restart_time_add_to_the_waste_per_failure() -> None:
    base = expected_waste_fraction(1800, 10, 86400)
    assert expected_waste_fraction(1800, 10, 86400, restart_s=600, detect_s=60) == pytest.approx(
        base + 660 / 86400
    )


def test_async_interval_is_never_shorter_than_the_persist_latency() -> None:
    # Staging blocks 1 s, so sqrt(2 C M) is ~12 min, but the save needs 30 min to be durable.
    assert optimal_interval_s(1.0, 72 * HOUR, persist_s=30 * MIN) == 30 * MIN
    assert optimal_interval_s(1.0, 72 * HOUR, persist_s=30 * MIN, method="young") == 30 * MIN
    assert optimal_interval_s(1.0, 72 * HOUR, persist_s=10) == pytest.approx(daly_interval_s(1.0, 72 * HOUR))


def test_async_lost_work_per_failure_is_half_the_interval_plus_the_persist_lag() -> None:
    assert lost_work_per_failure_s(3600, 60) == 1800
    assert lost_work_per_failure_s(3600, 1, persist_s=600) == pytest.approx(1800 + 599)


def test_dollar_optimum_equals_young_when_a_checkpoint_costs_only_its_blocking_time() -> None:
    cluster_usd_per_s = 1024 * 2.5 / 3600
    k = 49 * cluster_usd_per_s
    assert dollar_optimal_interval_s(k, cluster_usd_per_s, 72 * HOUR) == pytest.approx(
        young_interval_s(49, 72 * HOUR)
    )


def test_dollar_optimum_grows_with_direct_charges_per_checkpoint_and_minimizes_cost() -> None:
    c = 0.5
    t = dollar_optimal_interval_s(30.0, c, 72 * HOUR)
    assert t > dollar_optimal_interval_s(10.0, c, 72 * HOUR)
    cost = expected_cost_usd_per_s(t, 30.0, c, 72 * HOUR)
    assert cost < expected_cost_usd_per_s(t * 0.7, 30.0, c, 72 * HOUR)
    assert cost < expected_cost_usd_per_s(t * 1.4, 30.0, c, 72 * HOUR)


def test_expected_wall_time_of_a_long_run_matches_the_steady_state_waste() -> None:
    work = 1000 * 86400.0
    t = 7001.0
    wall = expected_wall_time_s(work, t, 300, 86400, restart_s=600)
    waste = expected_waste_fraction_exact(t, 300, 86400, restart_s=600)
    assert 1 - work / wall == pytest.approx(waste, rel=1e-3)


def test_expected_wall_time_without_failures_is_compute_plus_checkpoints() -> None:
    # Ten intervals of 1 h need nine checkpoints of 1 min in between.
    assert expected_wall_time_s(10 * HOUR, HOUR, MIN, 1e15) == pytest.approx(10 * HOUR + 9 * MIN, rel=1e-6)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: young_interval_s(7, -72 * HOUR), "mtbf_s must be a positive"),
        (lambda: daly_interval_s(7, 0), "mtbf_s must be a positive"),
        (lambda: daly_interval_s(-1, 3600), "checkpoint_s must be >= 0"),
        (lambda: expected_waste_fraction(0, 7, 3600), "interval_s must be a positive"),
        (lambda: optimal_interval_s(7, 3600, method="guess"), "unknown interval method"),
        (lambda: dollar_optimal_interval_s(1, 0, 3600), "cluster_usd_per_s must be > 0"),
        (lambda: young_interval_s(math.nan, 3600), "checkpoint_s must be >= 0"),
    ],
)
def test_bad_arguments_raise_config_error(call, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        call()


def test_waste_is_a_smooth_bowl_around_the_optimum() -> None:
    c, m = 49.0, 72 * HOUR
    t = daly_interval_s(c, m)
    w = [expected_waste_fraction(t * f, c, m) for f in (0.5, 0.8, 1.0, 1.25, 2.0)]
    assert w[2] == min(w)
    assert w[0] > w[1] and w[4] > w[3]
