from __future__ import annotations

import os
import signal
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


@pytest.fixture
def python() -> str:
    return sys.executable
