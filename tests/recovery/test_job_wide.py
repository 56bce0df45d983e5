"""One job across nodes and schedulers: a shared run id and restart budget for every node's supervisor, and a
scheduler's preemption notice (Slurm ``--signal=USR1@120``) handled as a preemption by ``trainguard run``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard.errors import ConfigError
from trainguard.recovery.config import EXIT_MAX_RESTARTS, Backoff, SupervisorConfig
from trainguard.recovery.events import read_events
from trainguard.recovery.heartbeat import parse_signal
from trainguard.recovery.job import RestartBudget, is_elastic_torchrun, run_id_from_command
from trainguard.recovery.supervisor import Supervisor

REPO = Path(__file__).resolve().parents[2]
FAST = ["--backoff", "0.01", "--max-backoff", "0.05", "--grace-period", "10", "--poll-interval", "0.05"]


def failing_job(tmp_path: Path, name: str) -> list[str]:
    """A job that records its environment and fails (exit 9)."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        "import json, os, sys\n"
        f"with open({str(tmp_path / (name + '.jsonl'))!r}, 'a') as f:\n"
        "    f.write(json.dumps({k: v for k, v in os.environ.items() if k.startswith('TRAINGUARD_')}) + '\\n')\n"
        "sys.exit(9)\n"
    )
    return [sys.executable, str(script)]


def node_config(root: Path, run_id: str | None, max_restarts: int) -> SupervisorConfig:
    return SupervisorConfig(
        root=root,
        run_id=run_id,
        max_restarts=max_restarts,
        max_no_progress_restarts=0,
        backoff=Backoff(initial_s=0.01, max_s=0.02),
        grace_period_s=0.5,
        poll_interval_s=0.05,
        forward_signals=False,
    )


