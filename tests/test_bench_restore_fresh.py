"""``benchmarks/bench_restore_fresh.py`` in a tiny run (one 64 MiB tensor, one round after the warm-up): every
combination is timed and checked bit for bit, the ratios print as PASS/MISS (new tensors) and info (touched, and the cost of verify_before_load),
and the scratch root is removed. Speed verdicts at this size mean nothing (that the populate runs only for
fresh memory is tested in tests/test_restore_fresh_memory.py)."""

from __future__ import annotations

import pytest

from .conftest import run_benchmark, run_sized_benchmark

SCRIPT = "bench_restore_fresh.py"


@pytest.mark.timeout(300)
def test_a_tiny_run_times_every_combination(tmp_path):
    p, res = run_sized_benchmark(SCRIPT, "0.01", tmp_path)
    assert res["tensors"] == 1 and res["bytes"] == 64 << 20
    assert len(res["seconds"]) == 8 and all(len(v) == 1 and v[0] > 0 for v in res["seconds"].values())
    lines = p.stdout.splitlines()
    assert sum(ln.startswith(("PASS ", "MISS ")) for ln in lines) == 2, p.stdout
    assert sum(ln.startswith("info ") for ln in lines) == 4, p.stdout
    assert set(res["verify_cost"]) == {"new", "touched"} and all(x > 0 for x in res["verify_cost"].values())
    assert list(tmp_path.iterdir()) == [tmp_path / "res.json"], "the scratch root was not removed"


def test_bad_sizes_are_refused():
    p = run_benchmark(SCRIPT, "--repeat", "0", timeout=60)
    assert p.returncode == 2 and "--repeat must be >= 1" in p.stderr
