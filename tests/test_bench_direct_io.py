"""``benchmarks/bench_direct_io.py`` in a tiny run (real saves of every method, 10 MiB, one repetition, no
settle): every target comes out as PASS/MISS, every figure is there and the scratch files are removed. Speed
verdicts at this size mean nothing."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from trainguard.storage.local import direct_io_supported

from .conftest import run_benchmark

SCRIPT = "bench_direct_io.py"


@pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")
@pytest.mark.timeout(300)
def test_a_tiny_run_measures_every_method_in_both_conditions(tmp_path):
    if not direct_io_supported(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")
    args = ["--size-gib", "0.01", "--repeat", "1", "--settle-s", "0", "--dir", str(tmp_path)]

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return run_benchmark(SCRIPT, *args, *extra)

    p = run("--json")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert len(res["seconds"]) == 12 and all(len(v) == 1 and v[0] > 0 for v in res["seconds"].values())
    assert len(res["targets"]) == 4
    assert all(t["target"].startswith(("settled:", "direct_io")) for t in res["targets"])
    assert all(isinstance(t["pass"], bool) for t in res["targets"])
    assert list(tmp_path.iterdir()) == [], "scratch files were left behind"
    table = run()
    assert table.returncode == 0, table.stderr[-3000:]
    assert (
        "TARGETS (trainguard)" in table.stdout
        and table.stdout.count("PASS") + table.stdout.count("MISS") == 4
    )
