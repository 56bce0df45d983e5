"""Prometheus metrics: scraped from the supervisor's endpoint on 127.0.0.1 during a real supervised run with
one injected failure, parsed with prometheus-client's parser, and checked against the event log."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import trainguard as tg
from trainguard.observe.figures import goodput, report_figures
from trainguard.observe.metrics import GOODPUT_EVERY_S
from trainguard.observe.status import run_status
from trainguard.recovery.config import TAIL_INTERVAL_S, Backoff, SupervisorConfig
from trainguard.recovery.events import read_events
from trainguard.recovery.supervisor import Supervisor
from trainguard.recovery.ttr import PHASES

JOB = r"""
import errno, os, sys, time
from pathlib import Path
import torch
import trainguard as tg
from trainguard.storage import Fault, FaultyStorage, LocalStorage

root, work = sys.argv[1], Path(sys.argv[2])
attempt = int(os.environ["TRAINGUARD_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
disk = FaultyStorage(LocalStorage(root))
mgr = tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(5), keep=2, async_save=False)
state = {"model": model, "optim": optim}
start = mgr.restore_latest(state) or 0
for step in range(start + 1, 21):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    optim.zero_grad(); loss.backward(); optim.step()
    time.sleep(0.02)
    mgr.maybe_save(step, state)
    if attempt == 0 and step == 12:
        mgr.log_event("fault_injected", kind="kill_step", step=12)
        os.kill(os.getpid(), 9)
if attempt == 1:
    full = disk.add(Fault("write", times=None, errno=errno.ENOSPC))
    try:
        mgr.save(21, state)
    except tg.SaveError:
        pass
    full.enabled = False
    (work / "ready").touch()
    while not (work / "release").exists():
        tg.heartbeat(20)
        time.sleep(0.05)
mgr.close()
"""


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def reachable_elsewhere(port: int) -> list[str]:
    """The machine's other IPv4 addresses (not 127.0.0.1) on which ``port`` accepts a connection."""
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        addrs = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:  # the outward address (nothing is sent)
        try:
            u.connect(("10.255.255.255", 1))
            addrs.add(u.getsockname()[0])
        except OSError:
            pass
    open_on = []
    for addr in sorted(addrs - {"127.0.0.1"}):
        with socket.socket() as s:
            s.settimeout(2)
            if s.connect_ex((addr, port)) == 0:
                open_on.append(addr)
    return open_on


def wait_until(pred, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
def test_the_supervisor_endpoint_moves_as_the_event_log_says_during_a_run_with_one_failure(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(JOB)
    root = tmp_path / "root"
    cfg = SupervisorConfig(
        root=root,
        metrics_port=0,
        forward_signals=False,
        backoff=Backoff(initial_s=0.01, max_s=0.05),
        grace_period_s=1.0,
        poll_interval_s=0.05,
        max_restarts=2,
    )
    sup = Supervisor([sys.executable, str(job), str(root), str(tmp_path)], cfg, echo=lambda m: None)
    results = []
    thread = threading.Thread(target=lambda: results.append(sup.run()))
    thread.start()
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), 180, "the restarted job")
        wait_until(lambda: read_events(root, event="recovery"), 30, "the recovery event")
        time.sleep(2 * TAIL_INTERVAL_S + GOODPUT_EVERY_S + 0.5)  # the supervisor reads the tail, refreshes
        url = sup.metrics_url
        assert url is not None and urlparse(url).hostname == "127.0.0.1"
        # on a loaded machine the supervisor may lag: give it until the gauge has caught up with the log
        wait_until(
            lambda: (
                scrape(url).get(("trainguard_goodput_ratio", frozenset()))
                == pytest.approx(goodput(read_events(root))[0], rel=1e-6)
            ),
            30,
            "the goodput gauge to catch up with the event log",
        )
        m = scrape(url)
        assert not reachable_elsewhere(urlparse(url).port)  # bound to the loopback address only
        ev = read_events(root)
        live = report_figures(str(root))  # the report and the status of a root still being written
        status = run_status(root)
    finally:
        (tmp_path / "release").touch()
        thread.join(120)
    assert results and results[0].exit_code == 0

    def n(name: str) -> int:
        return sum(1 for r in ev if r["event"] == name)

    saves = [r for r in ev if r["event"] == "save"]
    [rec] = [r for r in ev if r["event"] == "recovery"]
    assert m[("trainguard_restarts_total", frozenset())] == n("restart") == 1
    assert m[("trainguard_failures_total", frozenset({("cause", "signal")}))] == n("failure") == 1
    total = frozenset({("phase", "total")})
    assert m[("trainguard_ttr_seconds_count", total)] == 1
    assert m[("trainguard_ttr_seconds_sum", total)] == pytest.approx(rec["ttr_s"])
    for phase in PHASES:
        key = ("trainguard_ttr_seconds_sum", frozenset({("phase", phase[:-2])}))
        assert m[key] == pytest.approx(rec["phases"][phase]), phase
    assert m[("trainguard_save_block_seconds_count", frozenset())] == len(saves) == 4
    assert m[("trainguard_save_block_seconds_sum", frozenset())] == pytest.approx(
        sum(s["block_s"] for s in saves)
    )
    assert m[("trainguard_save_persist_seconds_sum", frozenset())] == pytest.approx(
        sum(s["persist_s"] for s in saves)
    )
    assert m[("trainguard_checkpoint_bytes", frozenset())] == saves[-1]["bytes"]
    assert m[("trainguard_save_failures_total", frozenset())] == n("save_failed") == 1
    assert m[("trainguard_last_valid_step", frozenset())] == 20 == max(s["step"] for s in saves)
    assert 0 < m[("trainguard_goodput_ratio", frozenset())] <= 1
    assert m[("trainguard_goodput_ratio", frozenset())] == pytest.approx(goodput(ev)[0], rel=1e-6)
    assert live["run"]["status"] == "running" and status["status"] == "running"
    [f] = live["failures"]
    assert (f["kind"], f["cause"], f["step"], f["restored_step"], f["steps_lost"]) == (
        "kill_step",
        "signal",
        12,
        10,
        2,
    )
    assert f["ttr_s"] == pytest.approx(rec["ttr_s"]) and live["goodput"] == pytest.approx(goodput(ev)[0])
    assert (status["step"], status["step_source"], status["restarts"], status["attempt"]) == (
        20,
        "heartbeat",
        1,
        1,
    )
    assert status["newest_valid"]["step"] == 20 and status["saves_in_flight"] == []
    # the endpoint is gone with the run, and its port is free again
    assert sup.metrics_url is None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)


