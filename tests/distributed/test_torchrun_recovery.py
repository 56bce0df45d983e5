"""``trainguard run -- torchrun``: one rank SIGKILLed mid-run brings the whole job down (torchrun's default
``--max-restarts 0``), the supervisor relaunches it, and the job ends bit-identical to an uninterrupted one.

The job is ``examples/train_gpt.py`` with FSDP2 on 2 ranks (tiny model); the reference runs beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import trainguard as tg
from trainguard.recovery.events import read_events

from .launch import REPO, job_env, run, torchrun_cmd
from .worker import differences

pytestmark = pytest.mark.distributed

SCRIPT = REPO / "examples" / "train_gpt.py"
STEPS, SAVE_EVERY, KILL_AT, KILL_RANK = 30, 10, 17, 1
TINY = [
    "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--n-layer", "2", "--n-embd", "64", "--n-head", "2",
    "--block-size", "32", "--corpus-bytes", str(1 << 20), "--eval-iters", "2",
]  # fmt: skip


def train_cmd(root: Path, *extra: str) -> list[str]:
    return torchrun_cmd(2, str(SCRIPT), "--root", str(root), *TINY, *extra, standalone=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("torchrun")
    faulted, reference = d / "faulted", d / "reference"
    plan = d / "plan.json"
    plan.write_text(
        json.dumps(
            [{"attempt": 0, "step": KILL_AT, "kind": "kill_step", "rank": KILL_RANK, "after_commit": True}]
        )
    )
    ref = subprocess.Popen(  # the uninterrupted run, concurrently
        train_cmd(reference), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job_env()
    )
    supervised = [
        *(sys.executable, "-m", "trainguard", "run", "--root", str(faulted), "--max-restarts", "2"),
        *("--backoff", "0.2", "--grace-period", "5", "--json", "--"),
        *train_cmd(faulted, "--fault-plan", str(plan)),
    ]
    try:
        sup = run(supervised, timeout_s=480)
        (d / "supervisor.out").write_text(sup.stdout)  # kept for a post-mortem of a failed run
        ref_out, _ = ref.communicate(timeout=480)
    finally:
        if ref.poll() is None:
            ref.kill()
    assert ref.returncode == 0, ref_out[-4000:]
    return {"faulted": faulted, "reference": reference, "sup": sup, "ref_out": ref_out}


def test_a_killed_rank_brings_torchrun_down_and_the_supervisor_relaunches_it(runs):
    sup = runs["sup"]
    assert sup.returncode == 0, sup.stdout[-4000:]
    # examples/train_gpt.py names the last completed step (main changed the message to "after step N")
    assert f"[fault] attempt 0: kill_step after step {KILL_AT - 1} on rank {KILL_RANK}" in sup.stdout
    failures = read_events(runs["faulted"], event="failure")
    # torchrun (--max-restarts 0) tore the group down and exited non-zero itself: not killed by a signal
    assert [(f["attempt"], f["cause"]) for f in failures] == [(0, "exit")]
    assert failures[0]["exit_code"] not in (0, None) and failures[0]["last_step"] == KILL_AT - 1
    assert len(read_events(runs["faulted"], event="job_start")) == 2
    # the report joins the fault rank 1 logged before it fired with the cause torchrun's exit gave
    from trainguard.observe.figures import report_figures

    [f] = report_figures(str(runs["faulted"]))["failures"]
    assert (f["kind"], f["cause"], f["injected"]) == ("kill_step", "exit", True)
    assert (f["step"], f["injected_step"]) == (
        KILL_AT - 1,
        KILL_AT,
    )  # killed in step KILL_AT: after the one before
    [fault] = read_events(runs["faulted"], event="fault_injected")
    assert fault["rank"] == KILL_RANK


def test_every_rank_of_the_relaunched_job_resumed_from_the_newest_checkpoint(runs):
    restores = [e for e in read_events(runs["faulted"], event="restore") if e.get("restart_count") == 1]
    newest_before_kill = (KILL_AT - 1) // SAVE_EVERY * SAVE_EVERY
    assert sorted((e["rank"], e["step"]) for e in restores) == [
        (0, newest_before_kill),
        (1, newest_before_kill),
    ]
    [recovery] = read_events(runs["faulted"], event="recovery")
    assert recovery["restored_step"] == newest_before_kill


def test_the_job_killed_mid_run_ends_bit_identical_to_the_uninterrupted_one(runs):
    finals = []
    for root in (runs["faulted"], runs["reference"]):
        state: dict[str, Any] = {"app": {}, "sched": {}, "loader": {}, "rng": {}}
        assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == STEPS
        finals.append(state)
    assert differences(finals[0], finals[1]) == []
    assert len(finals[0]["app"]["model"]) > 10 and set(finals[0]["rng"]) == {"rank_0", "rank_1"}
    a, b = (json.loads((r / "final.json").read_text()) for r in (runs["faulted"], runs["reference"]))
    assert a["val_loss"] == b["val_loss"] and a["train_loss"] == b["train_loss"]


def test_every_logged_loss_before_and_after_the_resume_equals_the_uninterrupted_runs(runs):
    def log(root: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (root / "train_log.jsonl").read_text().splitlines()]

    ref = {r["step"]: r["loss"] for r in log(runs["reference"])}
    got = log(runs["faulted"])
    resumed = [r for r in got if r["attempt"] == 1]
    assert resumed[0]["step"] == (KILL_AT - 1) // SAVE_EVERY * SAVE_EVERY + 1 and resumed[-1]["step"] == STEPS
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], ref[r["step"]]) for r in got]
