"""Writing CLI commands on a run root on a read-only filesystem: a clean error (exit 1 or 2), never a traceback.

Before the fix ``trainguard gc`` (dry run included) died with ``OSError: [Errno 30]`` from ``ROOT/.lock`` and
``trainguard mark --clear`` with the same error from ``suspect.json``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.validation.scrub import gc


@pytest.fixture
def ro_root(tmpfs) -> Path:
    """A run root with steps 1 and 2 (2 marked suspect) on a tmpfs remounted read-only (needs root)."""
    mnt = tmpfs("ro", "16m")
    with tg.CheckpointManager(mnt / "run", async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": {"t": torch.full((16,), float(step))}})
    assert CliRunner().invoke(cli, ["mark", str(mnt / "run"), "2", "--suspect", "test"]).exit_code == 0
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    return mnt / "run"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


def test_gc_on_a_read_only_root_says_it_needs_write_access_and_a_dry_run_works(ro_root):
    code, out = run("gc", str(ro_root))
    assert code == 1 and "read-only filesystem" in out and "needs write access" in out
    assert "Traceback" not in out
    code, out = run("gc", str(ro_root), "--dry-run")
    assert code == 0 and "would remove 0 quarantined and 0 orphan chunk(s)" in out
    with pytest.raises(tg.ConfigError, match="read-only filesystem"):
        gc(ro_root)


def test_mark_on_a_read_only_root_fails_cleanly(ro_root):
    code, out = run("mark", str(ro_root), "2", "--clear")
    assert code == 1 and "could not remove the marker" in out and "Read-only file system" in out
    code, out = run("mark", str(ro_root), "1", "--clear")
    assert code == 0 and "was not marked suspect" in out  # nothing to remove: no write attempted
    code, out = run("mark", str(ro_root), "1", "--suspect", "x")
    assert code == 1 and "could not write the marker" in out


def test_import_into_a_read_only_root_is_a_usage_error(ro_root, tmp_path):
    src = tmp_path / "w.pt"
    torch.save({"a": torch.ones(3)}, src)
    code, out = run("import", str(src), str(ro_root), "--format", "torch", "--step", "5")
    assert code == 2 and "read-only filesystem" in out
