"""Planning: how often to checkpoint, what checkpoints cost, and how a run fares under failures.

- :mod:`.interval`: Young's (1974) and Daly's (2006) optimum interval, the expected waste, the dollar
  optimum and the rule for asynchronous saves.
- :mod:`.capacity`: the cost and capacity model of a job (checkpoint size, times, dollars, storage).
- :mod:`.simulate`: a Monte Carlo simulator of a run under exponential or Weibull failures.
- :mod:`.adaptive`: :class:`AdaptivePolicy`, a save policy that keeps to the optimum measured live.
- :mod:`.units`: parsing of ``70B``, ``72h``, ``20GB/s``, ``$2.50``.

The formulas and a worked example are in docs/PLANNING.md.
"""

from .adaptive import AdaptivePolicy, IntervalDecision, posterior_mtbf_s
from .capacity import JobSpec, Plan, plan_job
from .interval import (
    daly_interval_s,
    dollar_optimal_interval_s,
    expected_wall_time_s,
    expected_waste_fraction,
    expected_waste_fraction_exact,
    lost_work_per_failure_s,
    optimal_interval_s,
    young_interval_s,
)
from .simulate import SimulationConfig, SimulationResult, SweepResult, simulate, sweep

__all__ = [
    "AdaptivePolicy",
    "IntervalDecision",
    "JobSpec",
    "Plan",
    "SimulationConfig",
    "SimulationResult",
    "SweepResult",
    "daly_interval_s",
    "dollar_optimal_interval_s",
    "expected_wall_time_s",
    "expected_waste_fraction",
    "expected_waste_fraction_exact",
    "lost_work_per_failure_s",
    "optimal_interval_s",
    "plan_job",
    "posterior_mtbf_s",
    "simulate",
    "sweep",
    "young_interval_s",
]
