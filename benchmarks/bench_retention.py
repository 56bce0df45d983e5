"""Retention's cost per save as a run root fills up: 10 vs 200 checkpoints in one root (issue 9).

Run (about 1-3 minutes on 2 cores; the code before the fix takes longer to fill the root)::

    .venv/bin/python benchmarks/bench_retention.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/bench_retention.py   # another version

For each policy (``keep=None``: keep all, the default; ``KeepEvery(1)``: a policy that also keeps every
checkpoint but is not recognised as keep-all) and each size N, a root is filled with N checkpoints of a small
state (one 64 KiB tensor changing every step, stored as 16 chunks of 4 KiB), then ``--saves`` more saves are
made and the retention pass the manager runs after each commit (``trainguard.retention.apply.apply_retention``)
is timed on its own, right after each save, as is the save itself (which ran one such pass). Medians per save
are reported; the target is that a save's cost stays flat as the root fills up: ``save(200) / save(10) <= 1.5``
(before issue 9 every pass parsed every manifest and stat'ed every chunk: O(checkpoints x chunks) per save; the
retention pass alone is now a few list and set operations over the step numbers, microseconds, so its own
ratio measures Python's constant factors, not a scan). Saves are synchronous and not fsynced (``fsync=False``): only retention's
own work is of interest here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import dump_json, log, machine_info  # noqa: E402

import trainguard as tg  # noqa: E402
from trainguard.retention import KeepEvery  # noqa: E402
from trainguard.retention.apply import apply_retention  # noqa: E402

TARGET_RATIO = 1.5


def state_at(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16384, generator=g)}  # 64 KiB of float32: 16 chunks of 4 KiB


def per_save_cost(root: Path, n: int, keep: object, saves: int) -> tuple[float, float]:
    """Median seconds of one retention pass after a save, and of one whole save (its own retention pass
    included), with ``n`` checkpoints in the root."""
    with tg.CheckpointManager(
        root, keep=keep, async_save=False, fsync=False, chunk_size_bytes=4096, save_policy=tg.EveryNSteps(1)
    ) as mgr:
        for s in range(1, n + 1):
            mgr.save(s, state_at(s))
        times, save_times = [], []
        for s in range(n + 1, n + saves + 1):
            state = state_at(s)
            t0 = time.perf_counter()
            mgr.save(s, state)  # runs retention once (the production path)
            t1 = time.perf_counter()
            apply_retention(getattr(mgr, "ctx", mgr))  # the same pass again, timed alone (older: the manager)
            times.append(time.perf_counter() - t1)
            save_times.append(t1 - t0)
    return statistics.median(times), statistics.median(save_times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs=2, default=[10, 200], metavar=("SMALL", "LARGE"))
    ap.add_argument("--saves", type=int, default=15, help="timed saves per size")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    small, large = args.sizes
    info = machine_info()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-retention-") as tmp:
        for name, keep in (("keep=None (keep all)", None), ("KeepEvery(1)", KeepEvery(1))):
            cost, save = {}, {}
            for n in (small, large):
                log(f"{name}: filling a root with {n} checkpoints ...")
                cost[n], save[n] = per_save_cost(Path(tmp) / f"{n}-{len(rows)}", n, keep, args.saves)
            ratio = save[large] / max(save[small], 1e-9)
            rows.append(
                {
                    "policy": name,
                    f"retention_ms_{small}": round(cost[small] * 1e3, 3),
                    f"retention_ms_{large}": round(cost[large] * 1e3, 3),
                    f"save_ms_{small}": round(save[small] * 1e3, 2),
                    f"save_ms_{large}": round(save[large] * 1e3, 2),
                    "ratio": round(ratio, 2),
                    "met": ratio <= TARGET_RATIO,
                }
            )
    if args.json:
        dump_json({"machine": info, "trainguard": tg.__file__, "rows": rows})
        return
    print(f"# {info['date']}  {info.get('cpu', '?')} x{info['nproc']}, load average {info['loadavg_1m']}")
    print(f"# trainguard from {Path(tg.__file__).parent}")
    print(
        f"# medians of {args.saves} saves; 16 chunks per checkpoint; ratio = save ms at {large} / at {small}"
    )
    print(f"{'policy':<22} {'retention ms':>22} {'save ms (incl. retention)':>28}  ratio")
    print(
        f"{'':<22} {f'{small} ckpts':>10} {f'{large} ckpts':>11} {f'{small} ckpts':>14} {f'{large} ckpts':>13}"
    )
    for r in rows:
        print(
            f"{r['policy']:<22} {r[f'retention_ms_{small}']:>10.3f} {r[f'retention_ms_{large}']:>11.3f}"
            f" {r[f'save_ms_{small}']:>14.2f} {r[f'save_ms_{large}']:>13.2f}  {r['ratio']:>5.2f}"
        )
    print("\nTARGETS (trainguard)")
    for r in rows:
        verdict = "PASS" if r["met"] else "MISS"
        print(
            f"  {verdict}  cost of a save with its retention pass flat ({r['policy']}): save ms {large}/{small} "
            f"= {r['ratio']:.2f} (target <= {TARGET_RATIO}); retention pass alone at {large}: "
            f"{r[f'retention_ms_{large}']:.3f} ms"
        )


if __name__ == "__main__":
    main()
