"""Cost and capacity model of a job's checkpoints."""

from __future__ import annotations

import math

import pytest

from trainguard.errors import ConfigError
from trainguard.planning.capacity import (
    JobSpec,
    cluster_mtbf_s,
    p_any_failure,
    plan_job,
    state_bytes_per_param,
)

MIN, HOUR, DAY = 60.0, 3600.0, 86400.0

BRIEF = {
    "params": 70e9,
    "precision": "bf16",
    "gpus": 1024,
    "write_bandwidth_bytes_per_s": 20e9,
    "mtbf_s": 72 * HOUR,
    "gpu_hour_usd": 2.5,
    "run_s": 30 * DAY,
}


def test_bf16_weights_with_adamw_take_14_bytes_per_parameter() -> None:
    assert state_bytes_per_param("bf16", "adamw") == (2.0, 14.0)
    assert state_bytes_per_param("fp32", "adamw") == (4.0, 12.0)  # no separate master copy
    assert state_bytes_per_param("bf16", "none") == (2.0, 2.0)
    assert state_bytes_per_param("BF16", "sgd", master_weights=False) == (2.0, 6.0)


def test_the_brief_70b_model_is_140_gb_of_weights_but_980_gb_of_training_state() -> None:
    plan = plan_job(JobSpec(**BRIEF))
    assert plan.weights_bytes == pytest.approx(140e9)
    assert plan.full_state_bytes == pytest.approx(980e9)
    assert plan.checkpoint_bytes == pytest.approx(980e9)
    assert plan.write_s == pytest.approx(49.0)
    assert plan.checkpoint_s == pytest.approx(49.0)
    assert plan.young_interval_s / MIN == pytest.approx(84.0)
    assert plan.interval_s == plan.daly_interval_s


def test_a_weights_only_checkpoint_of_the_brief_case_gives_young_31_7_minutes() -> None:
    plan = plan_job(JobSpec(**BRIEF, weights_only=True))
    assert plan.checkpoint_s == pytest.approx(7.0)
    assert plan.young_interval_s / MIN == pytest.approx(31.7, abs=0.05)


def test_the_brief_case_reports_failures_costs_checkpoints_and_storage_over_the_run() -> None:
    plan = plan_job(JobSpec(**BRIEF, keep=3))
    assert plan.cluster_usd_per_hour == pytest.approx(2560.0)
    assert plan.checkpoint_cost_usd == pytest.approx(49 * 2560 / 3600)
    assert plan.expected_failures == pytest.approx(10.0)
    assert plan.p_any_failure == pytest.approx(1 - math.exp(-10))
    assert plan.run_cost_usd == pytest.approx(30 * 24 * 2560)
    assert plan.waste_usd == pytest.approx(plan.waste_fraction * plan.run_cost_usd)
    assert plan.expected_failure_cost_usd == pytest.approx(10 * plan.failure_cost_usd)
    assert plan.checkpoints_written == pytest.approx(30 * DAY / (plan.interval_s + 49.0))
    assert plan.storage_bytes == pytest.approx(3 * 980e9)
    assert plan.storage_peak_bytes == pytest.approx(4 * 980e9)
    assert 0.97 < plan.goodput < 0.99


def test_cluster_mtbf_is_the_per_gpu_mtbf_divided_by_the_gpus() -> None:
    assert cluster_mtbf_s(1024 * 72 * HOUR, 1024) == pytest.approx(72 * HOUR)
    plan = plan_job(JobSpec(**{**BRIEF, "mtbf_s": None}, gpu_mtbf_s=1024 * 72 * HOUR))
    assert plan.mtbf_s == pytest.approx(72 * HOUR)
    assert plan.gpu_mtbf_s == pytest.approx(1024 * 72 * HOUR)


def test_the_probability_of_at_least_one_failure_over_a_run_is_one_minus_exp_of_minus_run_over_mtbf() -> None:
    assert p_any_failure(72 * HOUR, 72 * HOUR) == pytest.approx(1 - math.exp(-1))
    assert p_any_failure(0, 72 * HOUR) == 0


