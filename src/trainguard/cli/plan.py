"""``trainguard plan`` and ``trainguard simulate``: a thin layer over :mod:`trainguard.planning`.

Exit codes: 0 ok, 2 usage error (bad unit, negative MTBF, zero bandwidth, missing input).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any

import click

from ..errors import ConfigError
from ..planning import units
from ..planning.capacity import (
    DEFAULT_STAGE_BANDWIDTH_BYTES_PER_S,
    OPTIMIZER_BYTES,
    PRECISION_BYTES,
    JobSpec,
    plan_job,
)
from ..planning.interval import (
    daly_interval_s,
    expected_waste_fraction,
    expected_waste_fraction_exact,
    optimal_interval_s,
    young_interval_s,
)
from ..planning.simulate import SimulationConfig, simulate, sweep
from .main import main


class _Quantity(click.ParamType):
    """A click parameter parsed by one of :mod:`trainguard.planning.units`' parsers."""

    def __init__(self, name: str, parse: Callable[..., float], **kwargs: Any) -> None:
        self.name = name
        self._parse = parse
        self._kwargs = kwargs

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        what = param.name.replace("_", " ") if param is not None and param.name else self.name
        what = what.replace("gpu mtbf", "per-GPU MTBF").replace("mtbf", "MTBF")
        try:
            return self._parse(value, what=what, **self._kwargs)
        except ConfigError as e:
            self.fail(str(e), param, ctx)


DURATION = _Quantity("duration", units.parse_duration_s)
POSITIVE_DURATION = _Quantity("duration", units.parse_duration_s, allow_zero=False)
COUNT = _Quantity("count", units.parse_count)
BANDWIDTH = _Quantity("bandwidth", units.parse_bandwidth_bytes_per_s)
MONEY = _Quantity("money", units.parse_money_usd)


def _emit_json(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(obj, indent=2, allow_nan=False, default=float))


def _pct(x: float) -> str:
    return f"{100.0 * x:.2f}%" if abs(x) >= 0.01 else f"{100.0 * x:.3g}%"


