"""Cost and capacity model of a training job's checkpoints.

From a job description (parameters, precision, optimizer, GPUs, price, MTBF, storage bandwidth, retention,
run length) :func:`plan_job` derives the checkpoint size, write and load times, the blocking cost per
checkpoint in seconds and dollars, the optimal interval (Young 1974, Daly 2006), the expected waste and
goodput, the expected failures and their cost, the checkpoints written and the storage needed.

Sizes per parameter (bytes): the weights in their training precision; with mixed precision an fp32 master
copy (4); the optimizer's state in fp32: AdamW/Adam two moments (8), SGD with momentum or Lion one (4),
8-bit Adam two 8-bit moments (2). For a 70B model in BF16 with AdamW that is 2 + 4 + 8 = 14 bytes per
parameter: 140 GB of weights but 980 GB of training state (Rajbhandari et al., "ZeRO", SC 2020, count the
same 16 bytes per parameter including fp16 gradients, which a checkpoint does not need).

Failures: the cluster MTBF is the per-GPU MTBF divided by the number of GPUs (independent failures, any
one of which stops a synchronous job); the probability of at least one failure in a run of length t is
``1 - exp(-t / MTBF)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError
from .interval import (
    Method,
    daly_interval_s,
    dollar_optimal_interval_s,
    expected_waste_fraction,
    expected_waste_fraction_exact,
    lost_work_per_failure_s,
    optimal_interval_s,
    young_interval_s,
)
from .units import format_duration

#: Bytes per parameter of the weights in each training precision.
PRECISION_BYTES: dict[str, float] = {
    "fp64": 8.0,
    "fp32": 4.0,
    "tf32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "fp4": 0.5,
    "int4": 0.5,
}

#: Bytes per parameter of the optimizer state (fp32 moments), without master weights.
OPTIMIZER_BYTES: dict[str, float] = {
    "adamw": 8.0,
    "adam": 8.0,
    "adamw8bit": 2.0,
    "lion": 4.0,
    "sgd": 4.0,
    "none": 0.0,
}

DEFAULT_STAGE_BANDWIDTH_BYTES_PER_S = 20e9
"""Device-to-host copy bandwidth per GPU assumed for asynchronous staging (a conservative pinned PCIe copy)."""


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A job description for :func:`plan_job`. Only the MTBF is required; every other group adds outputs.

    Args:
        mtbf_s: the whole job's mean time between failures, seconds. Give this or ``gpu_mtbf_s``.
        gpu_mtbf_s: the MTBF of one GPU (with its share of host, network, software), seconds; the job's is
            this divided by ``gpus``.
        checkpoint_s: C, seconds a save blocks training. Default: derived from the size and bandwidth.
        persist_s: L, seconds from save start to durable, for asynchronous saves. Default for
            ``async_save``: the staging time plus the write time.
        restart_s: R, seconds from detection until training runs again. Default: the load time of the
            checkpoint when it can be derived (a lower bound), else 0.
        detect_s: D, seconds until a failure is detected (>= 0).
        params: number of model parameters.
        precision: precision of the weights (a key of :data:`PRECISION_BYTES`).
        optimizer: optimizer (a key of :data:`OPTIMIZER_BYTES`).
        master_weights: whether an fp32 master copy is kept; None: yes when the weights are below fp32 and
            there is an optimizer.
        weights_only: checkpoints hold only the weights (not enough to resume training exactly).
        gpus: number of GPUs of the job (>= 1).
        gpu_hour_usd: price of one GPU-hour in dollars.
        write_bandwidth_bytes_per_s: aggregate bandwidth the job gets writing to checkpoint storage.
        read_bandwidth_bytes_per_s: aggregate read bandwidth; default the write bandwidth.
        async_save: saves stage to host memory (blocking) and persist in the background.
        stage_bandwidth_bytes_per_s: device-to-host bandwidth per GPU for async staging.
        keep: checkpoints retained (keep latest N, >= 1).
        run_s: planned wall-clock length of the run, seconds.
        checkpoint_cost_usd: direct charge per checkpoint in dollars (e.g. object-store requests), added to
            the cost of the cluster idling for C.
        method: ``"daly"`` (default) or ``"young"`` for the recommended interval.
        compare_intervals_s: other intervals to evaluate next to the optimum (e.g. a hand-picked 4 h).

    Raises:
        ConfigError: on any invalid field or missing input, naming the field and the fix.
    """

    mtbf_s: float | None = None
    gpu_mtbf_s: float | None = None
    checkpoint_s: float | None = None
    persist_s: float | None = None
    restart_s: float | None = None
    detect_s: float = 0.0
    params: float | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    master_weights: bool | None = None
    weights_only: bool = False
    gpus: int = 1
    gpu_hour_usd: float | None = None
    write_bandwidth_bytes_per_s: float | None = None
    read_bandwidth_bytes_per_s: float | None = None
    async_save: bool = False
    stage_bandwidth_bytes_per_s: float = DEFAULT_STAGE_BANDWIDTH_BYTES_PER_S
    keep: int = 3
    run_s: float | None = None
    checkpoint_cost_usd: float = 0.0
    method: Method = "daly"
    compare_intervals_s: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        def positive(name: str, fix: str) -> None:
            v = getattr(self, name)
            if v is not None and (not math.isfinite(float(v)) or float(v) <= 0):
                raise ConfigError(f"{name} must be > 0, got {v!r}; {fix}")

        def non_negative(name: str, fix: str) -> None:
            v = getattr(self, name)
            if v is not None and (not math.isfinite(float(v)) or float(v) < 0):
                raise ConfigError(f"{name} must be >= 0, got {v!r}; {fix}")

        if self.mtbf_s is None and self.gpu_mtbf_s is None:
            raise ConfigError(
                "no MTBF given; give the job's MTBF (e.g. --mtbf 72h) or the per-GPU one (--gpu-mtbf 8y)"
            )
        if self.mtbf_s is not None and self.gpu_mtbf_s is not None:
            raise ConfigError("give either the job's MTBF or the per-GPU MTBF, not both")
        positive("mtbf_s", "give a duration such as 72h")
        positive("gpu_mtbf_s", "give a duration such as 8y")
        non_negative("checkpoint_s", "give a duration such as 7s")
        non_negative("persist_s", "give a duration such as 2min")
        non_negative("restart_s", "give a duration such as 10min")
        non_negative("detect_s", "give a duration such as 1min")
        positive("params", "give a count such as 70B")
        non_negative("gpu_hour_usd", "give a price such as $2.50")
        positive("write_bandwidth_bytes_per_s", "give a bandwidth such as 20GB/s")
        positive("read_bandwidth_bytes_per_s", "give a bandwidth such as 20GB/s")
        positive("stage_bandwidth_bytes_per_s", "give a bandwidth such as 20GB/s")
        positive("run_s", "give a duration such as 30d")
        non_negative("checkpoint_cost_usd", "give a price such as $0.05")
        if self.precision.lower() not in PRECISION_BYTES:
            raise ConfigError(
                f"unknown precision {self.precision!r}; use one of {', '.join(PRECISION_BYTES)}"
            )
        if self.optimizer.lower() not in OPTIMIZER_BYTES:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}; use one of {', '.join(OPTIMIZER_BYTES)}"
            )
        if int(self.gpus) < 1:
            raise ConfigError(f"gpus must be >= 1, got {self.gpus!r}")
        if int(self.keep) < 1:
            raise ConfigError(f"keep must be >= 1 checkpoints, got {self.keep!r}")
        if self.method not in ("daly", "young"):
            raise ConfigError(f"unknown interval method {self.method!r}; use 'daly' or 'young'")
        for t in self.compare_intervals_s:
            if not math.isfinite(float(t)) or float(t) <= 0:
                raise ConfigError(f"intervals to compare must be > 0 seconds, got {t!r}")
        if self.checkpoint_s is None and (self.params is None or self.write_bandwidth_bytes_per_s is None):
            raise ConfigError(
                "cannot tell how long a checkpoint takes; give the blocking time (--checkpoint-time 5min) "
                "or the model size and storage bandwidth (--params 70B --write-bandwidth 20GB/s)"
            )