def test_two_nodes_supervisors_of_one_run_id_share_one_restart_budget(tmp_path):
    root = tmp_path / "root"
    results = {}

    def node(name: str) -> None:
        results[name] = Supervisor(
            failing_job(tmp_path, name), node_config(root, "job-42", 5), echo=lambda m: None
        ).run()

    threads = [threading.Thread(target=node, args=(n,)) for n in ("node_a", "node_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # 7 launches of a Python job in all: seconds, unless the machine is very busy
    assert not any(t.is_alive() for t in threads), "a node's supervisor never finished"
    # 5 restarts for the whole job, not 5 per node: 2 first attempts + 5 restarts = 7 launches in all
    assert {r.exit_code for r in results.values()} == {EXIT_MAX_RESTARTS}
    assert sum(len(r.attempts) for r in results.values()) == 2 + 5
    assert RestartBudget(root, "job-42", 5).used() == 5
    # each restart number went to exactly one node; the job saw restart numbers 1..5 once each
    counts = [
        int(json.loads(line)["TRAINGUARD_RESTART_COUNT"])
        for n in ("node_a", "node_b")
        for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()
    ]
    assert sorted(counts) == [0, 0, 1, 2, 3, 4, 5]
    events = [e for e in read_events(root) if e["source"] == "supervisor"]
    assert {e["run_id"] for e in events} == {"job-42"} and all("host" in e for e in events)
    assert sorted(e["restart_count"] for e in events if e["event"] == "restart") == [1, 2, 3, 4, 5]


def test_restarts_spent_on_one_node_are_gone_for_the_other(tmp_path):
    root = tmp_path / "root"
    first = Supervisor(
        failing_job(tmp_path, "node_b"), node_config(root, "job-7", 3), echo=lambda m: None
    ).run()
    assert (first.exit_code, len(first.attempts)) == (EXIT_MAX_RESTARTS, 4)
    said: list[str] = []
    later = Supervisor(failing_job(tmp_path, "node_a"), node_config(root, "job-7", 3), echo=said.append).run()
    assert (later.exit_code, len(later.attempts)) == (EXIT_MAX_RESTARTS, 1)  # its first failure ends it
    assert any("job's 3 restarts are spent" in m and "its own --run-id" in m for m in said), said
    other = Supervisor(
        failing_job(tmp_path, "node_c"), node_config(root, "job-8", 3), echo=lambda m: None
    ).run()
    assert len(other.attempts) == 4  # another run id has its own budget


def test_the_run_id_comes_from_torchrun_rdzv_id_and_elastic_torchrun_gets_a_separate_worker_store(tmp_path):
    assert run_id_from_command(["torchrun", "--nnodes=1:2", "--rdzv-id", "job-9", "train.py"]) == "job-9"
    assert run_id_from_command(["torchrun", "--rdzv_id=job-9", "train.py", "--rdzv-id", "x"]) == "job-9"
    assert (
        run_id_from_command([sys.executable, "-m", "torch.distributed.run", "--rdzv-id=a.b", "t.py"]) == "a.b"
    )
    assert run_id_from_command(["torchrun", "--standalone", "train.py", "--rdzv-id", "x"]) is None
    assert run_id_from_command(["torchrun", "--rdzv-id", "none", "t.py"]) is None
    assert run_id_from_command(["python", "train.py", "--rdzv-id", "x"]) is None
    assert is_elastic_torchrun(["torchrun", "--nnodes", "1:2", "t.py"])
    assert not is_elastic_torchrun(["torchrun", "--nnodes", "2", "t.py"])
    with pytest.raises(ConfigError, match=r"cannot be a run id.*A-Z a-z 0-9"):
        run_id_from_command(["torchrun", "--rdzv-id", "../escape", "t.py"])
    with pytest.raises(ConfigError, match="cannot be a run id"):
        SupervisorConfig(run_id="a/b")
    # the supervisor takes the id and sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 only for node ranges
    probe = tmp_path / "env.py"
    probe.write_text(
        "import json, os, sys\n"
        "json.dump({k: os.environ.get(k) for k in ('TRAINGUARD_RUN_ID', 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE')},"
        " open(sys.argv[-1], 'w'))\n"
    )
    fake = tmp_path / "torchrun"  # a stand-in launcher named torchrun that runs the probe
    fake.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv = sys.argv[-2:]\nrunpy.run_path(sys.argv[0])\n"
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    for nnodes, want in (("1:2", "1"), ("2", None)):
        out = tmp_path / f"env-{nnodes.replace(':', '-')}.json"
        cmd = [str(fake), f"--nnodes={nnodes}", "--rdzv-id=job-5", str(probe), str(out)]
        r = subprocess.run(
            [sys.executable, "-m", "trainguard", "run", "--root", str(tmp_path / "root"), *FAST, "--", *cmd],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(out.read_text()) == {
            "TRAINGUARD_RUN_ID": "job-5",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": want,
        }


@pytest.mark.parametrize("name", ["SIGKILL", "TERM", "INT", "STOP"])
def test_a_preemption_signal_that_cannot_be_one_is_refused(name):
    with pytest.raises(ConfigError, match="cannot be a preemption signal"):
        SupervisorConfig(preempt_signals=(parse_signal(name),))
    with pytest.raises(ConfigError, match="not a signal name"):
        parse_signal("USR3")


TRAINER = """
import json, os, sys, time, torch
import trainguard as tg

root, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(1000), save_on_preemption=True, async_save=False)
state = {"model": model, "optim": optim, "rng": tg.RNGState()}
start = mgr.restore_latest(state) or 0
with open(out, "a") as f:
    f.write(json.dumps({"restored": start, "restart": os.environ["TRAINGUARD_RESTART_COUNT"]}) + "\\n")
for step in range(start + 1, 100_000):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    optim.zero_grad(); loss.backward(); optim.step()
    if step == start + 3:
        open(out + ".ready", "w").close()
    mgr.maybe_save(step, state, force=step == 100_000 - 1)
    time.sleep(0.02)
"""


@pytest.mark.parametrize("target", ["supervisor", "every process"])
def test_a_slurm_usr1_notice_saves_a_checkpoint_stops_without_restart_and_the_requeued_job_resumes(
    tmp_path, target
):
    """sbatch --signal=USR1@120 signals the job's processes (or, with B:, only the batch shell running
    `trainguard run`): either way the job saves at its next step and `trainguard run` exits 75 (requeue)."""
    script, root, out = tmp_path / "train.py", tmp_path / "ckpts", tmp_path / "attempts.jsonl"
    script.write_text(TRAINER)
    cmd = [sys.executable, "-m", "trainguard", "run", "--root", str(root), *FAST, "--preempt-signal", "USR1"]
    cmd += ["--json", "--", sys.executable, str(script), str(root), str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    sup = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not Path(str(out) + ".ready").exists():
            assert sup.poll() is None and time.monotonic() < deadline, sup.communicate()
            time.sleep(0.05)
        if target == "supervisor":
            os.kill(sup.pid, signal.SIGUSR1)
        else:
            os.killpg(sup.pid, signal.SIGUSR1)  # the supervisor's group; the job's group (own session) too
            [start] = [e for e in read_events(root, event="job_start")]
            os.killpg(start["pid"], signal.SIGUSR1)
        stdout, stderr = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
    assert sup.returncode == 75, stderr[-3000:]
    result = json.loads(stdout)
    assert (result["status"], result["reason"], result["exit_code"]) == ("preempted", "SIGUSR1", 75)
    assert len(read_events(root, event="job_start")) == 1  # not restarted
    [preempted] = read_events(root, event="preempted")
    assert preempted["job_exit_code"] == 75  # the job saved and exited EX_TEMPFAIL
    [saved] = read_events(root, event="preemption")
    assert (root / f"step-{saved['step']:09d}" / "manifest.json").exists()
    # the requeued job (a new `trainguard run`) resumes from the preemption checkpoint
    Path(str(out) + ".ready").unlink()
    again = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not Path(str(out) + ".ready").exists():
            assert again.poll() is None and time.monotonic() < deadline, again.communicate()
            time.sleep(0.05)
        os.kill(again.pid, signal.SIGUSR1)
        again.communicate(timeout=120)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    attempts = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["restored"] for a in attempts] == [0, saved["step"]]


def test_the_slurm_and_kubernetes_examples_use_the_documented_options():
    import yaml

    sbatch = (REPO / "examples" / "slurm" / "train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "examples" / "slurm" / "train.sbatch")]).returncode == 0
    for directive in ("#SBATCH --requeue", "#SBATCH --signal=USR1@120"):
        assert directive in sbatch
    assert "trainguard run" in sbatch and "--preempt-signal USR1" in sbatch and "scontrol requeue" in sbatch
    docs = list(yaml.safe_load_all((REPO / "examples" / "kubernetes" / "pytorchjob.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "PyTorchJob"]
    job = docs[1]["spec"]
    worker = job["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "OnFailure" and job["elasticPolicy"]["maxReplicas"] == 2
    container = worker["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["trainguard", "run"] and container["args"][0] == "torchrun"
    assert {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}.items() <= {
        e["name"]: e["value"] for e in container["env"]
    }.items()
