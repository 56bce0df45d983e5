"""``trainguard plan`` and ``trainguard simulate``."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from trainguard.cli.main import main

BRIEF = [
    "plan",
    "--params", "70B",
    "--precision", "bf16",
    "--gpus", "1024",
    "--write-bandwidth", "20GB/s",
    "--mtbf", "72h",
    "--price", "$2.50",
    "--run-length", "30d",
]  # fmt: skip


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_plan_json_gives_young_daly_and_the_waste_for_dalys_example() -> None:
    code, out = run("plan", "--checkpoint-time", "5min", "--restart-time", "10min", "--mtbf", "24h", "--json")
    assert code == 0, out
    d = json.loads(out)
    assert d["daly_interval_s"] / 60 == pytest.approx(116.7, abs=0.05)
    assert d["young_interval_s"] == pytest.approx(7200.0)
    assert d["waste_fraction"] == pytest.approx(0.0903, abs=5e-4)


def test_job_description_flags_add_their_outputs_to_the_same_json_object() -> None:
    code, out = run(*BRIEF, "--json", "--compare", "4h")
    assert code == 0, out
    d = json.loads(out)
    for key in ("young_interval_s", "daly_interval_s", "waste_fraction"):
        assert key in d
    assert d["weights_bytes"] == pytest.approx(140e9)
    assert d["checkpoint_bytes"] == pytest.approx(980e9)
    assert d["write_s"] == pytest.approx(49.0)
    assert d["young_interval_s"] / 60 == pytest.approx(84.0)
    assert d["expected_failures"] == pytest.approx(10.0)
    assert d["storage_bytes"] == pytest.approx(3 * 980e9)
    assert d["comparisons"][0]["optimal_if_checkpoint_s"] == pytest.approx(400.0)


def test_plan_prints_a_readable_table() -> None:
    code, out = run(*BRIEF, "--compare", "4h")
    assert code == 0, out
    for text in ("980 GB", "140 GB", "84 min", "Daly (2006)", "recommended", "keep 3", "4 h", "6.667 min"):
        assert text in out


def test_a_per_gpu_mtbf_is_divided_by_the_gpus() -> None:
    code, out = run("plan", "--checkpoint-time", "7s", "--gpu-mtbf", "3072d", "--gpus", "1024", "--json")
    assert code == 0, out
    assert json.loads(out)["mtbf_s"] == pytest.approx(72 * 3600)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--checkpoint-time", "5min", "--mtbf", "-24h"], "MTBF must be > 0"),
        (["--checkpoint-time", "5min", "--mtbf=-24h"], "MTBF must be > 0"),
        (["--checkpoint-time", "5min", "--mtbf", "0h"], "MTBF must be > 0"),
        (["--params", "70B", "--write-bandwidth", "0GB/s", "--mtbf", "72h"], "write bandwidth must be > 0"),
        (["--checkpoint-time", "5min", "--mtbf", "24hx"], "unknown unit 'hx'"),
        (["--params", "70Q", "--write-bandwidth", "20GB/s", "--mtbf", "72h"], "unknown suffix 'Q'"),
        (["--checkpoint-time", "5min", "--mtbf", "24h", "--price", "two dollars"], "cannot read"),
        (["--mtbf", "24h"], "--checkpoint-time"),
        (["--checkpoint-time", "5min"], "no MTBF given"),
        (["--params", "70B", "--mtbf", "72", "--write-bandwidth", "20GB/s"], "'72' has no unit"),
        (["--params", "70B", "--mtbf", "72h", "--write-bandwidth", "20"], "'20' has no unit"),
        (["--checkpoint-time", "300", "--mtbf", "24h"], "'300' has no unit"),
        (["--params", "70B", "--mtbf", "72h", "--write-bandwidth", "20gb/s"], "gigabits"),
        (["--params", "70B", "--mtbf", "72s", "--write-bandwidth", "20GB/s"], "goodput -95.8%"),
        (["--params", "70B", "--mtbf", "72s", "--write-bandwidth", "20GB/s"], "outside [0, 100%]"),
        (["--checkpoint-time", "5min", "--mtbf", "1min"], "longer than the job's MTBF of 1 min"),
        (["--checkpoint-time", "5min", "--mtbf", "24h", "--compare", "30h"], "compared interval of 30 h"),
    ],
)
def test_bad_input_to_plan_exits_2_with_a_message_naming_the_problem(args, fragment: str) -> None:
    code, out = run("plan", *args)
    assert code == 2
    assert fragment in out


def test_simulate_json_reports_agreement_with_the_analytic_waste_and_the_best_interval() -> None:
    code, out = run(
        "simulate",
        "--checkpoint-time", "5min", "--restart-time", "10min", "--mtbf", "24h",
        "--run-length", "50d", "--trials", "500", "--points", "9", "--json",
    )  # fmt: skip
    assert code == 0, out
    d = json.loads(out)
    assert abs(d["relative_difference"]) < 0.05
    assert d["simulated"]["waste_mean"] == pytest.approx(d["waste_fraction_exact"], rel=0.05)
    assert d["sweep"]["best_interval_s"] == pytest.approx(d["daly_interval_s"], rel=0.25)
    assert len(d["sweep"]["points"]) == 9


def test_simulate_prints_goodput_percentiles_and_the_comparison() -> None:
    code, out = run(
        "simulate", "--checkpoint-time", "7s", "--mtbf", "72h", "--trials", "200", "--no-sweep",
        "--distribution", "weibull", "--shape", "0.7",
    )  # fmt: skip
    assert code == 0, out
    for text in ("goodput", "p95", "wall time", "simulated waste", "weibull"):
        assert text in out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--checkpoint-time", "5min", "--mtbf", "-1h"], "MTBF must be > 0"),
        (["--checkpoint-time", "5 fortnights", "--mtbf", "24h"], "unknown unit"),
        (
            ["--checkpoint-time", "5min", "--mtbf", "24h", "--persist-time", "2h", "--interval", "1h"],
            "persist latency",
        ),
        (["--mtbf", "24h"], "--checkpoint-time"),
        (["--checkpoint-time", "5min", "--mtbf", "72"], "'72' has no unit"),
        (
            ["--checkpoint-time", "5min", "--mtbf", "1min", "--no-sweep"],
            "interval 300 s (no --interval given: the optimum for C = 5 min and MTBF = 1 min",
        ),
        (
            ["--checkpoint-time", "5min", "--mtbf", "1min", "--interval", "2min"],
            "interval 120 s (--interval)",
        ),
        (["--checkpoint-time", "20s", "--mtbf", "2min"], "longest of the sweep, 3 x Daly's optimum"),
    ],
)
def test_bad_input_to_simulate_exits_2(args, fragment: str) -> None:
    code, out = run("simulate", *args)
    assert code == 2
    assert fragment in out


def test_help_lists_plan_and_simulate() -> None:
    code, out = run("--help")
    assert code == 0
    assert "plan" in out and "simulate" in out


def test_a_plan_that_is_printed_never_has_goodput_outside_0_1_nor_an_interval_beyond_the_mtbf() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from trainguard.errors import ConfigError
    from trainguard.planning.capacity import JobSpec, plan_job

    seconds = st.floats(min_value=0.1, max_value=1e7, allow_nan=False)

    @settings(max_examples=300, deadline=None)
    @given(c=seconds, m=seconds, r=st.floats(min_value=0, max_value=1e6), t=st.one_of(st.none(), seconds))
    def check(c: float, m: float, r: float, t: float | None) -> None:
        try:
            plan = plan_job(
                JobSpec(checkpoint_s=c, mtbf_s=m, restart_s=r, compare_intervals_s=() if t is None else (t,))
            )
        except ConfigError as e:
            assert "MTBF" in str(e)
            return
        assert 0.0 <= plan.goodput <= 1.0 and plan.interval_s <= plan.mtbf_s
        for point in plan.comparisons:
            assert 0.0 <= point.goodput <= 1.0 and point.interval_s <= plan.mtbf_s

    check()
