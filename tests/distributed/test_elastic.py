"""torchrun's elastic agent across two "nodes" on this machine, each under its own ``trainguard run``.

Two agents (``--nnodes=1:2``, one worker each, c10d rendezvous on loopback) share one run root. At a seeded
step the node that does not host the rendezvous store is lost whole (its supervisor, agent and worker get
SIGKILL): the survivor's agent re-rendezvouses at world size 1 and its worker resumes from the newest valid
checkpoint. When the job has reached step ``HOLD`` at world size 1, the node comes back (a new supervisor, as
a requeued node would start): the agent sees a node waiting, restarts its worker, and the job continues at
world size 2 from the checkpoint of step ``HOLD``. A reference run trains the same resize schedule
(``torchrun --standalone`` segments at 2, 1, 2 ranks that stop at the same checkpoints) beside it.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.recovery.job import RestartBudget

from .launch import HERE, REPO, free_port, job_env, run, torchrun_cmd
from .worker import differences

pytestmark = [pytest.mark.distributed, pytest.mark.elastic]

WORKER = HERE / "elastic_worker.py"
STEPS, SAVE_EVERY, HOLD = 24, 4, 16
KILL_AT = random.Random(13).randint(SAVE_EVERY + 1, HOLD - SAVE_EVERY - 1)  # seeded, at world size 2
RESUMED_AT = KILL_AT // SAVE_EVERY * SAVE_EVERY  # the newest checkpoint when the node is lost
# Tight but load-tolerant rendezvous: a lost node's lease expires after 3 missed 1 s keep-alives; a round
# closes 2 s after the minimum of nodes joined (at once when both are there).
RDZV_CONF = "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
MARKER_TIMEOUT_S = 240


def node_cmd(root: Path, port: int, run_id: str, logs: Path, control: Path, *, host: bool) -> list[str]:
    """One node's command line; ``host``: its agent hosts the c10d rendezvous store (``is_host`` in the
    rendezvous config: chosen here, not by which agent happens to bind the port first on a loaded machine)."""
    supervisor = [sys.executable, "-m", "trainguard", "run", "--root", str(root), "--max-restarts", "3"]
    supervisor += ["--backoff", "0.2", "--grace-period", "5", "--json", "--"]
    agent = [str(Path(sys.executable).with_name("torchrun")), "--nnodes=1:2", "--nproc-per-node=1"]
    agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}"]
    agent += [
        "--max-restarts=3",
        "--monitor-interval=0.2",
        f"--rdzv-conf={RDZV_CONF},is_host={str(host).lower()}",
    ]
    return [
        *supervisor,
        *agent,
        *worker_args(root, logs, control, "--kill-at", str(KILL_AT), "--hold-at", str(HOLD)),
    ]


def worker_args(root: Path, logs: Path, control: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--root", str(root), "--log-dir", str(logs), "--control-dir", str(control),
            "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), *extra]  # fmt: skip


def start(cmd: list[str], out: Path) -> subprocess.Popen[str]:
    env = job_env()  # no TORCH_DISABLE_SHARE_RDZV_TCP_STORE: trainguard run sets it for elastic torchrun
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    return subprocess.Popen(
        cmd, stdout=open(out, "w"), stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip


def wait_for(path: Path, procs: list[subprocess.Popen[str]], what: str) -> None:
    end = time.monotonic() + MARKER_TIMEOUT_S
    while not path.exists():
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"waiting for {what}, a node ended early: {dead}"
        assert time.monotonic() < end, f"no {what} within {MARKER_TIMEOUT_S} s"
        time.sleep(0.2)


def wait_for_store(port: int, procs: list[subprocess.Popen[str]]) -> None:
    """Until the c10d store of node A accepts connections on ``port`` (its agent is up and hosting)."""
    end = time.monotonic() + MARKER_TIMEOUT_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            dead = [p.args for p in procs if p.poll() is not None]
            assert not dead, f"waiting for node A's rendezvous store, a node ended early: {dead}"
            assert time.monotonic() < end, f"node A's rendezvous store not up within {MARKER_TIMEOUT_S} s"
            time.sleep(0.2)


def kill_node(supervisor: subprocess.Popen[str], root: Path, worker_pid: int) -> None:
    """SIGKILL a node: its supervisor, its torchrun agent (own session) and its worker (own session)."""
    [log] = (root / "events").glob(f"supervisor-{supervisor.pid}-*.jsonl")
    agents = [json.loads(line)["pid"] for line in log.read_text().splitlines() if '"job_start"' in line]
    for pgid in (supervisor.pid, *agents, worker_pid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    supervisor.wait(30)


def reference_run(root: Path, logs: Path, control: Path) -> None:
    """The same resize schedule without failures: 2 ranks to RESUMED_AT, 1 rank to HOLD, 2 ranks to the end."""
    for nprocs, stop in ((2, RESUMED_AT), (1, HOLD), (2, STEPS)):
        r = run(
            torchrun_cmd(nprocs, *worker_args(root, logs, control, "--stop-at", str(stop))), timeout_s=300
        )
        assert r.returncode == 0, r.stdout[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("elastic")
    paths = {k: d / k for k in ("root", "logs", "control", "ref_root", "ref_logs", "ref_control")}
    for p in paths.values():
        p.mkdir()
    ref_error: list[BaseException] = []

    def reference() -> None:
        try:
            reference_run(paths["ref_root"], paths["ref_logs"], paths["ref_control"])
        except BaseException as e:  # reported by the test
            ref_error.append(e)

    ref = threading.Thread(target=reference)
    ref.start()
    run_id = f"elastic-{secrets.token_hex(3)}"
    port = free_port()
    cmd = node_cmd(paths["root"], port, run_id, paths["logs"], paths["control"], host=False)
    node_a = start(
        node_cmd(paths["root"], port, run_id, paths["logs"], paths["control"], host=True), d / "node_a.out"
    )
    procs = [node_a]
    try:
        # node A hosts the c10d store (the store host's loss would end the job); node B, the one lost, only
        # connects to it: it starts once the store listens, so its connect timeout runs on a store that is up
        wait_for_store(port, procs)
        node_b = start(cmd, d / "node_b.out")
        procs.append(node_b)
        wait_for(paths["control"] / "at-kill", procs, f"step {KILL_AT} at world size 2")
        kill_node(node_b, paths["root"], int((paths["control"] / "at-kill").read_text()))
        procs.remove(node_b)
        wait_for(paths["control"] / "holding", procs, f"step {HOLD} at world size 1")
        node_b2 = start(cmd, d / "node_b2.out")
        procs.append(node_b2)
        end = time.monotonic() + MARKER_TIMEOUT_S
        for p in (node_a, node_b2):
            try:
                p.wait(timeout=max(end - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"the job did not end within {MARKER_TIMEOUT_S} s after node B came back"
                ) from None
    except AssertionError as e:
        # a node that ended early, a step never reached or a job that never ended: say what every node printed
        raise AssertionError(f"{e}\n{diagnostics(d, paths['root'], paths['logs'])}") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        ref.join(timeout=600)
    outs = {name: (d / f"{name}.out").read_text() for name in ("node_a", "node_b2")}
    assert not ref_error, ref_error
    return {**paths, "run_id": run_id, "node_a": node_a, "node_b2": node_b2, "outs": outs}


def diagnostics(d: Path, root: Path, logs: Path, tail: int = 3000) -> str:
    """What a stuck elastic run leaves to read: each node's output (supervisor, torchrun agent, worker), the
    supervisors' event logs and the last step each worker logged, tails of ``tail`` characters."""
    parts = []
    for out in sorted(d.glob("node_*.out")):
        parts.append(f"--- {out.name} ---\n{out.read_text(errors='replace')[-tail:]}")
    for log in sorted((root / "events").glob("supervisor-*.jsonl")):
        parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-tail:]}")
    for f in sorted(logs.glob("steps-*.jsonl")):
        lines = f.read_text(errors="replace").splitlines()
        parts.append(f"--- {f.name}: {len(lines)} steps, last: {lines[-1] if lines else None}")
    return "\n".join(parts)


