"""AdaptivePolicy: measured costs, Gamma posterior on the failure rate, Young/Daly interval, event log."""

from __future__ import annotations

import numpy as np
import pytest

from trainguard.errors import ConfigError
from trainguard.planning.adaptive import AdaptivePolicy, posterior_mtbf_s
from trainguard.planning.interval import daly_interval_s, young_interval_s
from trainguard.policies import AnyOf, EveryNSteps, SavePolicy
from trainguard.recovery.events import EventLog, read_events

MIN, HOUR = 60.0, 3600.0


class FakeClock:
    """Wall clock under test control."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(
    policy: AdaptivePolicy, step: int, *, block_s: float, persist_s: float, now_s: float = 0.0
) -> None:
    """Report a save as the manager does: once when it starts, once when it is durable."""
    policy.record_save(step, now_s=now_s, block_s=block_s, persist_s=None)
    policy.record_save(step, now_s=now_s + persist_s, block_s=block_s, persist_s=persist_s)


def test_adaptive_policy_satisfies_the_save_policy_protocol() -> None:
    assert isinstance(AdaptivePolicy(prior_mtbf_s=24 * HOUR), SavePolicy)


def test_posterior_mtbf_is_the_prior_without_data_and_follows_the_data_when_there_is_much() -> None:
    assert posterior_mtbf_s(0, 0, prior_mtbf_s=72 * HOUR, prior_failures=1) == 72 * HOUR
    assert posterior_mtbf_s(0, 72 * HOUR, prior_mtbf_s=72 * HOUR, prior_failures=1) == 144 * HOUR
    many = posterior_mtbf_s(1000, 1000 * 2 * HOUR, prior_mtbf_s=72 * HOUR, prior_failures=1)
    assert many == pytest.approx(2 * HOUR, rel=0.05)


def test_it_converges_toward_the_daly_interval_of_a_synthetic_failure_rate_and_measured_costs() -> None:
    true_mtbf, c, lat = 2 * HOUR, 20.0, 90.0
    target = daly_interval_s(c, true_mtbf)
    clock = FakeClock()
    # The prior (24 h) is 12x too optimistic; the run's own failures must correct it.
    policy = AdaptivePolicy(prior_mtbf_s=24 * HOUR, run_start_s=0.0, wall_clock=clock, recompute_s=0)
    failures = np.cumsum(np.random.default_rng(0).exponential(true_mtbf, 3000))
    errors = []
    seen = 0
    for step, horizon_h in enumerate([10, 100, 1000, 5000]):
        while failures[seen] < horizon_h * HOUR:
            policy.observe_failure(float(failures[seen]))
            seen += 1
        clock.t = horizon_h * HOUR
        record(policy, step, block_s=c, persist_s=lat)
        errors.append(abs(policy.interval_s / target - 1))
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 0.03
    assert policy.decision.block_s == c and policy.decision.persist_s == lat
    assert policy.decision.failures == seen


def test_it_never_goes_below_the_measured_persist_latency_even_when_the_bounds_say_so() -> None:
    policy = AdaptivePolicy(prior_mtbf_s=HOUR, min_interval_s=1, max_interval_s=10, recompute_s=0)
    record(policy, 1, block_s=0.5, persist_s=300.0)
    assert policy.interval_s == 300.0
    assert "persist latency" in policy.decision.reason


def test_it_is_clamped_to_the_user_bounds() -> None:
    high = AdaptivePolicy(prior_mtbf_s=1e9, max_interval_s=2 * HOUR, prior_failures=100)
    record(high, 1, block_s=60.0, persist_s=60.0)
    assert high.interval_s == 2 * HOUR and "capped at max_interval_s" in high.decision.reason
    low = AdaptivePolicy(prior_mtbf_s=HOUR, min_interval_s=30 * MIN)
    record(low, 1, block_s=0.01, persist_s=0.01)
    assert low.interval_s == 30 * MIN and "raised to min_interval_s" in low.decision.reason


def test_without_bind_it_uses_the_prior_alone() -> None:
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, prior_failures=1e6, method="young")
    record(policy, 1, block_s=7.0, persist_s=7.0)
    assert policy.interval_s == pytest.approx(young_interval_s(7.0, 72 * HOUR), rel=1e-3)


def test_it_saves_after_min_interval_until_a_first_save_is_measured() -> None:
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, min_interval_s=90)
    assert policy.interval_s == 90 and "no save measured yet" in policy.decision.reason
    assert AdaptivePolicy(prior_mtbf_s=72 * HOUR, initial_block_s=7).interval_s == pytest.approx(
        daly_interval_s(7, 72 * HOUR), rel=1e-3
    )


def test_should_save_fires_once_the_interval_has_passed_since_the_last_save() -> None:
    policy = AdaptivePolicy(
        prior_mtbf_s=72 * HOUR, prior_failures=1e6, initial_block_s=7, wall_clock=FakeClock()
    )
    t = policy.interval_s
    assert not policy.should_save(0, now_s=1000.0)  # the first call starts the clock
    assert not policy.should_save(1, now_s=1000.0 + t - 1)
    assert policy.should_save(2, now_s=1000.0 + t)
    policy.record_save(2, now_s=1000.0 + t, block_s=7.0, persist_s=None)
    assert not policy.should_save(3, now_s=1000.0 + t + 1)


def test_one_slow_save_does_not_move_the_interval() -> None:
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, prior_failures=1e6, recompute_s=0)
    for step in range(5):
        record(policy, step, block_s=7.0, persist_s=7.0)
    before = policy.interval_s
    record(policy, 5, block_s=700.0, persist_s=700.0)  # e.g. a stalled file system, once
    assert policy.interval_s == pytest.approx(before)


def test_it_reads_failures_from_the_event_log_and_logs_its_choice(tmp_path) -> None:
    start = 1_700_000_000.0
    supervisor = EventLog(tmp_path, "supervisor")
    supervisor.write("run_start", t=start)
    for i in range(1, 11):
        supervisor.write("failure", t=start + i * 2 * HOUR, exit_code=1)
    clock = FakeClock(start + 20 * HOUR)
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, wall_clock=clock, recompute_s=0, log_refresh_s=0)
    manager = EventLog(tmp_path, "manager")
    AnyOf(EveryNSteps(10_000), policy).bind(str(tmp_path), manager)  # bind passes through AnyOf
    record(policy, 1, block_s=20.0, persist_s=20.0)
    d = policy.decision
    assert d.failures == 10
    assert d.exposure_s == pytest.approx(20 * HOUR)
    assert d.mtbf_s == pytest.approx((72 * HOUR + 20 * HOUR) / 11)
    assert policy.interval_s == pytest.approx(daly_interval_s(20.0, d.mtbf_s))
    events = read_events(tmp_path, event="adaptive_interval")
    assert events, "the chosen interval was not logged"
    last = events[-1]
    for key in ("interval_s", "block_s", "persist_s", "mtbf_s", "failures", "reason"):
        assert key in last
    assert last["interval_s"] == pytest.approx(policy.interval_s)
    assert last["failures"] == 10
    # A failure recorded later is picked up on the next refresh.
    supervisor.write("failure", t=start + 21 * HOUR)
    clock.t = start + 22 * HOUR
    policy.should_save(2, now_s=1.0)
    assert policy.decision.failures == 11
    manager.close()
    supervisor.close()


def test_only_notable_changes_of_the_interval_are_logged(tmp_path) -> None:
    log = EventLog(tmp_path, "manager")
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, prior_failures=1e6, recompute_s=0, change_ratio=0.1)
    policy.bind(str(tmp_path), log)
    for step in range(10):
        record(policy, step, block_s=7.0 + 0.01 * step, persist_s=7.0)
    n = len(read_events(tmp_path, event="adaptive_interval"))
    assert n == 2  # at bind (nothing measured yet) and when the first save was measured
    for step in range(
        10, 20
    ):  # the blocking time grows 8x: the median moves, and each notable step is logged
        record(policy, step, block_s=60.0, persist_s=60.0)
    m = len(read_events(tmp_path, event="adaptive_interval"))
    assert m > n
    for step in range(20, 30):
        record(policy, step, block_s=60.0, persist_s=60.0)
    assert len(read_events(tmp_path, event="adaptive_interval")) == m
    log.close()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"prior_mtbf_s": -1}, "prior_mtbf_s and prior_failures must be > 0"),
        ({"prior_mtbf_s": 3600, "prior_failures": 0}, "prior_mtbf_s and prior_failures must be > 0"),
        ({"prior_mtbf_s": 3600, "min_interval_s": 0}, "min_interval_s"),
        ({"prior_mtbf_s": 3600, "min_interval_s": 100, "max_interval_s": 10}, "max_interval_s"),
        ({"prior_mtbf_s": 3600, "method": "guess"}, "unknown interval method"),
        ({"prior_mtbf_s": 3600, "initial_block_s": -1}, "initial_block_s must be >= 0"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        AdaptivePolicy(**kwargs)


def test_failures_are_dated_at_their_death_and_checkpointed_preemptions_are_not_failures(tmp_path) -> None:
    start = 1_700_000_000.0
    supervisor = EventLog(tmp_path, "supervisor")
    supervisor.write("run_start", t=start)
    supervisor.write("failure", t=start + HOUR, t_death=start - HOUR, cause="crash")
    supervisor.write("failure", t=start + 2 * HOUR, cause="preempted")
    policy = AdaptivePolicy(prior_mtbf_s=72 * HOUR, wall_clock=FakeClock(start + 3 * HOUR))
    policy.bind(str(tmp_path), EventLog(tmp_path, "manager"))
    assert policy.decision.failures == 1
    assert policy.decision.exposure_s == pytest.approx(4 * HOUR)  # counted from the earlier death
    supervisor.close()
