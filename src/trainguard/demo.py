"""``trainguard demo``: the main job, end to end on real input.

1. Trains ``examples/train_gpt.py`` (a byte-level GPT on the Python standard library's source) under the
   supervisor, injecting failures of mixed kinds at seeded random steps: SIGKILL during a training step,
   SIGKILL in the middle of a checkpoint save, a hang (caught by the heartbeat timeout), and a corrupted
   newest checkpoint (a flipped bit in a chunk) that the next restore must detect and skip, and silent
   corruption (a weight's bytes and their recorded CRC32C both rewritten, as memory corrupted before
   checksumming would produce) that only the probe fingerprint catches at resume.
2. Trains the same job uninterrupted as a reference (concurrently, one CPU thread each).
3. Compares the final model and optimizer tensors bitwise and reports checkpoints, failures with their
   time-to-resume phases, and goodput, and writes the HTML report of the faulted run (``trainguard
   report``) to ``<out>/report.html``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .eventlog import read_events

FAULT_KINDS = ("kill_step", "kill_during_save", "hang", "corrupt_newest", "silent_corruption")
KIND_LABELS = {
    "kill_step": "SIGKILL in a step",
    "kill_during_save": "SIGKILL mid-save",
    "hang": "hang",
    "corrupt_newest": "corrupt newest ckpt",
    "silent_corruption": "silent corruption (valid CRC)",
}


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of ``trainguard demo``. Steps in training steps, times in seconds."""

    steps: int = 200
    failures: int = 5
    out: Path = Path("trainguard-demo")
    seed: int = 0
    save_every: int = 20
    heartbeat_timeout_s: float = 5.0
    script: Path | None = None
    train_args: tuple[
        str, ...
    ] = ()  # extra arguments for the training script (e.g. a smaller model in tests)

    def __post_init__(self) -> None:
        if self.save_every < 1:
            raise ConfigError(f"--save-every must be >= 1, got {self.save_every}")
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError(f"--heartbeat-timeout must be > 0 seconds, got {self.heartbeat_timeout_s}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} exists and is not a directory; pass a directory")
        need = max(
            4 * self.save_every, self.save_every + self.failures * (self.save_every + 2) + self.save_every
        )
        if self.steps < need:
            raise ConfigError(
                f"--steps {self.steps} is too few for {self.failures} failures with --save-every "
                f"{self.save_every}; use at least {need}"
            )
        if self.steps < 4 * self.save_every:
            raise ConfigError(
                f"--steps must be at least {4 * self.save_every} (4 checkpoint intervals), got {self.steps}"
            )
        if self.failures < 0:
            raise ConfigError(f"--failures must be >= 0, got {self.failures}")
        room = (self.steps - self.save_every) // (self.save_every + 2)
        if self.failures > room:
            raise ConfigError(
                f"--failures {self.failures} does not fit in {self.steps} steps; use at most {room} or "
                "more --steps"
            )


def find_script(explicit: Path | None = None) -> Path:
    """Locate examples/train_gpt.py (a checkout or the current directory)."""
    candidates = [explicit] if explicit else []
    candidates += [
        Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py",
        Path.cwd() / "examples" / "train_gpt.py",
    ]
    for c in candidates:
        if c is not None and c.is_file():
            return c
    raise ConfigError(
        "examples/train_gpt.py not found: run `trainguard demo` from a trainguard checkout "
        "(or pass --script PATH)"
    )


