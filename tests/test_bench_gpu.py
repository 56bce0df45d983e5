"""``benchmarks/bench_gpu.py``: its logic runs on CPU (``--device cpu --tiny``) and every check it prints holds
where it does not depend on speed; without CUDA the default run skips cleanly (exit 0). On a CUDA machine the
``gpu`` test runs the full benchmark and requires its bit-exactness checks to pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO, run_env

SCRIPT = REPO / "benchmarks" / "bench_gpu.py"


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=run_env(),
        cwd=REPO,
    )


@pytest.mark.timeout(300)
def test_the_cpu_run_prints_every_target_and_restores_bit_exactly(tmp_path):
    out = tmp_path / "res.json"
    p = bench("--device", "cpu", "--tiny", "--json", str(out), "--scratch", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    verdicts = [ln for ln in p.stdout.splitlines() if ln.startswith(("PASS ", "MISS "))]
    targets = [ln.split(" ", 1)[1].split(":")[0] for ln in verdicts]
    assert targets[:4] == [
        "blocking stall <= 1.3x the copy floor",
        "staging buffers unpinned on CPU and <= 2 sets",
        "trainguard async overhead < 1%",
        "trainguard async overhead <= dcp.async_save's in the same run",
    ], verdicts
    exact = [ln for ln in verdicts if "bit-exact restore" in ln]
    assert len(exact) == 8 and all(ln.startswith("PASS") for ln in exact), exact
    assert verdicts[1].startswith("PASS"), verdicts[1]  # on CPU nothing is pinned, at most 2 sets
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["pinned_bytes"] == 0
    assert 0 < res["state_bytes"] <= res["staging_bytes"] <= 2 * res["state_bytes"]
    assert len(res["stalls_s"]) == 2 and res["copy_s"] > 0
    assert set(res["loop"]) >= {"tg_async", "dcp_async", "step_s", "segments_s"}
    assert len(res["loop"]["segments_s"]) == 2  # --tiny: 2 rounds after the warm-up
    assert list(tmp_path.iterdir()) == [out], "the scratch checkpoints were not removed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the gpu test runs instead")
def test_without_cuda_the_default_run_skips_with_exit_0():
    p = bench(timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("SKIP: no CUDA device"), p.stdout
    assert "PASS" not in p.stdout and "MISS" not in p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_full_run_restores_bit_exactly_and_pins_its_staging_buffers(tmp_path):
    out = tmp_path / "res.json"
    p = bench("--json", str(out), timeout=540)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert all(res["exact"].values()), res["exact"]
    assert res["pinned_bytes"] == res["staging_bytes"] > 0