class _Trimmed:
    """A rich Console whose lines are printed without the trailing spaces rich pads table rows with."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(width=max(120, Console().width), highlight=False)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        with self.console.capture() as cap:
            self.console.print(*objects, **kwargs)
        text = "\n".join(line.rstrip() for line in cap.get().splitlines())
        click.echo(text)


def _console() -> Any:
    return _Trimmed()


# ---------------------------------------------------------------------------------------------------------
# trainguard plan


@main.command("plan")
@click.option(
    "--checkpoint-time",
    type=DURATION,
    help="C: how long a save blocks training, with a unit (e.g. 7s, 5min).",
)
@click.option("--persist-time", type=DURATION, help="L: save start to durable, for async saves (e.g. 2min).")
@click.option(
    "--restart-time", type=DURATION, help="R: detection to training again [default: the load time]."
)
@click.option("--detect-time", type=DURATION, default=0.0, help="D: failure to detection [default: 0].")
@click.option("--mtbf", type=POSITIVE_DURATION, help="The whole job's mean time between failures (e.g. 72h).")
@click.option(
    "--gpu-mtbf", type=POSITIVE_DURATION, help="One GPU's MTBF; the job's is this / --gpus (e.g. 8y)."
)
@click.option("--params", type=COUNT, help="Model parameters (e.g. 70B).")
@click.option(
    "--precision",
    type=click.Choice(sorted(PRECISION_BYTES), case_sensitive=False),
    default="bf16",
    show_default=True,
)
@click.option(
    "--optimizer",
    type=click.Choice(sorted(OPTIMIZER_BYTES), case_sensitive=False),
    default="adamw",
    show_default=True,
)
@click.option("--master-weights/--no-master-weights", default=None, help="fp32 master copy [default: auto].")
@click.option("--weights-only", is_flag=True, help="Checkpoints hold only the weights (no optimizer state).")
@click.option("--gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs of the job.")
@click.option("--gpu-hour-price", "--price", "price", type=MONEY, help="Dollars per GPU-hour (e.g. $2.50).")
@click.option("--write-bandwidth", type=BANDWIDTH, help="Aggregate write bandwidth to storage (e.g. 20GB/s).")
@click.option(
    "--read-bandwidth", type=BANDWIDTH, help="Aggregate read bandwidth [default: the write bandwidth]."
)
@click.option(
    "--async", "async_save", is_flag=True, help="Saves stage to host memory and persist in background."
)
@click.option(
    "--stage-bandwidth",
    type=BANDWIDTH,
    default=DEFAULT_STAGE_BANDWIDTH_BYTES_PER_S,
    help="Device-to-host copy bandwidth per GPU for --async [default: 20GB/s].",
)
@click.option(
    "--keep", type=click.IntRange(min=1), default=3, show_default=True, help="Checkpoints retained."
)
@click.option("--run-length", type=POSITIVE_DURATION, help="Planned wall-clock length of the run (e.g. 30d).")
@click.option(
    "--checkpoint-cost", type=MONEY, default=0.0, help="Direct dollars per checkpoint (e.g. requests)."
)
@click.option("--method", type=click.Choice(["daly", "young"]), default="daly", show_default=True)
@click.option(
    "--compare", type=POSITIVE_DURATION, multiple=True, help="Also evaluate this interval (repeatable)."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def plan_cmd(**kw: Any) -> None:
    """Optimal checkpoint interval (Young 1974, Daly 2006) and the cost and capacity of a job's checkpoints.

    \b
    Minimal:   trainguard plan --checkpoint-time 5min --restart-time 10min --mtbf 24h
    A job:     trainguard plan --params 70B --precision bf16 --gpus 1024 --write-bandwidth 20GB/s \\
                   --mtbf 72h --price '$2.50' --run-length 30d --compare 4h --compare 6h

    Units: 70B, 72h, 5min, 20GB/s, $2.50. Durations and rates need a unit (a bare 72 is refused: hours or
    seconds?), and an all-lower-case 20gb/s is refused as ambiguous (GB/s bytes, Gb/s bits). A plan whose
    interval exceeds the MTBF or whose goodput falls outside [0, 100%] is refused (exit 2). See
    docs/PLANNING.md for the formulas.
    """
    try:
        spec = JobSpec(
            mtbf_s=kw["mtbf"],
            gpu_mtbf_s=kw["gpu_mtbf"],
            checkpoint_s=kw["checkpoint_time"],
            persist_s=kw["persist_time"],
            restart_s=kw["restart_time"],
            detect_s=kw["detect_time"],
            params=kw["params"],
            precision=kw["precision"],
            optimizer=kw["optimizer"],
            master_weights=kw["master_weights"],
            weights_only=kw["weights_only"],
            gpus=kw["gpus"],
            gpu_hour_usd=kw["price"],
            write_bandwidth_bytes_per_s=kw["write_bandwidth"],
            read_bandwidth_bytes_per_s=kw["read_bandwidth"],
            async_save=kw["async_save"],
            stage_bandwidth_bytes_per_s=kw["stage_bandwidth"],
            keep=kw["keep"],
            run_s=kw["run_length"],
            checkpoint_cost_usd=kw["checkpoint_cost"],
            method=kw["method"],
            compare_intervals_s=tuple(kw["compare"]),
        )
        result = plan_job(spec)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if kw["as_json"]:
        _emit_json(result.to_dict())
    else:
        _print_plan(result.to_dict())


def _print_plan(p: dict[str, Any]) -> None:
    from rich.table import Table

    d, b, money = units.format_duration, units.format_bytes, units.format_money_usd
    rows: list[tuple[str, str, str]] = []

    def section(title: str) -> None:
        rows.append((f"[bold]{title}[/bold]", "", ""))

    def row(name: str, value: str, note: str = "") -> None:
        rows.append((f"  {name}", value, note))

    if "checkpoint_bytes" in p:
        section("Checkpoint")
        row(
            "parameters",
            units.format_count(p["params"]),
            f"{p['precision']} weights, {p['optimizer']} optimizer",
        )
        row("weights", b(p["weights_bytes"]))
        row("full training state", b(p["full_state_bytes"]), f"{p['bytes_per_param']:g} bytes per parameter")
        row("checkpoint size", b(p["checkpoint_bytes"]), f"{b(p['checkpoint_bytes_per_gpu'])} per GPU")
        if "write_s" in p:
            bw = units.format_bandwidth(p["write_bandwidth_bytes_per_s"])
            row("write time", d(p["write_s"]), f"at {bw}")
            row("load time", d(p["load_s"]), f"at {units.format_bandwidth(p['read_bandwidth_bytes_per_s'])}")
        if "stage_s" in p:
            row("staging time (async)", d(p["stage_s"]), "device to host memory")
    section("Costs per event")
    cost = f"{money(p['checkpoint_cost_usd'])} of cluster time" if "checkpoint_cost_usd" in p else ""
    row("blocking time C", d(p["checkpoint_s"]), cost)
    if p.get("persist_s") is not None:
        row("persist latency L", d(p["persist_s"]), "save start to durable (async)")
    restart_note = "the load time; add scheduling with --restart-time" if "load_s" in p else ""
    row("restart time R", d(p["restart_s"]), restart_note if p.get("restart_s") == p.get("load_s") else "")
    if p["detect_s"]:
        row("detection time D", d(p["detect_s"]))
    mtbf_note = f"{d(p['gpu_mtbf_s'])} per GPU / {p['gpus']} GPUs" if "gpu_mtbf_s" in p else ""
    row("job MTBF", d(p["mtbf_s"]), mtbf_note)
    fail_cost = f"{money(p['failure_cost_usd'])} each" if "failure_cost_usd" in p else ""
    row("cost of a failure", d(p["failure_cost_s"]), fail_cost or "lost work + D + R")
    section("Interval")
    row("Young (1974)", d(p["young_interval_s"]), "sqrt(2 C M)")
    row("Daly (2006)", d(p["daly_interval_s"]), "higher order")
    if "dollar_optimal_interval_s" in p:
        row("dollar optimum", d(p["dollar_optimal_interval_s"]), "sqrt(2 K M / c)")
    row("[bold]recommended[/bold]", f"[bold]{d(p['interval_s'])}[/bold]", p["interval_reason"])
    exact = (
        f"exact exponential model {_pct(p['waste_fraction_exact'])}" if "waste_fraction_exact" in p else ""
    )
    row("expected waste", _pct(p["waste_fraction"]), exact)
    row("goodput", _pct(p["goodput"]))
    row("lost work per failure", d(p["lost_work_per_failure_s"]))
    if "run_s" in p:
        section(f"Run of {d(p['run_s'])}")
        if "run_cost_usd" in p:
            row("cluster cost", money(p["run_cost_usd"]), f"{money(p['cluster_usd_per_hour'])} per hour")
        row("P(at least one failure)", _pct(p["p_any_failure"]), "1 - exp(-run / MTBF)")
        fc = f"costing {money(p['expected_failure_cost_usd'])}" if "expected_failure_cost_usd" in p else ""
        row("expected failures", f"{p['expected_failures']:.3g}", fc)
        row("expected waste", d(p["waste_s"]), money(p["waste_usd"]) if "waste_usd" in p else "")
        written = f"{b(p['written_bytes'])} written" if "written_bytes" in p else ""
        row("checkpoints written", f"{p['checkpoints_written']:.0f}", written)
    if "storage_bytes" in p:
        section("Storage")
        row(
            f"keep {p['keep']}",
            b(p["storage_bytes"]),
            f"{b(p['storage_peak_bytes'])} while a new one commits",
        )
    if p.get("comparisons"):
        section("Compared intervals")
        for c in p["comparisons"]:
            extra = f", {money(c['extra_waste_usd'])} more than the optimum" if "extra_waste_usd" in c else ""
            row(
                d(c["interval_s"]),
                f"waste {_pct(c['waste_fraction'])}",
                f"optimal only if C were {d(c['optimal_if_checkpoint_s'])}{extra}",
            )
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column("quantity", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("note", style="dim")
    for r in rows:
        table.add_row(*r)
    _console().print(table)


# ---------------------------------------------------------------------------------------------------------
# trainguard simulate


@main.command("simulate")
@click.option(
    "--checkpoint-time",
    type=DURATION,
    required=True,
    help="C: how long a save blocks training, with a unit (e.g. 7s).",
)
@click.option("--mtbf", type=POSITIVE_DURATION, required=True, help="The job's mean time between failures.")
@click.option("--persist-time", type=DURATION, help="L: save start to durable, for async saves.")
@click.option(
    "--restart-time", type=DURATION, default=0.0, help="R: detection to training again [default: 0]."
)
@click.option("--detect-time", type=DURATION, default=0.0, help="D: failure to detection [default: 0].")
@click.option(
    "--run-length", type=POSITIVE_DURATION, default="30d", show_default=True, help="Compute the run needs."
)
@click.option("--interval", type=POSITIVE_DURATION, help="T to simulate [default: the optimum].")
@click.option(
    "--distribution", type=click.Choice(["exponential", "weibull"]), default="exponential", show_default=True
)
@click.option(
    "--shape", type=click.FloatRange(min=0, min_open=True), default=0.7, show_default=True, help="Weibull k."
)
@click.option("--trials", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--sweep/--no-sweep", "do_sweep", default=True, show_default=True, help="Sweep T around the optimum."
)
@click.option(
    "--points", type=click.IntRange(min=3), default=24, show_default=True, help="Intervals in the sweep."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def simulate_cmd(**kw: Any) -> None:
    """Monte Carlo simulation of a run under failures, at one interval and over a sweep of intervals.

    \b
    Example: trainguard simulate --checkpoint-time 5min --restart-time 10min --mtbf 24h --run-length 100d

    Reports the mean and percentiles of goodput and wall time over seeded trials, the analytic waste next to
    the simulated one (exponential failures), and the best interval of the sweep next to Daly's.
    """
    try:
        config = SimulationConfig(
            work_s=kw["run_length"],
            checkpoint_s=kw["checkpoint_time"],
            mtbf_s=kw["mtbf"],
            persist_s=kw["persist_time"],
            restart_s=kw["restart_time"],
            detect_s=kw["detect_time"],
            distribution=kw["distribution"],
            weibull_shape=kw["shape"],
            trials=kw["trials"],
            seed=kw["seed"],
        )
        c, m = config.checkpoint_s, config.mtbf_s
        d = units.format_duration
        if kw["interval"]:
            interval, source = kw["interval"], "--interval"
        else:
            interval = optimal_interval_s(c, m, persist_s=config.persist_s)
            floor = "L" if config.persist_s is not None else "C"
            source = (
                f"no --interval given: the optimum for C = {d(c)} and MTBF = {d(m)}, the larger of Daly's "
                f"{d(daly_interval_s(c, m))} and {floor} = {d(config.effective_persist_s)}"
            )
        if interval <= 0:
            raise ConfigError("the checkpoint time is 0, so give the interval to simulate with --interval")
        result = simulate(config, interval, source=source)
        out: dict[str, Any] = {
            "inputs": {k: v for k, v in vars(config).items()},
            "young_interval_s": young_interval_s(c, m),
            "daly_interval_s": daly_interval_s(c, m),
            "interval_s": interval,
            "simulated": result.to_dict(),
            "waste_fraction": expected_waste_fraction(
                interval,
                c,
                m,
                restart_s=config.restart_s,
                detect_s=config.detect_s,
                persist_s=config.persist_s,
            ),
        }
        if config.distribution == "exponential" and config.persist_s is None:
            exact = expected_waste_fraction_exact(
                interval, c, m, restart_s=config.restart_s, detect_s=config.detect_s
            )
            out["waste_fraction_exact"] = exact
            out["relative_difference"] = (result.waste_mean - exact) / exact if exact > 0 else math.nan
        else:
            first = out["waste_fraction"]
            out["relative_difference"] = (result.waste_mean - first) / first if first > 0 else math.nan
        if kw["do_sweep"]:
            out["sweep"] = _run_sweep(config, kw["points"], show=not kw["as_json"] and sys.stdout.isatty())
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if not math.isfinite(out["relative_difference"]):
        out["relative_difference"] = None
    if kw["as_json"]:
        _emit_json(out)
    else:
        _print_simulation(out)


def _run_sweep(config: SimulationConfig, points: int, *, show: bool) -> dict[str, Any]:
    if not show:
        return sweep(config, points=points).to_dict()
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("sweeping intervals", total=points)
        res = sweep(
            config, points=points, progress=lambda done, total: bar.update(task, completed=done, total=total)
        )
    return res.to_dict()


def _print_simulation(o: dict[str, Any]) -> None:
    from rich.table import Table

    d = units.format_duration
    s = o["simulated"]
    cfg = o["inputs"]
    title = (
        f"trainguard simulate: {s['trials']} runs of {d(cfg['work_s'])} compute, {cfg['distribution']} failures"
        + (f" (shape {cfg['weibull_shape']:g})" if cfg["distribution"] == "weibull" else "")
        + f", MTBF {d(cfg['mtbf_s'])}, C {d(cfg['checkpoint_s'])}, R {d(cfg['restart_s'])}"
    )
    table = Table(show_header=True, box=None, pad_edge=False)
    table.add_column("", no_wrap=True)
    for col in ("mean", "p5", "p50", "p95"):
        table.add_column(col, justify="right")
    table.add_row(
        "goodput", *(_pct(s[k]) for k in ("goodput_mean", "goodput_p5", "goodput_p50", "goodput_p95"))
    )
    table.add_row("wall time", *(d(s[k]) for k in ("wall_mean_s", "wall_p5_s", "wall_p50_s", "wall_p95_s")))
    table.add_row("failures", f"{s['failures_mean']:.3g}", "", "", "")
    console = _console()
    console.print(title, highlight=False)
    console.print(table)
    console.print(
        f"interval T = {d(o['interval_s'])} (Young {d(o['young_interval_s'])}, Daly {d(o['daly_interval_s'])})"
    )
    line = f"simulated waste {_pct(s['waste_mean'])}; analytic first-order {_pct(o['waste_fraction'])}"
    if "waste_fraction_exact" in o:
        line += f", exact exponential model {_pct(o['waste_fraction_exact'])}"
    if o.get("relative_difference") is not None:
        line += f" (simulated differs by {100 * o['relative_difference']:+.2f}%)"
    console.print(line)
    if "sweep" in o:
        sw = o["sweep"]
        best = min(sw["points"], key=lambda r: r["waste_mean"])
        fitted = f", fitted minimum {d(sw['fitted_interval_s'])}" if sw.get("fitted_interval_s") else ""
        ratio = sw["best_interval_s"] / o["daly_interval_s"] if o["daly_interval_s"] > 0 else math.nan
        console.print(
            f"sweep of {len(sw['points'])} intervals: best {d(sw['best_interval_s'])} "
            f"(waste {_pct(best['waste_mean'])}, {ratio:.2f}x Daly){fitted}"
        )
