"""Fixtures of the fault-injection tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faultlib import ForkServer


@pytest.fixture(scope="session")
def forkserver() -> Iterator[ForkServer]:
    """One ``crash_worker.py serve`` process for the session (torch is imported once, victims are forked)."""
    fs = ForkServer()
    yield fs
    fs.close()
