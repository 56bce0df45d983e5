"""Running an integration's example training script as a subprocess, and reading the losses it logged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import run_env


def run_example(
    script: Path, root: Path, out: Path, steps: int, save_every: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (examples/train_*.py) to ``steps`` saving every ``save_every`` steps; its per-step losses go to
    ``out/losses.jsonl`` and its final state to ``out/final.pt``."""
    cmd = [sys.executable, str(script), "--root", str(root), "--steps", str(steps), "--save-every", str(save_every),
           "--losses", str(out / "losses.jsonl"), "--final", str(out / "final.pt"), *extra]  # fmt: skip
    env = run_env() | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def losses(out: Path) -> dict[int, str]:
    """Step -> loss (float.hex); a step redone after a resume keeps its last value."""
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}
