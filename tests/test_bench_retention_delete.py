"""``benchmarks/bench_retention_delete.py`` in a tiny run (32 MiB, one round after the warm-up): both saves are
timed, the wait for the background deletion after each is measured apart, the target prints as PASS/MISS, and
the scratch roots are removed. Speed verdicts at this size mean nothing (that the deletion is off the save's
path is tested in tests/retention/test_background_collection.py)."""

from __future__ import annotations

import pytest

from .conftest import run_benchmark, run_sized_benchmark

SCRIPT = "bench_retention_delete.py"


@pytest.mark.timeout(300)
def test_a_tiny_run_times_both_saves_and_the_deletion_apart(tmp_path):
    p, res = run_sized_benchmark(SCRIPT, "0.03", tmp_path)
    assert res["tensors"] == 4 and res["bytes"] == 4 * (8 << 20)
    assert all(len(v) == 1 and v[0] > 0 for v in res["save_s"].values())
    assert all(len(v) == 1 and v[0] >= 0 for v in res["background_delete_s"].values())
    assert p.stdout.count("background deletion after it") == 2, p.stdout
    verdict = [ln for ln in p.stdout.splitlines() if ln.startswith(("PASS ", "MISS "))]
    assert len(verdict) == 1 and "deletes the previous checkpoint's chunks" in verdict[0], p.stdout
    assert list(tmp_path.iterdir()) == [tmp_path / "res.json"], "the scratch roots were not removed"


@pytest.mark.parametrize("args", [["--repeat", "0"], ["--size-gib", "0"]])
def test_bad_sizes_are_refused(args):
    p = run_benchmark(SCRIPT, *args, timeout=120)
    assert p.returncode == 2 and "--repeat must be >= 1 and --size-gib > 0" in p.stderr