def fault_plan(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Seeded failures: one of each kind first (in a random order), then random kinds; each at a step after the
    previous fault plus a checkpoint interval, so every attempt makes progress. A save is killed at a save
    step; the corruption happens once a checkpoint newer than the previous fault has committed."""
    rng = random.Random(cfg.seed)
    kinds = list(FAULT_KINDS)
    rng.shuffle(kinds)
    while len(kinds) < cfg.failures:
        kinds.append(rng.choice(FAULT_KINDS))
    kinds = kinds[: cfg.failures]
    se = cfg.save_every

    def room(k: str) -> int:  # steps a fault needs after the previous one (a killed save: the next save step)
        return 2 * se + 1 if k == "kill_during_save" else se + 2

    plan = []
    prev = 0
    span = cfg.steps - se - prev
    for i, kind in enumerate(kinds):
        remaining = len(kinds) - i
        last = cfg.steps - sum(room(k) for k in kinds[i + 1 :]) - 1  # room for the faults after this one
        lo = prev + se + 2
        hi = max(lo, prev + span // max(1, remaining) + se)
        hi = min(hi, last)
        step = rng.randint(lo, max(lo, hi))
        if (
            kind == "kill_during_save"
        ):  # at a save step: the multiple of save_every nearest, keeping the spacing
            first = (prev + se) // se * se + se
            saves = range(first, last + 1, se)
            if saves:
                step = min(saves, key=lambda s: (abs(s - step), s))
            else:
                step = max(se, (step // se) * se)
                if step <= prev + 1:
                    step += se
        plan.append({"attempt": i, "step": step, "kind": kind})
        prev = step
        span = cfg.steps - prev
    return plan


def after_step(fault: dict[str, Any]) -> int:
    """The step a planned failure hits, as the supervisor reports it: the last step done when it fires.

    ``kill_step`` fires in the middle of step ``s`` (so after step ``s - 1``); the other kinds fire once step
    ``s`` and its ``maybe_save`` are done.
    """
    return int(fault["step"]) - 1 if fault["kind"] == "kill_step" else int(fault["step"])


def _train_cmd(script: Path, root: Path, cfg: DemoConfig, plan_file: Path | None) -> list[str]:
    cmd = [
        sys.executable,
        str(script),
        "--root",
        str(root),
        "--steps",
        str(cfg.steps),
        "--save-every",
        str(cfg.save_every),
        "--keep",
        "3",
        "--seed",
        "1337",
        "--threads",
        "1",
    ]
    if plan_file is not None:
        cmd += ["--fault-plan", str(plan_file)]
    return cmd + list(cfg.train_args)


def _log_steps(root: Path) -> list[dict[str, Any]]:
    p = root / "train_log.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def compare_final(faulted: Path, reference: Path) -> tuple[bool, int, list[str]]:
    """Bitwise comparison of model and optimizer tensors of both runs' newest checkpoints.

    Returns ``(identical, tensors_compared, differing_fqns)``.
    """
    import torch

    from .manager import CheckpointManager
    from .state.flatten import flatten

    flats = []
    steps = []
    for root in (faulted, reference):
        mgr = CheckpointManager(root, read_only=True)
        state: dict[str, Any] = {"model": {}, "optim": {}}
        steps.append(mgr.restore_latest(state))
        flats.append(flatten(state)[0])
    a, b = flats
    diff = sorted(set(a) ^ set(b))
    n = 0
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            n += 1
            if not (
                isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x, y)
            ):
                diff.append(k)
        elif x != y:
            diff.append(k)
    if steps[0] != steps[1]:
        diff.insert(0, f"final step {steps[0]} != {steps[1]}")
    return not diff, n, diff


def run_demo(cfg: DemoConfig, *, echo=print, progress: bool = True) -> dict[str, Any]:
    """Run the demo and return its summary (see ``trainguard demo --json``)."""
    from .recovery.config import Backoff, SupervisorConfig
    from .recovery.supervisor import Supervisor

    script = find_script(cfg.script)
    out = cfg.out.absolute()
    faulted, reference = out / "faulted", out / "reference"
    for d in (faulted, reference):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    plan = fault_plan(cfg)
    plan_file = out / "fault_plan.json"
    plan_file.write_text(json.dumps(plan, indent=1))
    for f in plan:
        echo(f"planned failure: {KIND_LABELS[f['kind']]} after step {after_step(f)} (attempt {f['attempt']})")

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.time()
    ref_log = open(out / "reference.log", "w")  # noqa: SIM115 - closed below
    ref = subprocess.Popen(
        _train_cmd(script, reference, cfg, None), stdout=ref_log, stderr=subprocess.STDOUT, env=env
    )
    ref_end: list[float] = []

    def wait_reference() -> None:
        ref.wait()
        ref_end.append(time.time())

    waiter = threading.Thread(target=wait_reference, daemon=True)
    waiter.start()

    job_log = out / "faulted.log"
    job_log.write_text("")
    wrapped = [
        "/bin/sh",
        "-c",
        'exec "$@" >>"$0" 2>&1',
        str(job_log),
        *_train_cmd(script, faulted, cfg, plan_file),
    ]
    sup_cfg = SupervisorConfig(
        max_restarts=cfg.failures + 2,
        heartbeat_timeout_s=cfg.heartbeat_timeout_s,
        grace_period_s=2.0,
        backoff=Backoff(initial_s=0.2, max_s=2.0, factor=2.0),
        max_no_progress_restarts=3,
        root=faulted,
        poll_interval_s=0.05,
        env={"PYTHONUNBUFFERED": "1"},
    )
    stop = threading.Event()
    bar = _ProgressThread(cfg.steps, faulted, reference, stop, enabled=progress, echo=echo)
    bar.start()
    try:
        result = Supervisor(wrapped, sup_cfg, echo=bar.print).run()
        t_faulted = time.time() - t0
        ref_rc = ref.wait()
        waiter.join()
        t_ref = ref_end[0] - t0
    finally:
        stop.set()
        bar.join()
        ref_log.close()
        if ref.poll() is None:
            ref.kill()
    summary = summarize(cfg, plan, result, faulted, reference, t_faulted, t_ref, ref_rc)
    path, figs = write_demo_report(faulted, out / "report.html")
    summary["report"] = str(path)
    if figs["goodput"] is not None:  # one definition, one number: the report's (productive time / wall time)
        summary["goodput"] = figs["goodput"]
    return summary


def write_demo_report(faulted: Path, path: Path) -> tuple[Path, dict[str, Any]]:
    """Write the HTML report (``trainguard report``) of the faulted run; return its path and its figures."""
    from .observe.figures import report_figures
    from .observe.html import write_report

    figs = report_figures(str(faulted))
    return write_report(figs, path), figs


def summarize(
    cfg: DemoConfig,
    plan: list[dict[str, Any]],
    result: Any,
    faulted: Path,
    reference: Path,
    wall_s: float,
    ref_wall_s: float,
    ref_rc: int,
) -> dict[str, Any]:
    saves = [e for e in read_events(faulted, event="save")]
    failures_ev = read_events(faulted, event="failure")
    restores = read_events(faulted, event="restore")
    skipped = read_events(faulted, event="restore_skipped")
    log = _log_steps(faulted)
    final_steps: dict[int, dict[str, Any]] = {}
    for r in log:
        final_steps[r["step"]] = r  # the last run of each step is the one that survived
    useful_s = sum(r["step_s"] for r in final_steps.values())
    final_json = faulted / "final.json"
    final = json.loads(final_json.read_text()) if final_json.exists() else {}
    identical, n_tensors, diff = (False, 0, ["faulted run did not finish"])
    if result.exit_code == 0 and ref_rc == 0:
        identical, n_tensors, diff = compare_final(faulted, reference)
    recoveries = list(result.recoveries)
    failures = []
    for _i, f in enumerate(plan):
        rec = next((r for r in recoveries if r.restart_count == f["attempt"] + 1), None)
        fev = next((e for e in failures_ev if e.get("restart_count") == f["attempt"]), None)
        # every save committed before the supervisor recorded the failure (the job was dead by then; a hung job
        # commits its saves in flight after its last heartbeat, t_death, until it is killed)
        t_death = fev.get("t", fev.get("t_death")) if fev else None
        committed_before = sorted(e["step"] for e in saves if t_death is not None and e["t"] <= t_death)
        corrupt = {s.get("step") for s in skipped if s.get("restart_count") == f["attempt"] + 1}
        newest_valid = max((s for s in committed_before if s not in corrupt), default=None)
        restore = next((e for e in restores if e.get("restart_count") == f["attempt"] + 1), None)
        resumed = restore.get("step") if restore else None
        recovered = bool(rec and rec.complete)
        if f["kind"] == "silent_corruption":
            # recovered means the damaged step was flagged (suspect) and skipped: a resume from it is a failure
            flagged = [
                int(s["step"])
                for s in skipped
                if s.get("restart_count") == f["attempt"] + 1
                and "suspect" in str(s.get("problem", ""))
                and isinstance(s.get("step"), int)
            ]
            recovered = recovered and bool(flagged) and resumed is not None and resumed < min(flagged)
        failures.append(
            {
                "kind": f["kind"],
                # the supervisor's own record of the step (the last heartbeat), the planned one if it has none
                "step": fev.get("last_step") if fev and fev.get("last_step") is not None else after_step(f),
                "planned_step": after_step(f),
                "cause": fev.get("cause") if fev else None,
                "steps_lost": rec.steps_lost if rec else None,
                "ttr_s": rec.ttr_s if rec else None,
                "phases": rec.phases if rec else {},
                "resumed_from": resumed,
                "newest_valid_at_failure": newest_valid,
                "resumed_from_newest_valid": resumed is not None
                and newest_valid is not None
                and resumed >= newest_valid,
                "corrupt_chunk_reported": [
                    s.get("chunk")
                    for s in skipped
                    if s.get("restart_count") == f["attempt"] + 1 and s.get("chunk")
                ],
                "suspect_skipped": [
                    {"step": s.get("step"), "problem": s.get("problem")}
                    for s in skipped
                    if s.get("restart_count") == f["attempt"] + 1 and "suspect" in str(s.get("problem", ""))
                ],
                "recovered": recovered,
            }
        )
    blocks = [e.get("block_s", 0.0) for e in saves]
    summary = {
        "identical": identical,
        "tensors_compared": n_tensors,
        "differences": diff[:20],
        "steps": cfg.steps,
        "final_loss": final.get("train_loss"),
        "val_loss": final.get("val_loss"),
        "checkpoints": {
            "count": len(saves),
            "bytes": sum(e.get("bytes", 0) for e in saves),
            "bytes_written": sum(e.get("bytes_written", 0) for e in saves),
            "mean_block_s": sum(blocks) / len(blocks) if blocks else 0.0,
            "max_block_s": max(blocks) if blocks else 0.0,
            "mean_persist_s": (sum(e.get("persist_s", 0.0) for e in saves) / len(saves)) if saves else 0.0,
        },
        "failures": failures,
        "goodput": useful_s / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "reference_wall_s": ref_wall_s,
        "useful_train_s": useful_s,
        "supervisor_exit_code": result.exit_code,
        "attempts": len(result.attempts),
        "out": str(faulted.parent),
    }
    summary["ok"] = bool(
        identical
        and result.exit_code == 0
        and all(f["recovered"] and f["resumed_from_newest_valid"] for f in failures)
    )
    return summary


class _ProgressThread(threading.Thread):
    """Shows both runs' progress (steps from their train logs) and prints supervisor messages above it."""

    def __init__(
        self, total: int, faulted: Path, reference: Path, stop: threading.Event, *, enabled: bool, echo
    ) -> None:
        super().__init__(daemon=True)
        self.total, self.faulted, self.reference, self.stop = total, faulted, reference, stop
        self.enabled = enabled
        self.echo = echo
        self._progress = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description:<28}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[note]}"),
                TimeElapsedColumn(),
            )

    def print(self, msg: str) -> None:
        if self._progress is not None:
            self._progress.console.print(msg, highlight=False, markup=False)
        else:
            self.echo(msg)

    def run(self) -> None:
        if self._progress is None:
            self.stop.wait()
            return
        with self._progress as prog:
            a = prog.add_task("with failures (supervised)", total=self.total, note="")
            b = prog.add_task("uninterrupted reference", total=self.total, note="")
            while True:
                for task, root in ((a, self.faulted), (b, self.reference)):
                    log = _tail_step(root / "train_log.jsonl")
                    if log is not None:
                        prog.update(task, completed=log[0], note=f"loss {log[1]:.3f}")
                if self.stop.wait(0.5):
                    break


def _tail_step(path: Path) -> tuple[int, float] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            r = json.loads(line)
            return int(r["step"]), float(r["loss"])
        except (ValueError, KeyError):
            continue
    return None
