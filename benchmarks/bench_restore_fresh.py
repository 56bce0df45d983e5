"""A restore into new, never-written tensors (a relaunched job's ``torch.empty``) with and without mapping each
block's pages first (``madvise(MADV_POPULATE_WRITE)``, ``trainguard._prefault``), and into touched tensors,
side by side in one process.

Run (about 1 minute on 2 cores at the defaults)::

    .venv/bin/python benchmarks/bench_restore_fresh.py
    .venv/bin/python benchmarks/bench_restore_fresh.py --size-gib 1 --repeat 6 --json out.json

Protocol: one checkpoint of ``--size-gib`` (at least 64 MiB) in fp32 tensors of 64 MiB (each above glibc's mmap threshold, so a
new one is fresh memory), saved once; its chunk files are read once so that every restore reads the page cache
(what a relaunch finds after the supervisor's prefetch). Each round restores with a read-only manager, for
each of ``verify_before_load`` True (the default) and False, into new ``torch.empty`` tensors with the
populate on and off (``ChunkStore.readinto``'s call replaced by a no-op: the ``mincore`` check still runs),
and into tensors written just before (``zeros``: the populate is never called there). The order of on/off
alternates per round. Medians over ``--repeat`` rounds; the timed region is ``restore()`` alone.

Target (info, no issue target): into new tensors, the populate's restore <= 0.9x the plain one; into touched
tensors, on and off within the noise (the ``mincore`` check is one system call per chunk). Beside it (info):
the default ``verify_before_load=True`` over ``False``, populate on. Into new tensors the check before the load
skips the chunks whose destination was never written (read once, checked as they load), so that ratio is
about 1; into touched tensors it is the cost of the second read.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import sized_run_main  # noqa: E402

import trainguard as tg  # noqa: E402
import trainguard.incremental.chunkstore as chunkstore  # noqa: E402

TENSOR_ELEMS = 16 << 20  # 64 MiB of float32
TARGET_X = 0.9


def warm(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 << 20):
                    pass


def run(size_gib: float, repeat: int, scratch: Path) -> dict[str, Any]:
    n = max(1, int(size_gib * (1 << 30)) // (TENSOR_ELEMS * 4))  # at least one 64 MiB tensor
    elems = TENSOR_ELEMS
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(elems, generator=g) for i in range(n)}
    root = scratch / "root"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"m": state})
    warm(root)
    real = chunkstore.populate_for_write

    def restore(populate: bool, verify: bool, fresh: bool) -> float:
        chunkstore.populate_for_write = real if populate else (lambda view: False)
        try:
            live = {k: torch.empty(elems) if fresh else torch.zeros(elems) for k in state}
            t0 = time.perf_counter()
            tg.CheckpointManager(root, read_only=True, verify_before_load=verify).restore(1, {"m": live})
            dt = time.perf_counter() - t0
        finally:
            chunkstore.populate_for_write = real
        if not all(torch.equal(live[k].view(torch.int32), state[k].view(torch.int32)) for k in state):
            raise AssertionError("the restore is not bit-exact")
        return dt

    times: dict[str, list[float]] = {}
    for r in range(repeat + 1):  # round 0: warm-up, not recorded
        for verify in (True, False):
            for fresh in (True, False):
                for populate in (True, False) if r % 2 else (False, True):
                    dt = restore(populate, verify, fresh)
                    if r:
                        key = f"{'new' if fresh else 'touched'} verify={verify} populate={'on' if populate else 'off'}"
                        times.setdefault(key, []).append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        f"{dest} verify={verify}": med[f"{dest} verify={verify} populate=on"]
        / med[f"{dest} verify={verify} populate=off"]
        for dest in ("new", "touched")
        for verify in (True, False)
    }
    verify_cost = {
        dest: med[f"{dest} verify=True populate=on"] / med[f"{dest} verify=False populate=on"]
        for dest in ("new", "touched")
    }
    return {
        "bytes": n * elems * 4,
        "tensors": n,
        "repeat": repeat,
        "seconds": times,
        "median_s": med,
        "ratio": ratios,
        "verify_cost": verify_cost,
    }


def main() -> None:
    res, _ = sized_run_main(
        __doc__,
        run,
        default_size_gib=1.0,
        size_help="checkpoint size in GiB (default 1)",
        scratch_help="parent folder of the run root (default: the temp folder)",
        prefix="bench-restore-fresh-",
    )
    print(
        f"# {res['bytes'] / 2**30:.2f} GiB in {res['tensors']} tensors, page cache warm; medians of {res['repeat']} rounds"
    )
    for key, v in res["seconds"].items():
        print(f"{key:<40} {res['median_s'][key]:.3f} s ({min(v):.3f}-{max(v):.3f})")
    print()
    for key, x in res["ratio"].items():
        if key.startswith("new"):
            verdict = "PASS" if x <= TARGET_X else "MISS"
            print(f"{verdict}  restore into {key}: populate on / off {x:.2f}x (target <= {TARGET_X}x)")
        else:
            print(f"info  restore into {key}: populate on / off {x:.2f}x (never called there)")
    for dest, x in res["verify_cost"].items():
        why = "the pass skips never-written memory" if dest == "new" else "the second read"
        print(f"info  restore into {dest}: verify_before_load True / False {x:.2f}x ({why})")


if __name__ == "__main__":
    main()
