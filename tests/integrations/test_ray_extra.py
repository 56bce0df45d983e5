"""The Ray integration is an extra: trainguard imports without Ray, and using the integration without it
names the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

WITHOUT_RAY = r"""
import sys
sys.modules["ray"] = None  # as if Ray were not installed: `import ray` raises ImportError
sys.modules["ray.train"] = None
import trainguard as tg
import trainguard.ray as tg_ray
mgr = tg.CheckpointManager(sys.argv[1])
try:
    tg_ray.report(mgr, 1, {"loss": 0.5})
except tg.MissingDependencyError as e:
    print("ERROR:", e)
"""


def test_trainguard_imports_without_ray_and_the_integration_names_the_extra(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, str(tmp_path / "root")],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "ERROR: trainguard.ray (Ray Train) needs the optional package 'ray'" in r.stdout
    assert "pip install 'trainguard[ray]'" in r.stdout


def test_the_committed_step_is_the_newest_published_manifest_and_ignores_partial_saves(tmp_path):
    import torch

    import trainguard as tg
    from trainguard.ray import committed_step

    assert committed_step(tmp_path / "missing") is None
    mgr = tg.CheckpointManager(tmp_path, async_save=False)
    assert committed_step(tmp_path) is None
    for step in (3, 12):
        mgr.save(step, {"w": torch.ones(2)})
    mgr.close()
    (tmp_path / "step-000000020.partial-abc").mkdir()
    (tmp_path / "step-000000030").mkdir()  # a step folder without a manifest is not committed
    assert committed_step(tmp_path) == 12
