"""Parsing and formatting of durations, counts, sizes, bandwidths and money."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.errors import ConfigError
from trainguard.planning import units


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("72h", 72 * 3600),
        ("5min", 300),
        ("5m", 300),
        ("7s", 7),
        (" 7 s ", 7),
        ("500ms", 0.5),
        ("1h30min", 5400),
        ("2d", 172800),
        ("1w", 604800),
        ("1y", 365 * 86400),
        ("300s", 300),
        ("1.5e3s", 1500),
        ("0", 0),
    ],
)
def test_durations_with_units_parse_to_seconds(text: str, seconds: float) -> None:
    assert units.parse_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("parse", "text", "value"),
    [
        (units.parse_count, "70B", 70e9),
        (units.parse_count, "7e10", 70e9),
        (units.parse_count, "1.5T", 1.5e12),
        (units.parse_count, "350M", 350e6),
        (units.parse_count, "8k", 8e3),
        (units.parse_bytes, "140GB", 140e9),
        (units.parse_bytes, "1.5TiB", 1.5 * 2**40),
        (units.parse_bytes, "800Mb", 100e6),
        (units.parse_bytes, "512B", 512),
        (units.parse_bytes, "12 bytes", 12),
        (units.parse_bandwidth_bytes_per_s, "100gbps", 12.5e9),
        (units.parse_bandwidth_bytes_per_s, "20GB/s", 20e9),
        (units.parse_bandwidth_bytes_per_s, "20 GB / sec", 20e9),
        (units.parse_bandwidth_bytes_per_s, "2GiB/s", 2 * 2**30),
        (units.parse_bandwidth_bytes_per_s, "100Gbps", 12.5e9),
        (units.parse_bandwidth_bytes_per_s, "5GBps", 5e9),
        (units.parse_money_usd, "$2.50", 2.5),
        (units.parse_money_usd, "2.5", 2.5),
        (units.parse_money_usd, "$2.50/h", 2.5),
        (units.parse_money_usd, "$2.50/gpu-hour", 2.5),
        (units.parse_money_usd, "2.50 USD", 2.5),
        (units.parse_money_usd, "$1,200", 1200),
        (units.parse_money_usd, "$1.84M", 1.84e6),
    ],
)
def test_counts_sizes_bandwidths_and_money_parse_to_base_units(parse, text: str, value: float) -> None:
    assert parse(text) == pytest.approx(value)


@pytest.mark.parametrize(
    ("parse", "text", "fragments"),
    [
        (units.parse_duration_s, "72hx", ["unknown unit 'hx'", "72h"]),
        (units.parse_duration_s, "-24h", ["must be >= 0", "-24h"]),
        (units.parse_duration_s, "soon", ["cannot read", "e.g."]),
        (units.parse_duration_s, "1h 30", ["needs a unit"]),
        (units.parse_duration_s, "", ["empty"]),
        (units.parse_count, "70X", ["unknown suffix 'X'", "70B"]),
        (units.parse_count, "0", ["must be > 0"]),
        (units.parse_bytes, "3 parsecs", ["unknown unit"]),
        (units.parse_bandwidth_bytes_per_s, "0GB/s", ["must be > 0", "20GB/s"]),
        (units.parse_bandwidth_bytes_per_s, "20GB", ["not a rate", "/s"]),
        (units.parse_bandwidth_bytes_per_s, "20GB/h", ["unknown unit"]),
        (units.parse_duration_s, "72", ["no unit", "72h", "72min", "72s"]),
        (units.parse_duration_s, "1.5", ["no unit", "1.5h"]),
        (units.parse_bandwidth_bytes_per_s, "20", ["no unit", "20GB/s", "20Gb/s"]),
        (units.parse_bytes, "512", ["no unit", "512GB", "512B"]),
        (
            units.parse_bandwidth_bytes_per_s,
            "20gb/s",
            [
                "ambiguous",
                "gigabytes",
                "20,000,000,000 bytes/s",
                "gigabits",
                "2,500,000,000 bytes/s",
                "20GB/s",
            ],
        ),
        (units.parse_bandwidth_bytes_per_s, "2 mb / s", ["ambiguous", "megabytes", "megabits", "2Mb/s"]),
        (units.parse_bandwidth_bytes_per_s, "1gib/s", ["ambiguous", "gibibytes", "gibibits", "1GiB/s"]),
        (units.parse_bandwidth_bytes_per_s, "5b/s", ["ambiguous", "5B/s", "5b/s"]),
        (units.parse_bytes, "800mb", ["ambiguous", "800MB", "800Mb"]),
        (units.parse_bytes, "4kb", ["ambiguous", "kilobytes", "kilobits"]),
        (units.parse_money_usd, "-$3", ["must be >= 0"]),
        (units.parse_money_usd, "cheap", ["cannot read", "$2.50"]),
    ],
)
def test_bad_input_raises_config_error_naming_the_problem_and_the_fix(parse, text: str, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        parse(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_zero_duration_is_rejected_where_it_makes_no_sense() -> None:
    with pytest.raises(ConfigError, match="must be > 0"):
        units.parse_duration_s("0h", what="MTBF", allow_zero=False)


def test_config_error_from_parsing_is_also_a_value_error() -> None:
    with pytest.raises(ValueError):
        units.parse_duration_s("72hx")


@settings(max_examples=200, deadline=None)
@given(
    value=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    unit=st.sampled_from(sorted(units.DURATION_UNITS_S)),
)
def test_a_number_with_any_duration_unit_parses_to_the_number_times_its_factor(
    value: float, unit: str
) -> None:
    assert units.parse_duration_s(f"{value!r}{unit}") == pytest.approx(value * units.DURATION_UNITS_S[unit])


@settings(max_examples=300, deadline=None)
@given(seconds=st.floats(min_value=1e-3, max_value=1e10, allow_nan=False))
def test_a_formatted_duration_parses_back_to_the_same_seconds(seconds: float) -> None:
    assert units.parse_duration_s(units.format_duration(seconds)) == pytest.approx(seconds, rel=1e-3)


@settings(max_examples=200, deadline=None)
@given(n=st.floats(min_value=1, max_value=1e17, allow_nan=False))
def test_formatted_sizes_bandwidths_and_counts_parse_back(n: float) -> None:
    assert units.parse_bytes(units.format_bytes(n)) == pytest.approx(n, rel=1e-3)
    assert units.parse_bandwidth_bytes_per_s(units.format_bandwidth(n)) == pytest.approx(n, rel=1e-3)
    assert units.parse_count(units.format_count(n)) == pytest.approx(n, rel=1e-3)


@settings(max_examples=100, deadline=None)
@given(amount=st.floats(min_value=0.01, max_value=1e10, allow_nan=False))
def test_a_formatted_dollar_amount_parses_back(amount: float) -> None:
    assert units.parse_money_usd(units.format_money_usd(amount)) == pytest.approx(amount, rel=1e-2, abs=0.006)


def test_formatting_picks_readable_units() -> None:
    assert units.format_duration(1905) == "31.75 min"
    assert units.format_duration(72 * 3600) == "72 h"
    assert units.format_duration(30 * 86400) == "30 d"
    assert units.format_bytes(980e9) == "980 GB"
    assert units.format_count(70e9) == "70B"
    assert units.format_money_usd(2.5) == "$2.50"
    assert units.format_duration(math.inf) == "inf"