def test_the_manager_exports_its_save_metrics_in_its_own_registry(tmp_path):
    import torch

    from trainguard.storage import Fault, FaultyStorage, LocalStorage

    disk = FaultyStorage(LocalStorage(tmp_path))
    mgr = tg.CheckpointManager(disk, async_save=False)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    for step in (1, 2, 3):
        state["w"] += 1
        mgr.save(step, state)

    full = disk.add(Fault("write", times=None, errno=errno.ENOSPC))
    state["w"] += 1
    with pytest.raises(tg.SaveError):
        mgr.save(4, state)
    assert disk.injected
    full.enabled = False
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(mgr.metrics_registry).decode())
        for s in f.samples
        if not s.labels
    }
    mgr.close()
    saves = read_events(tmp_path, event="save")
    assert samples["trainguard_save_block_seconds_count"] == len(saves) == 3
    assert samples["trainguard_save_persist_seconds_sum"] == pytest.approx(sum(s["persist_s"] for s in saves))
    assert samples["trainguard_checkpoint_bytes"] == saves[-1]["bytes"]
    assert samples["trainguard_save_failures_total"] == len(read_events(tmp_path, event="save_failed")) == 1
    other = tg.CheckpointManager(tmp_path / "b")  # a second manager in the process has its own registry
    assert other.metrics_registry is not mgr.metrics_registry
    other.close()


def test_run_with_a_metrics_port_in_use_or_out_of_range_is_a_usage_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for bad, words in ((str(port), "cannot serve metrics"), ("70000", "70000")):
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trainguard",
                    "run",
                    "--root",
                    str(tmp_path),
                    "--metrics-port",
                    bad,
                    "--",
                    sys.executable,
                    "-c",
                    "open('started', 'w')",
                ],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=60,
            )
            assert r.returncode == 2 and words in r.stderr, r.stderr
            assert not (Path(tmp_path) / "started").exists()  # nothing was launched


def test_trainguard_run_metrics_port_serves_the_run_to_a_scraper_while_it_runs(tmp_path):
    with socket.socket() as s:  # a free port (released just before the supervisor binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = (
        "import os, urllib.request; from pathlib import Path\n"
        "k = os.environ['TRAINGUARD_RESTART_COUNT']\n"
        "if k == '0': raise SystemExit(3)\n"
        f"text = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read().decode()\n"
        "Path('scraped.txt').write_text(text)\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainguard",
            "run",
            "--root",
            str(tmp_path / "root"),
            "--metrics-port",
            str(port),
            "--backoff",
            "0.01",
            "--json",
            "--",
            sys.executable,
            "-c",
            job,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert f"Prometheus metrics at http://127.0.0.1:{port}/metrics" in r.stderr
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families((tmp_path / "scraped.txt").read_text())
        for s in f.samples
    }
    # the second attempt saw the first one's failure (exit 3) and the restart already counted
    assert samples[("trainguard_failures_total", frozenset({("cause", "exit")}))] == 1
    assert samples[("trainguard_restarts_total", frozenset())] == 1
    assert samples[("trainguard_last_valid_step", frozenset())] == -1