@dataclass(frozen=True, kw_only=True)
class IntervalPoint:
    """The model's figures at one interval (the optimum or one to compare)."""

    interval_s: float
    waste_fraction: float
    goodput: float
    optimal_if_checkpoint_s: float
    waste_usd: float | None = None
    extra_waste_usd: float | None = None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What :func:`plan_job` derives. Fields that the inputs do not determine are None.

    Times are seconds, sizes bytes, money US dollars. ``waste_fraction`` is the first-order expected waste at
    ``interval_s`` (Daly's interval, or L when an async save needs longer to persist);
    ``waste_fraction_exact`` is Daly's complete exponential model (synchronous saves only).
    """

    young_interval_s: float
    daly_interval_s: float
    interval_s: float
    interval_reason: str
    method: str
    waste_fraction: float
    waste_fraction_exact: float | None
    goodput: float
    checkpoint_s: float
    persist_s: float | None
    restart_s: float
    detect_s: float
    mtbf_s: float
    lost_work_per_failure_s: float
    failure_cost_s: float
    gpu_mtbf_s: float | None = None
    gpus: int | None = None
    params: float | None = None
    precision: str | None = None
    optimizer: str | None = None
    bytes_per_param: float | None = None
    weights_bytes: float | None = None
    full_state_bytes: float | None = None
    checkpoint_bytes: float | None = None
    checkpoint_bytes_per_gpu: float | None = None
    write_bandwidth_bytes_per_s: float | None = None
    read_bandwidth_bytes_per_s: float | None = None
    write_s: float | None = None
    load_s: float | None = None
    stage_s: float | None = None
    cluster_usd_per_hour: float | None = None
    checkpoint_cost_usd: float | None = None
    failure_cost_usd: float | None = None
    dollar_optimal_interval_s: float | None = None
    run_s: float | None = None
    run_cost_usd: float | None = None
    p_any_failure: float | None = None
    expected_failures: float | None = None
    expected_failure_cost_usd: float | None = None
    waste_s: float | None = None
    waste_usd: float | None = None
    checkpoints_written: float | None = None
    written_bytes: float | None = None
    keep: int | None = None
    storage_bytes: float | None = None
    storage_peak_bytes: float | None = None
    comparisons: tuple[IntervalPoint, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Return the plan as a flat JSON-ready dict, without the fields that are None."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "comparisons":
                if v:
                    out[f.name] = [{k: x for k, x in vars(p).items() if x is not None} for p in v]
            elif v is not None:
                out[f.name] = v
        return out


def state_bytes_per_param(
    precision: str, optimizer: str, master_weights: bool | None = None
) -> tuple[float, float]:
    """Bytes per parameter of the weights and of the full training state.

    Args:
        precision: a key of :data:`PRECISION_BYTES` (case-insensitive).
        optimizer: a key of :data:`OPTIMIZER_BYTES` (case-insensitive).
        master_weights: whether an fp32 master copy is kept; None: yes when the weights are below fp32 and
            there is an optimizer.

    Returns:
        ``(weights, full)`` in bytes per parameter; for BF16 + AdamW ``(2, 14)``.

    Raises:
        ConfigError: on an unknown precision or optimizer.
    """
    p, o = precision.lower(), optimizer.lower()
    if p not in PRECISION_BYTES:
        raise ConfigError(f"unknown precision {precision!r}; use one of {', '.join(PRECISION_BYTES)}")
    if o not in OPTIMIZER_BYTES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_BYTES)}")
    weights = PRECISION_BYTES[p]
    if master_weights is None:
        master_weights = weights < 4.0 and OPTIMIZER_BYTES[o] > 0
    return weights, weights + (4.0 if master_weights else 0.0) + OPTIMIZER_BYTES[o]


def cluster_mtbf_s(gpu_mtbf_s: float, gpus: int) -> float:
    """The job's MTBF when any one of ``gpus`` independent GPUs failing stops it: ``gpu_mtbf_s / gpus``."""
    if not gpu_mtbf_s > 0 or int(gpus) < 1:
        raise ConfigError(f"need a positive per-GPU MTBF and >= 1 GPU, got {gpu_mtbf_s!r} and {gpus!r}")
    return float(gpu_mtbf_s) / int(gpus)


def p_any_failure(run_s: float, mtbf_s: float) -> float:
    """Probability of at least one failure in ``run_s`` seconds with exponential failures: ``1 - e^{-t/M}``."""
    if not run_s >= 0 or not mtbf_s > 0:
        raise ConfigError(f"need run_s >= 0 and mtbf_s > 0, got {run_s!r} and {mtbf_s!r}")
    return -math.expm1(-float(run_s) / float(mtbf_s))


def _check_model_applies(
    what: str, interval_s: float, waste: float, c: float, restart: float, detect: float, mtbf: float
) -> None:
    """Refuse a plan whose interval exceeds the MTBF or whose waste leaves [0, 1]: the model does not hold.

    Raises:
        ConfigError: naming the interval, the numbers that put it outside the model, and what to check.
    """
    d = format_duration
    inputs = (
        f"C = {d(c)}, R = {d(restart)}" + (f", D = {d(detect)}" if detect else "") + f", MTBF = {d(mtbf)}"
    )
    fix = (
        "Check the units (an MTBF of 72 hours is --mtbf 72h); otherwise the checkpoint and restart must take "
        "well under the MTBF for any interval to make progress"
    )
    if interval_s > mtbf:
        raise ConfigError(
            f"{what} of {d(interval_s)} is longer than the job's MTBF of {d(mtbf)} ({inputs}): most "
            f"intervals would end in a failure before their checkpoint, so the interval model does not apply. "
            f"{fix}"
        )
    if not 0.0 <= waste <= 1.0:
        raise ConfigError(
            f"at {what} of {d(interval_s)} the expected waste would be {100 * waste:.1f}% (goodput "
            f"{100 * (1 - waste):.1f}%), outside [0, 100%] ({inputs}): the first-order model does not apply "
            f"when a failure costs about as much as the time between failures. {fix}"
        )


def plan_job(spec: JobSpec) -> Plan:
    """Derive the checkpoint plan of a job.

    Args:
        spec: the job description.

    Returns:
        The plan; see :class:`Plan` for the fields.

    Raises:
        ConfigError: on inconsistent inputs, and where the model does not apply: an interval (recommended or
            compared) longer than the MTBF, or an expected waste outside [0, 1] (negative goodput).
    """
    gpus = int(spec.gpus)
    mtbf = (
        float(spec.mtbf_s) if spec.mtbf_s is not None else cluster_mtbf_s(float(spec.gpu_mtbf_s or 0), gpus)
    )

    # Sizes and times of one checkpoint.
    sizes: dict[str, Any] = {}
    ckpt_bytes = write_s = load_s = stage_s = None
    if spec.params is not None:
        bpp_w, bpp_full = state_bytes_per_param(spec.precision, spec.optimizer, spec.master_weights)
        weights_bytes = spec.params * bpp_w
        full_bytes = spec.params * bpp_full
        ckpt_bytes = weights_bytes if spec.weights_only else full_bytes
        sizes = {
            "params": float(spec.params),
            "precision": spec.precision.lower(),
            "optimizer": spec.optimizer.lower(),
            "bytes_per_param": bpp_w if spec.weights_only else bpp_full,
            "weights_bytes": weights_bytes,
            "full_state_bytes": full_bytes,
            "checkpoint_bytes": ckpt_bytes,
            "checkpoint_bytes_per_gpu": ckpt_bytes / gpus,
        }
        if spec.write_bandwidth_bytes_per_s is not None:
            read_bw = spec.read_bandwidth_bytes_per_s or spec.write_bandwidth_bytes_per_s
            write_s = ckpt_bytes / spec.write_bandwidth_bytes_per_s
            load_s = ckpt_bytes / read_bw
            sizes["write_bandwidth_bytes_per_s"] = float(spec.write_bandwidth_bytes_per_s)
            sizes["read_bandwidth_bytes_per_s"] = float(read_bw)
            if spec.async_save:
                stage_s = ckpt_bytes / (gpus * spec.stage_bandwidth_bytes_per_s)

    # C and L: explicit values win over derived ones.
    persist: float | None = spec.persist_s
    if spec.checkpoint_s is not None:
        c = float(spec.checkpoint_s)
    elif spec.async_save:
        c = float(stage_s or 0.0)
    else:
        c = float(write_s or 0.0)
    if spec.async_save and persist is None and write_s is not None:
        persist = c + write_s
    if persist is not None:
        persist = max(float(persist), c)
    restart = float(spec.restart_s) if spec.restart_s is not None else float(load_s or 0.0)
    detect = float(spec.detect_s)

    young = young_interval_s(c, mtbf)
    daly = daly_interval_s(c, mtbf)
    opt = daly if spec.method == "daly" else young
    interval = optimal_interval_s(c, mtbf, persist_s=persist, method=spec.method)
    if interval <= 0:
        raise ConfigError(
            "the checkpoint time is 0, so every interval is optimal; give a positive --checkpoint-time"
        )
    if persist is not None and persist > opt:
        reason = (
            f"the persist latency L = {format_duration(persist)} is longer than the {spec.method} "
            f"optimum {format_duration(opt)}"
        )
    else:
        reason = f"{spec.method} optimum for C = {format_duration(c)}, MTBF = {format_duration(mtbf)}"

    def waste_at(t: float) -> float:
        return expected_waste_fraction(t, c, mtbf, restart_s=restart, detect_s=detect, persist_s=persist)

    waste = waste_at(interval)
    what = "the recommended interval" + (" (never shorter than the save itself)" if interval > opt else "")
    _check_model_applies(what, interval, waste, c, restart, detect, mtbf)
    exact = None
    if persist is None:
        exact = expected_waste_fraction_exact(interval, c, mtbf, restart_s=restart, detect_s=detect)
    lost = lost_work_per_failure_s(interval, c, persist_s=persist)

    money: dict[str, Any] = {}
    usd_per_s = None
    if spec.gpu_hour_usd is not None:
        usd_per_s = gpus * float(spec.gpu_hour_usd) / 3600.0
        k = c * usd_per_s + float(spec.checkpoint_cost_usd)
        money = {
            "cluster_usd_per_hour": usd_per_s * 3600.0,
            "checkpoint_cost_usd": k,
            "failure_cost_usd": (lost + detect + restart) * usd_per_s,
        }
        if k > 0 and usd_per_s > 0:
            money["dollar_optimal_interval_s"] = dollar_optimal_interval_s(
                k, usd_per_s, mtbf, persist_s=persist
            )

    run: dict[str, Any] = {}
    if spec.run_s is not None:
        run_s = float(spec.run_s)
        n_ckpt = run_s / (interval + c)
        run = {
            "run_s": run_s,
            "p_any_failure": p_any_failure(run_s, mtbf),
            "expected_failures": run_s / mtbf,
            "waste_s": min(waste, 1.0) * run_s,
            "checkpoints_written": n_ckpt,
        }
        if ckpt_bytes is not None:
            run["written_bytes"] = n_ckpt * ckpt_bytes
        if usd_per_s is not None:
            run["run_cost_usd"] = run_s * usd_per_s
            run["waste_usd"] = run["waste_s"] * usd_per_s
            run["expected_failure_cost_usd"] = run["expected_failures"] * money["failure_cost_usd"]

    storage: dict[str, Any] = {}
    if ckpt_bytes is not None:
        # A new checkpoint is committed before the oldest is deleted, so N + 1 exist for a while.
        storage = {"keep": int(spec.keep), "storage_bytes": spec.keep * ckpt_bytes}
        storage["storage_peak_bytes"] = (spec.keep + 1) * ckpt_bytes

    best_waste = waste
    comparisons = []
    for t in spec.compare_intervals_s:
        w = waste_at(float(t))
        _check_model_applies("the compared interval", float(t), w, c, restart, detect, mtbf)
        point: dict[str, Any] = {
            "interval_s": float(t),
            "waste_fraction": w,
            "goodput": 1.0 - w,
            "optimal_if_checkpoint_s": float(t) ** 2 / (2.0 * mtbf),
        }
        if usd_per_s is not None and spec.run_s is not None:
            point["waste_usd"] = min(w, 1.0) * float(spec.run_s) * usd_per_s
            point["extra_waste_usd"] = (min(w, 1.0) - min(best_waste, 1.0)) * float(spec.run_s) * usd_per_s
        comparisons.append(IntervalPoint(**point))

    return Plan(
        young_interval_s=young,
        daly_interval_s=daly,
        interval_s=interval,
        interval_reason=reason,
        method=spec.method,
        waste_fraction=waste,
        waste_fraction_exact=exact,
        goodput=1.0 - waste,
        checkpoint_s=c,
        persist_s=persist,
        restart_s=restart,
        detect_s=detect,
        mtbf_s=mtbf,
        lost_work_per_failure_s=lost,
        failure_cost_s=lost + detect + restart,
        gpu_mtbf_s=float(spec.gpu_mtbf_s) if spec.gpu_mtbf_s is not None else None,
        gpus=gpus
        if (spec.gpu_mtbf_s is not None or spec.gpu_hour_usd is not None or spec.params is not None)
        else None,
        write_s=write_s,
        load_s=load_s,
        stage_s=stage_s,
        comparisons=tuple(comparisons),
        **sizes,
        **money,
        **run,
        **storage,
    )
