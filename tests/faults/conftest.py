"""Fixtures of the fault-injection tests."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultlib import ForkServer


@pytest.fixture(scope="session")
def forkserver() -> Iterator[ForkServer]:
    """One ``crash_worker.py serve`` process for the session (torch is imported once, victims are forked)."""
    fs = ForkServer()
    yield fs
    fs.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``tmpfs(name, size)`` mounts a tmpfs of ``size`` (``"4m"``) on the new directory ``tmp_path/name`` and
    returns it; every mount is unmounted lazily at teardown (a stale mount never blocks pytest's cleanup). Skips
    the test where mount(8) is missing or refused (mounting needs root)."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        cmd = shutil.which("mount")
        if cmd is None:
            pytest.skip("no mount(8) on this machine")
        if subprocess.run(
            [cmd, "-t", "tmpfs", "-o", f"size={size}", "none", str(mnt)], check=False
        ).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        subprocess.run(["umount", "-l", str(mnt)], check=False)
