"""The layering contracts (.importlinter, run by `lint-imports` in ./scripts/test) hold, and a forbidden import
breaks them: proved on a copy of the package with one bad import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (dev extra)")


def lint(src: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cache = tmp_path / "cache"
    return subprocess.run(
        [str(LINT), "--config", str(REPO / ".importlinter"), "--cache-dir", str(cache)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_contracts_hold_on_the_package(tmp_path: Path) -> None:
    result = lint(REPO / "src", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" in result.stdout and " 0 broken" in result.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(
        REPO / "src" / "trainguard", src / "trainguard", ignore=shutil.ignore_patterns("__pycache__")
    )
    bad = src / "trainguard" / "storage" / "base.py"
    bad.write_text(
        bad.read_text() + "\nfrom ..catalog import scan  # noqa: E402 - the deliberate bad import\n"
    )
    result = lint(src, tmp_path)
    assert result.returncode != 0
    assert "storage only moves bytes" in result.stdout and "BROKEN" in result.stdout
    assert "trainguard.storage.base -> trainguard.catalog" in result.stdout


def test_validation_reaching_back_to_the_manager_breaks_a_contract(tmp_path: Path) -> None:
    """Validation gets what it uses explicitly; a back-reference to the manager (even for a type hint) fails."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO / "src" / "trainguard", src / "trainguard", ignore=shutil.ignore_patterns("__pycache__")
    )
    bad = src / "trainguard" / "validation" / "attach.py"
    bad.write_text(
        bad.read_text() + "\nfrom .._persist import persist  # noqa: E402 - the deliberate bad import\n"
    )
    result = lint(src, tmp_path)
    assert result.returncode != 0
    assert "validation and tiers receive what they use" in result.stdout and "BROKEN" in result.stdout
