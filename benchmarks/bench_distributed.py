"""Distributed save and load of ~1 GiB of sharded state at 1, 2 and 4 ranks: trainguard beside ``dcp.save`` /
``dcp.load`` with ``FileSystemWriter``/``FileSystemReader`` defaults, side by side in one run.

Run (a few minutes on 2 cores; needs ~3x the state size free on the scratch filesystem)::

    .venv/bin/python benchmarks/bench_distributed.py                       # 1 GiB, ranks 1,2,4, best of 2
    .venv/bin/python benchmarks/bench_distributed.py --size-gib 0.25 --ranks 2 --repeat 1 --json

For each world size W the script launches ``torchrun --nproc-per-node W`` on itself (gloo, CPU). The total
state is the same at every W: a transformer-like layout (4 large matrices, layers of d=1024 with medium fp32/bf16
matrices and small vectors, 0-d scalars) whose every tensor of rank >= 1 is a DTensor sharded on dim 0 over
the W ranks, as FSDP2 shards parameters; 0-d tensors are replicated (plain tensors, saved once by both
libraries). Each rank materializes only its own shards.

Per repetition, in an order alternating between repetitions: ``dcp.save`` (FileSystemWriter defaults:
one file per rank, ``sync_files=True``, 1 thread) into a fresh directory, then ``dcp.load`` in place;
trainguard ``CheckpointManager(root, async_save=False).save`` into a fresh run root (fsync, CRC32C per chunk; a
fresh root because an unchanged tensor is never written twice into one root), then ``restore`` in place. The
manager is constructed outside the timed region (a training job constructs it once). Timed on rank 0 from a
barrier before the call to a barrier after it, so a figure is the whole collective operation. Before each
timed save the previous method's files (before the first one, an untimed primer file of the same size) are
deleted and ``sync`` flushes every dirty page; before each load the page cache is dropped when allowed (the
output says which). Every load is checked bitwise on every rank, outside the timed region. The figure is the
best (shortest) of ``--repeat`` repetitions, with the median beside it.

Warm-up: before the first repetition each method saves and loads once, untimed, into a directory that is then
deleted. DCP is imported at the top of each rank's process, outside every timed region, while trainguard
imports its save path's modules (blosc2 and its dependencies for the ``compression="auto"`` codec sample,
prometheus-client) in the first save of a process: 0.2-0.3 s of CPU per rank, paid once per process, which
without the warm-up landed in the first repetition's trainguard save only (1.5 s vs 0.6-0.9 s later at 4
ranks on 2 cores, 2026-12-03). ``--no-warmup`` restores the old protocol.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from _common import (
    TRANSFORMER_LAYER,
    cache_note,
    default_scratch_parent,
    drop_caches,
    dump_json,
    filesystem_of,
    format_table,
    gbps,
    log,
    machine_info,
    print_targets,
    raw_write_floor,
    remove_path,
    report_json,
)

REPO = Path(__file__).resolve().parent.parent
GiB = 1 << 30
METHODS = ("dcp", "trainguard")
LABELS = {
    "dcp": "dcp.save / dcp.load (FileSystemWriter/Reader defaults)",
    "trainguard": "trainguard save / restore (async_save=False)",
}


# -- the state --------------------------------------------------------------------------------------------------
def state_spec(total_bytes: int) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, global shape, dtype name)`` of a transformer-like state of at most ``total_bytes``.

    ~28% of the bytes in four large matrices, the rest in layers of d=1024 alternating fp32 and bf16 (4
    attention matrices, 3 MLP matrices, 13 small tensors); first dims are multiples of 4 so every tensor
    shards evenly over 1, 2 or 4 ranks.
    """
    import torch

    scale = total_bytes / (2 * GiB)
    spec: list[tuple[str, tuple[int, ...], str]] = []

    def nbytes(shape: tuple[int, ...], dtype: str) -> int:
        n = 1
        for s in shape:
            n *= s
        return n * getattr(torch, dtype).itemsize

    def rows(n: int) -> int:
        return max(4, int(n * scale) // 4 * 4)

    spec += [
        ("tok_embeddings.weight", (rows(32768), 2048), "float32"),
        ("output.weight", (rows(32768), 2048), "bfloat16"),
        ("vision_proj.weight", (rows(16384), 4096), "bfloat16"),
        ("pos_embeddings.weight", (rows(8192), 2048), "float32"),
    ]
    layer = TRANSFORMER_LAYER
    total = sum(nbytes(s, t) for _, s, t in spec)
    i = 0
    while True:
        dtype = "float32" if i % 2 == 0 else "bfloat16"
        size = sum(nbytes(s, dtype) for _, s in layer)
        if total + size > total_bytes:
            break
        spec += [(f"layers.{i}.{name}", shape, dtype) for name, shape in layer]
        total += size
        i += 1
    return spec


def spec_bytes(spec: list[tuple[str, tuple[int, ...], str]]) -> int:
    import torch

    total = 0
    for _, shape, dtype in spec:
        n = 1
        for s in shape:
            n *= s
        total += n * getattr(torch, dtype).itemsize
    return total


def build_state(spec: list[tuple[str, tuple[int, ...], str]], rank: int, ws: int) -> dict[str, Any]:
    """This rank's view of the state: DTensors sharded on dim 0 (only the local shard is materialized),
    0-d tensors replicated. Content is random, seeded by tensor and rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ws,))
    state: dict[str, Any] = {}
    for i, (name, shape, dtype) in enumerate(spec):
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(i * 1009 + rank)
        if not shape:
            state[name] = torch.randn((), generator=torch.Generator().manual_seed(i)).to(dt)
            continue
        local_shape = (shape[0] // ws, *shape[1:])
        local = torch.randn(local_shape, generator=g, dtype=torch.float32).to(dt)
        stride = torch.empty(shape, device="meta").stride()
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride
        )
    return state


def local_bytes(t: Any) -> Any:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.reshape(-1).view(__import__("torch").uint8)


def fresh_target(state: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, t in state.items():
        if isinstance(t, DTensor):
            out[k] = DTensor.from_local(
                torch.zeros_like(t.to_local()),
                t.device_mesh,
                t.placements,
                run_check=False,
                shape=t.shape,
                stride=t.stride(),
            )
        else:
            out[k] = torch.zeros_like(t)
    return out


def zero_(target: dict[str, Any]) -> None:
    for t in target.values():
        (
            t.to_local() if hasattr(t, "to_local") else t
        ).zero_()  # a load that does nothing must fail the check


def check_equal(method: str, got: dict[str, Any], want: dict[str, Any]) -> None:
    import torch

    for k, w in want.items():
        if not torch.equal(local_bytes(got[k]), local_bytes(w)):
            raise AssertionError(f"{method}: {k} differs from the saved tensor on this rank")


# -- one world size (run by torchrun on every rank) ---------------------------------------------------------------
def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import trainguard as tg

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    spec = state_spec(int(args.size_gib * GiB))
    state = build_state(spec, rank, ws)
    target = fresh_target(state)
    scratch = Path(args.dir)
    runs: list[dict[str, float]] = []
    cold = True
    prev: list[Path] = []

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    def free_previous() -> None:
        dist.barrier()
        for p in prev:
            if rank == 0 or p.name.startswith("primer-"):
                remove_path(p)
        dist.barrier()
        if rank == 0:
            os.sync()  # no earlier dirty page is flushed inside the next timed region
        dist.barrier()

    def uncache() -> bool:
        ok = drop_caches() if rank == 0 else True
        dist.barrier()
        return ok

    def save_and_load(method: str, path: Path) -> tuple[float, float]:
        """Seconds of ``method``'s save of the state into ``path``, then of its load in place (cold when the
        page cache can be dropped); the load is checked bitwise."""
        nonlocal cold
        if method == "dcp":
            save_s = timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path))))
            zero_(target)
            cold &= uncache()
            load_s = timed(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(str(path))))
        else:
            with tg.CheckpointManager(path, async_save=False) as mgr:
                save_s = timed(lambda: mgr.save(1, {"model": state}))
            zero_(target)
            cold &= uncache()
            with tg.CheckpointManager(path, read_only=True) as reader:
                load_s = timed(lambda: reader.restore(1, {"model": target}))
        check_equal(method, target, state)
        return save_s, load_s

    if args.warmup:  # each method's one-time costs (imports, first calls) outside the timed repetitions
        for method in METHODS:
            path = scratch / f"warmup-{method}"
            save_and_load(method, path)
            dist.barrier()
            if rank == 0:
                remove_path(path)
            dist.barrier()
    # Every timed save starts right after ~the state's size was freed (on these VMs a write right after a
    # deletion can run several times faster than one into other free space): before the first one, this
    # untimed primer of every rank's shard bytes is what gets freed.
    primer = scratch / f"primer-{rank}.bin"
    raw_write_floor((memoryview(local_bytes(t).numpy()) for t in state.values()), primer)
    prev.append(primer)
    for rep in range(args.repeat):
        r: dict[str, float] = {}
        order = METHODS if rep % 2 == 0 else METHODS[::-1]
        for method in order:
            path = scratch / f"{method}-{rep}"
            free_previous()
            r[f"{method}_save"], r[f"{method}_load"] = save_and_load(method, path)
            prev[:] = [path]
            if rank == 0:
                log(
                    f"  W={ws} rep {rep}: {method:<10} save {r[method + '_save']:6.2f} s  "
                    f"load {r[method + '_load']:6.2f} s"
                )
        runs.append(r)
    free_previous()
    if rank == 0:
        Path(args.out).write_text(
            json.dumps({"world_size": ws, "runs": runs, "loads_cold": cold, "state_bytes": spec_bytes(spec)})
        )
    dist.destroy_process_group()
    return 0


# -- the driver ---------------------------------------------------------------------------------------------------
def torchrun(nprocs: int, argv: list[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd = [
        *launcher,
        "--nproc-per-node",
        str(nprocs),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        __file__,
        *argv,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nprocs)))
    subprocess.run(cmd, check=True, env=env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="total state size in GiB (default 1)")
    ap.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    ap.add_argument(
        "--repeat", type=int, default=3, help="repetitions; the best (shortest) and median times are reported"
    )
    ap.add_argument("--dir", type=Path, default=None, help="scratch parent directory")
    ap.add_argument("--json", action="store_true", help="print machine-readable results instead of the table")
    ap.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="no untimed save and load per method before the repetitions (one-time costs land in the first)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    ranks = [int(x) for x in args.ranks.split(",")]
    if args.repeat < 1 or args.size_gib <= 0 or any(w < 1 for w in ranks):
        ap.error("--repeat and --ranks must be >= 1 and --size-gib > 0")
    parent = args.dir or default_scratch_parent(REPO)
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench_distributed-", dir=parent))
    log(f"scratch: {scratch} ({filesystem_of(scratch)})")
    load_start = os.getloadavg()[0]
    results: dict[int, dict[str, Any]] = {}
    try:
        for w in ranks:
            out = scratch / f"result-{w}.json"
            work = scratch / f"w{w}"
            work.mkdir()
            torchrun(
                w,
                [
                    "--worker",
                    "--size-gib",
                    str(args.size_gib),
                    "--repeat",
                    str(args.repeat),
                    "--dir",
                    str(work),
                    "--out",
                    str(out),
                    *([] if args.warmup else ["--no-warmup"]),
                ],
            )
            results[w] = json.loads(out.read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows = []
    verdicts = []
    cold = all(r["loads_cold"] for r in results.values())
    for w, res in results.items():
        nbytes = res["state_bytes"]
        best = {k: min(run[k] for run in res["runs"]) for k in res["runs"][0]}
        median = {k: statistics.median(run[k] for run in res["runs"]) for k in res["runs"][0]}
        for m in METHODS:
            rows.append(
                {
                    "ranks": str(w),
                    "method": LABELS[m],
                    "save_s": best[f"{m}_save"],
                    "save_gbs": gbps(nbytes, best[f"{m}_save"]),
                    "save_med_s": median[f"{m}_save"],
                    "load_s": best[f"{m}_load"],
                    "load_gbs": gbps(nbytes, best[f"{m}_load"]),
                    "load_med_s": median[f"{m}_load"],
                }
            )
        for op in ("save", "load"):
            tg_s, dcp_s = best[f"trainguard_{op}"], best[f"dcp_{op}"]
            verdicts.append(
                (f"{w} rank(s): {op} no slower than DCP", tg_s <= dcp_s, f"{tg_s:.2f} s vs {dcp_s:.2f} s")
            )
    nbytes = next(iter(results.values()))["state_bytes"]
    if args.json:
        report = report_json(
            load_start=load_start,
            scratch=parent,
            nbytes=nbytes,
            repeat=args.repeat,
            cold=cold,
            verdicts=verdicts,
        )
        report["rows"] = rows
        report["runs"] = {str(w): r["runs"] for w, r in results.items()}
        dump_json(report)
        return 0
    info = machine_info()
    print(
        f"# {info['date']}  {info.get('cpu', '?')} x{info['nproc']}, {info.get('mem_gib', '?')} GiB, "
        f"python {info['python']}, scratch on {filesystem_of(parent)}; load average {load_start:.1f} at start"
    )
    print(f"# state: {nbytes / GiB:.2f} GiB ({nbytes} B) in total at every world size, sharded on dim 0")
    print(
        f"# best of {args.repeat} (median beside it); GB/s = 10^9 bytes of tensor data per second, all ranks"
        " together; targets compare the best times"
    )
    print(f"# {cache_note(cold)}\n")
    print(
        format_table(
            rows,
            [
                ("method", "method", ""),
                ("ranks", "ranks", ""),
                ("save_s", "save s", ".2f"),
                ("save_gbs", "save GB/s", ".3f"),
                ("save_med_s", "(median s)", ".2f"),
                ("load_s", "load s", ".2f"),
                ("load_gbs", "load GB/s", ".3f"),
                ("load_med_s", "(median s)", ".2f"),
            ],
        )
    )
    print_targets(verdicts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
