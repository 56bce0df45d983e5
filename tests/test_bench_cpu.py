"""``benchmarks/bench_cpu.py`` in a tiny run (16 MiB, one operation of each kind, one process per side, A/B
against this same checkout): every operation, the async save's included, is measured on both sides, the table
prints a ratio per operation, and the scratch roots are removed. CPU figures at this size mean nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import run_benchmark

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.mark.timeout(300)
def test_a_tiny_ab_run_measures_every_operation_on_both_sides(tmp_path: Path) -> None:
    args = ["--size-gib", "0.016", "--n", "1", "--dir", str(tmp_path), "--baseline-src", SRC]
    p = run_benchmark("bench_cpu.py", *args, "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    ops = ["changed", "unchanged", "async", "restore"]
    for side in ("baseline", "this"):
        (run,) = res["runs"][side]
        assert run["trainguard"].startswith(SRC)
        for op in ops:
            assert run[op]["cpu"] > 0 and run[op]["wall"] > 0, (side, op, run)
        assert set(res["median_cpu"][side]) == set(ops)
    p = run_benchmark("bench_cpu.py", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {ln.split()[0]: ln.split() for ln in p.stdout.splitlines()[2:]}
    assert set(rows) == set(ops) and all(r[-1].endswith("x") for r in rows.values()), p.stdout
    assert list(tmp_path.iterdir()) == [], "the scratch roots were not removed"