def test_restart_time_defaults_to_the_load_time_and_can_be_given() -> None:
    assert plan_job(JobSpec(**BRIEF, read_bandwidth_bytes_per_s=98e9)).restart_s == pytest.approx(10.0)
    assert plan_job(JobSpec(**BRIEF, restart_s=600)).restart_s == 600


def test_async_saves_block_for_staging_and_are_planned_no_shorter_than_their_persist_latency() -> None:
    plan = plan_job(JobSpec(**{**BRIEF, "write_bandwidth_bytes_per_s": 0.1e9}, async_save=True))
    # 980 GB staged by 1024 GPUs at 20 GB/s each: ~48 ms of blocking; 9800 s to persist at 100 MB/s.
    assert plan.checkpoint_s == pytest.approx(980e9 / (1024 * 20e9))
    assert plan.persist_s == pytest.approx(plan.checkpoint_s + 9800.0)
    assert plan.interval_s == pytest.approx(plan.persist_s)
    assert "persist latency" in plan.interval_reason
    assert plan.waste_fraction_exact is None


def test_the_minimal_spec_gives_the_daly_example() -> None:
    d = plan_job(JobSpec(checkpoint_s=5 * MIN, restart_s=10 * MIN, mtbf_s=24 * HOUR)).to_dict()
    assert d["daly_interval_s"] / MIN == pytest.approx(116.7, abs=0.05)
    assert d["young_interval_s"] == pytest.approx(7200.0)
    assert d["waste_fraction"] == pytest.approx(0.0903, abs=5e-4)
    # Fields the inputs do not determine are left out of the dict.
    assert "checkpoint_bytes" not in d and "waste_usd" not in d and "comparisons" not in d


def test_a_compared_interval_reports_the_checkpoint_time_that_would_make_it_optimal() -> None:
    plan = plan_job(JobSpec(**BRIEF, compare_intervals_s=(4 * HOUR, 6 * HOUR)))
    four, six = plan.comparisons
    assert four.optimal_if_checkpoint_s == pytest.approx(400.0)
    assert six.optimal_if_checkpoint_s == pytest.approx(900.0)
    assert plan.waste_fraction < four.waste_fraction < six.waste_fraction
    assert four.extra_waste_usd is not None and four.extra_waste_usd > 0


def test_a_direct_charge_per_checkpoint_lengthens_the_dollar_optimum() -> None:
    base = plan_job(JobSpec(**BRIEF))
    charged = plan_job(JobSpec(**BRIEF, checkpoint_cost_usd=100.0))
    assert base.dollar_optimal_interval_s == pytest.approx(base.young_interval_s)
    assert charged.dollar_optimal_interval_s > base.dollar_optimal_interval_s


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"checkpoint_s": 7}, "no MTBF given"),
        ({"checkpoint_s": 7, "mtbf_s": -3600}, "mtbf_s must be > 0"),
        ({"checkpoint_s": 7, "mtbf_s": 3600, "gpu_mtbf_s": 3600}, "not both"),
        ({"mtbf_s": 3600}, "--checkpoint-time"),
        (
            {"mtbf_s": 3600, "params": 70e9, "write_bandwidth_bytes_per_s": 0},
            "write_bandwidth_bytes_per_s must be > 0",
        ),
        ({"checkpoint_s": 7, "mtbf_s": 3600, "precision": "bf17"}, "unknown precision"),
        ({"checkpoint_s": 7, "mtbf_s": 3600, "optimizer": "magic"}, "unknown optimizer"),
        ({"checkpoint_s": 7, "mtbf_s": 3600, "gpus": 0}, "gpus must be >= 1"),
        ({"checkpoint_s": 7, "mtbf_s": 3600, "keep": 0}, "keep must be >= 1"),
        ({"checkpoint_s": 0, "mtbf_s": 3600}, "checkpoint time is 0"),
    ],
)
def test_bad_job_descriptions_raise_config_error_naming_the_fix(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        plan_job(JobSpec(**kwargs))