def lineage(logs: Path) -> dict[int, list[dict[str, Any]]]:
    """Per step, the records (one per rank, by rank) of the execution the final state descends from: the
    execution that restored from the newest checkpoint before that step."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for f in logs.glob("steps-*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            by_step[r["step"]].append(r)
    out = {}
    for step, recs in sorted(by_step.items()):
        newest = max(r["restored"] for r in recs)
        out[step] = sorted((r for r in recs if r["restored"] == newest), key=lambda r: r["rank"])
    return out


def test_both_nodes_end_successfully_after_the_loss_and_the_return_of_a_node(runs):
    for name in ("node_a", "node_b2"):
        assert runs[name].returncode == 0, runs["outs"][name][-4000:]
        assert json.loads(runs["outs"][name][runs["outs"][name].rindex('{\n  "exit_code"') :])["status"] == (
            "succeeded"
        )


def test_the_job_shrinks_to_one_node_then_grows_back_to_two(runs):
    steps = lineage(runs["logs"])
    assert sorted(steps) == list(range(1, STEPS + 1))
    sizes = {s: {r["world_size"] for r in recs} | {len(recs)} for s, recs in steps.items()}
    assert all(sizes[s] == {2} for s in range(1, RESUMED_AT + 1))
    assert all(sizes[s] == {1} for s in range(RESUMED_AT + 1, HOLD + 1))
    assert all(sizes[s] == {2} for s in range(HOLD + 1, STEPS + 1))
    # where each execution restored from: nothing, the checkpoint before the loss, the one before the join
    assert [steps[s][0]["restored"] for s in (1, RESUMED_AT + 1, HOLD + 1)] == [0, RESUMED_AT, HOLD]
    restores = read_events(runs["root"], event="restore")
    assert {(e["step"], e.get("rank")) for e in restores} >= {(RESUMED_AT, 0), (HOLD, 0), (HOLD, 1)}


def test_every_sample_of_each_epoch_is_consumed_exactly_once_across_both_resizes(runs):
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for recs in lineage(runs["logs"]).values():
        for r in recs:
            per_epoch[r["epoch"]].extend(r["ids"])
    samples = 48  # elastic_worker.DATASET_SIZE
    full = [e for e in per_epoch if e < max(per_epoch)]
    assert full, "the run should finish at least one epoch"
    for epoch, ids in per_epoch.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample was consumed twice"
        if epoch in full:
            assert sorted(ids) == list(range(samples)), f"epoch {epoch}: a sample was skipped"


def test_the_resized_job_ends_bit_identical_to_a_reference_with_the_same_resize_schedule(runs):
    finals = []
    for root in (runs["root"], runs["ref_root"]):
        state: dict[str, Any] = {"model": {}, "optim": {}, "loader": {}, "rng": {}}
        assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == STEPS
        finals.append(state)
    assert differences(finals[0], finals[1]) == []
    got, ref = lineage(runs["logs"]), lineage(runs["ref_logs"])
    key = ("world_size", "rank", "epoch", "ids", "loss")
    assert [[{k: r[k] for k in key} for r in got[s]] for s in got] == [
        [{k: r[k] for k in key} for r in ref[s]] for s in ref
    ]


def test_both_nodes_supervisors_share_one_run_id_and_one_restart_budget(runs):
    run_id = runs["run_id"]
    sup_events = [e for e in read_events(runs["root"]) if e["source"] == "supervisor"]
    starts = [e for e in sup_events if e["event"] == "supervisor_start"]
    assert len(starts) == 3  # node A, node B (lost), node B back
    assert {e["run_id"] for e in sup_events} == {run_id}
    assert {r["run_id"] for recs in lineage(runs["logs"]).values() for r in recs} == {run_id}
    # torchrun's agent restarted the survivor's worker itself (node loss, node join): no supervisor restart
    assert read_events(runs["root"], event="failure") == []
    assert RestartBudget(runs["root"], run_id, 3).used() == 0
