"""An export killed with SIGKILL mid-write leaves no output that looks finished (OUT never appears, only a
hidden ``.OUT.partial-*`` beside it), the run root is untouched, and the same export then succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from faultlib import sha256_file
from safetensors.torch import load_file

import trainguard as tg
from trainguard.interop import export


def test_an_export_killed_mid_write_leaves_no_output_and_the_next_export_succeeds(tmp_path: Path):
    root = tmp_path / "root"
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(12)}  # 12 x 256 KiB
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": weights}).wait()
    before = {p: sha256_file(p) for p in root.rglob("*") if p.is_file() and "events" not in p.parts}
    out = tmp_path / "out"
    code = textwrap.dedent(
        f"""
        import time
        from trainguard.interop import export
        # one file per tensor; a pause after each so the kill lands between files, mid-export
        export({str(root)!r}, {str(out)!r}, format="safetensors", max_shard_bytes=300_000,
               progress=lambda done, total: time.sleep(0.5))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 120
    partial: list[Path] = []
    while time.monotonic() < deadline:
        partial = [p for p in tmp_path.glob(".out.partial-*") if any(p.glob("*.safetensors"))]
        if partial or proc.poll() is not None:
            break
        time.sleep(0.05)
    assert partial, "the export never started writing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    assert not out.exists()  # nothing that looks like a finished export
    assert 1 <= len(list(partial[0].glob("*.safetensors"))) < 12
    after = {p: sha256_file(p) for p in root.rglob("*") if p.is_file() and "events" not in p.parts}
    assert after == before  # the run root is read, never written
    res = export(root, out, format="safetensors", max_shard_bytes=300_000)
    assert len(res.files) == 13  # 12 shards + index
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("model-*.safetensors")):
        merged.update(load_file(f))
    assert sorted(merged) == sorted(weights)
    assert all(torch.equal(merged[k], v) for k, v in weights.items())
