from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# An ignored signal stays ignored across exec: a shell that starts pytest in the background (``pytest &``, a CI
# step under nohup) makes every job, supervisor and CLI the tests start ignore SIGINT and SIGQUIT, and Python
# then installs no KeyboardInterrupt handler in them. The tests that stop a child with SIGINT (``trainguard
# status --watch``, the supervisor's signal tests) would hang or time out. Here the test process catches them
# again (as in a terminal), so its children start with the default dispositions.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture
def repo() -> Path:
    return REPO


def run_env() -> dict[str, str]:
    """Environment for subprocesses: the test's interpreter, no supervisor variables leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_benchmark(script: str, *args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> *args`` in a subprocess from the repository root (``run_env``), its output
    captured as text."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=run_env(),
        cwd=REPO,
    )


def run_sized_benchmark(
    script: str, size_gib: str, tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict]:
    """A tiny run of a benchmark with ``_common.sized_run_main``'s command line (``--size-gib size_gib
    --repeat 1``, scratch in ``tmp_path``, JSON to ``tmp_path / "res.json"``), checked to exit 0; returns the
    process and its JSON."""
    out = tmp_path / "res.json"
    p = run_benchmark(
        script, "--size-gib", size_gib, "--repeat", "1", "--scratch", str(tmp_path), "--json", str(out)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads(out.read_text())


def run_with_file_size_limit(
    code: str, args: list[str], limit_bytes: int
) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code *args`` with a file size limit (``RLIMIT_FSIZE``; SIGXFSZ ignored, so a write past
    it fails with EFBIG): a real failing write, without patching trainguard."""

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env=run_env(),
        timeout=120,
        check=False,
    )


@pytest.fixture
def python() -> str:
    return sys.executable


# The demo's small GPT (train_args of DemoConfig), for the tests that run the demo.
TINY = (
    "--n-layer",
    "2",
    "--n-embd",
    "64",
    "--n-head",
    "2",
    "--block-size",
    "32",
    "--corpus-bytes",
    str(1 << 20),
)


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One demo run with five failures (one of each kind), 60 steps of the small GPT saved every 5 steps: its
    summary (``run_demo``'s dict; the runs under ``summary["out"]``). Shared by the end-to-end test and the
    report tests (one run of ~1 minute instead of one each)."""
    from trainguard.demo import DemoConfig, run_demo

    out = tmp_path_factory.mktemp("demo")
    # heartbeat timeout 10 s: a fault that waits for its save to commit before it fires (corrupt_newest,
    # silent_corruption) beats nothing meanwhile, and an fsync on a busy disk takes seconds
    cfg = DemoConfig(
        steps=60, failures=5, out=out, seed=1, save_every=5, heartbeat_timeout_s=10.0, train_args=TINY
    )
    return run_demo(cfg, echo=lambda m: None, progress=False)


# ``scripts/test`` runs the suite in two parts: everything not marked ``serial`` on pytest-xdist workers
# (``--part parallel``), then the ``serial`` tests alone in one process (``--part serial``). ``serial`` marks the
# tests that compare timing figures from two sources of one run (the demo run's goodput from the event log
# against its train log's compute seconds): another worker's tests beside that run shift one source more than
# the other (1 of 7 parallel suites here: 1.36x, where the check allows 1.3x).
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--part",
        choices=("all", "parallel", "serial"),
        default="all",
        help="run all tests (default), only those not marked serial, or only those marked serial",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    part = config.getoption("--part")
    if part == "all":
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for it in items:
        (keep if (it.get_closest_marker("serial") is not None) == (part == "serial") else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
