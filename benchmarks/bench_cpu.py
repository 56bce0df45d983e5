"""CPU seconds of a durable save (every tensor changed, then unchanged) and of a restore, optionally A/B against
another checkout: CPU time, unlike wall time, stays meaningful on a shared machine.

Run (a minute or two per process at 1 GiB)::

    .venv/bin/python benchmarks/bench_cpu.py                                  # this checkout, 1 GiB, 3 of each
    .venv/bin/python benchmarks/bench_cpu.py --baseline-src /path/to/old/src --rounds 3

Each measurement runs in a fresh process (``--child``): it builds bench_save_load's transformer-like state,
saves it once with ``CheckpointManager(root, async_save=False, fsync=True)`` (untimed: imports and first
allocations), then times ``--n`` saves after changing one byte in every 4 KiB of every tensor (the change
itself included, identical on both sides), ``--n`` saves of the unchanged state (every chunk deduplicated),
``--n`` async saves of a changed state into another root (``CheckpointManager(root, fsync=True, keep=1)``, the
default ``async_save=True``: the staging copy in the calling thread, then the background persist, each save
waited for; its first save, which allocates the staging buffers, untimed) and ``--n`` restores in place. It
reports the median of the process CPU time (all threads, user + system, ``time.process_time``) and of the
wall time per operation. With ``--baseline-src`` the baseline (that directory first on ``PYTHONPATH``) and
this checkout alternate for ``--rounds`` rounds; the ratio column is this checkout's median CPU over the
baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPS = ("changed", "unchanged", "async", "restore")


def child(gib: float, n: int, scratch: str) -> dict[str, Any]:
    import torch
    from bench_save_load import make_state, perturb

    import trainguard

    root = Path(tempfile.mkdtemp(prefix="bench_cpu-", dir=scratch))
    aroot = root.with_name(root.name + "-async")
    sd = make_state(int(gib * (1 << 30)))
    out: dict[str, Any] = {"trainguard": str(Path(trainguard.__file__).parent)}
    step = 1
    try:
        with trainguard.CheckpointManager(root, async_save=False, fsync=True) as mgr:
            mgr.save(step, {"model": sd})

            def measure(name: str, fn: Any) -> None:
                cpu, wall = [], []
                for _ in range(n):
                    c0, w0 = time.process_time(), time.perf_counter()
                    fn()
                    wall.append(time.perf_counter() - w0)
                    cpu.append(time.process_time() - c0)
                out[name] = {"cpu": statistics.median(cpu), "wall": statistics.median(wall)}

            def changed() -> None:
                nonlocal step
                perturb(sd, 1)
                step += 1
                mgr.save(step, {"model": sd})

            def unchanged() -> None:
                nonlocal step
                step += 1
                mgr.save(step, {"model": sd})

            measure("changed", changed)
            measure("unchanged", unchanged)
        with trainguard.CheckpointManager(aroot, fsync=True, keep=1) as amgr:
            amgr.save(1, {"model": sd}).wait()  # untimed: the staging buffers are allocated
            astep = 1

            def async_changed() -> None:
                nonlocal astep
                perturb(sd, 1)
                astep += 1
                amgr.save(astep, {"model": sd}).wait()

            measure("async", async_changed)
        target = {"model": {k: torch.empty_like(v) for k, v in sd.items()}}
        measure("restore", lambda: trainguard.CheckpointManager(root, read_only=True).restore(step, target))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(aroot, ignore_errors=True)
    return out


def spawn(src: str | None, a: argparse.Namespace, scratch: str) -> dict[str, Any]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(Path(__file__)), "--child", "--size-gib", str(a.size_gib), "--n", str(a.n)]
    p = subprocess.run([*cmd, "--dir", scratch], env=env, stdout=subprocess.PIPE, text=True, cwd=HERE)
    if p.returncode != 0:
        raise RuntimeError(f"the measuring process exited with {p.returncode}")
    return json.loads(p.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--n", type=int, default=3, help="operations of each kind per process (median)")
    ap.add_argument("--rounds", type=int, default=1, help="processes per side (alternating with a baseline)")
    ap.add_argument("--baseline-src", default=None, help="a checkout's src/ directory to compare against")
    ap.add_argument("--dir", default=None, help="scratch parent directory")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    scratch = a.dir or tempfile.gettempdir()
    if a.child:
        print(json.dumps(child(a.size_gib, a.n, scratch)))
        return 0
    sides = {"this": None} if a.baseline_src is None else {"baseline": a.baseline_src, "this": None}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for side, src in sides.items():
            runs[side].append(spawn(src, a, scratch))
            print(f"round {r} {side}: {json.dumps(runs[side][-1])}", file=sys.stderr, flush=True)
    med = {s: {op: statistics.median(x[op]["cpu"] for x in rs) for op in OPS} for s, rs in runs.items()}
    if a.json:
        print(json.dumps({"runs": runs, "median_cpu": med}, indent=1))
        return 0
    print(
        f"# {a.size_gib:g} GiB state, median of {a.n} ops x {a.rounds} process(es) per side; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'operation':<10} "
        + " ".join(f"{s + ' CPU s':>14}" for s in sides)
        + ("  this/baseline" if len(sides) > 1 else "")
    )
    for op in OPS:
        cells = " ".join(f"{med[s][op]:>14.3f}" for s in sides)
        ratio = f"  {med['this'][op] / med['baseline'][op]:>13.2f}x" if len(sides) > 1 else ""
        print(f"{op:<10} {cells}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
