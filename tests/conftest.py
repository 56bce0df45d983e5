from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
