"""A durable save on a node that has been busy for a while since its last save, through the page cache and
around it (``direct_io``): trainguard beside torch.save, DCP and the raw disk, side by side in one run.

Run (about 10 minutes with the defaults: every "settled" save waits ``--settle-s`` first; root lets it drop
the page cache between methods)::

    .venv/bin/python benchmarks/bench_direct_io.py                        # 1 GiB, 3 repetitions, 20 s settle
    .venv/bin/python benchmarks/bench_direct_io.py --size-gib 0.5 --repeat 2 --settle-s 10 --json

Why: a buffered write must first get page-cache memory for its bytes. On a VM whose balloon reports free
pages to the host (``/sys/module/page_reporting``; Firecracker, cloud-hypervisor, QEMU with
``free-page-reporting``), memory freed some seconds ago has been handed back to the host, and touching it
again costs a host page fault per page: on the 2-core VM of RESULTS.md a buffered write of 1 GiB took 8-11 s
(7-9 s of system CPU) 30 s after the memory was freed, 0.26 s right after. A training job saves every few
minutes, so its saves meet that state; the other benchmarks free state-size bytes right before each timed
save, which hides it. ``direct_io`` (the default) writes chunk files with ``O_DIRECT`` from a reused aligned
buffer per writing thread: no page-cache memory is allocated.

Each method saves the same state (``bench_save_load.make_state``: a transformer-like mix of fp32/bf16
tensors) durably, in two conditions:

- ``fresh``: right after an untimed state-size file, written through the page cache, was deleted: the page
  cache gets the memory just freed (the protocol of bench_save_load and bench_distributed; a direct save
  leaves nothing cached to free, so the previous method's files cannot serve);
- ``settled``: the same, then ``--settle-s`` seconds of waiting (the page cache dropped first when allowed),
  as between two saves of a training job.

Methods: raw ``os.write`` + fsync of one file (buffered), the same with ``O_DIRECT`` from one aligned 8 MiB
buffer, torch.save + fsync, dcp.save (FileSystemWriter defaults, ``no_dist``), trainguard
``CheckpointManager(async_save=False)`` with ``direct_io=True`` (default) and ``direct_io=False``, a fresh root
per save. The order rotates per repetition. Each figure is the median over repetitions (spread beside it),
with the system CPU seconds of the save (``os.times``: the process's, so every thread's).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import (
    default_scratch_parent,
    drop_caches,
    dump_json,
    format_table,
    log,
    machine_info,
    print_targets,
    raw_write_floor,
    remove_path,
)
from bench_save_load import byte_views, make_state, save_dcp, save_torch

import trainguard
from trainguard.storage.local import direct_io_supported

REPO = Path(__file__).resolve().parent.parent
BLOCK = 8 << 20
METHODS = [
    "raw write + fsync (page cache)",
    "raw write + fsync (O_DIRECT)",
    "torch.save + fsync",
    "dcp.save",
    "trainguard save (direct_io=True, default)",
    "trainguard save (direct_io=False)",
]
TG, TG_BUFFERED = METHODS[4], METHODS[5]
CONDITIONS = ("fresh", "settled")


def raw_direct(buffers: list[memoryview], path: Path) -> None:
    """``buffers`` written in order to a new file with ``O_DIRECT`` through one aligned 8 MiB buffer (the last
    block padded, then the file cut back), fsynced with its directory: the floor of a direct save."""
    mem = mmap.mmap(-1, BLOCK)
    arr = np.frombuffer(mem, dtype=np.uint8)
    view = memoryview(mem)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    total = fill = 0
    try:
        for buf in buffers:
            src = np.frombuffer(buf, dtype=np.uint8)
            pos = 0
            while pos < len(src):
                n = min(BLOCK - fill, len(src) - pos)
                np.copyto(arr[fill : fill + n], src[pos : pos + n])
                fill, pos = fill + n, pos + n
                if fill == BLOCK:
                    os.write(fd, view)
                    total, fill = total + BLOCK, 0
        if fill:
            padded = -(-fill // 4096) * 4096
            arr[fill:padded] = 0
            os.write(fd, view[:padded])
            os.ftruncate(fd, total + fill)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_tg(sd: dict[str, torch.Tensor], path: Path, direct_io: bool) -> None:
    with trainguard.CheckpointManager(path, async_save=False, direct_io=direct_io) as mgr:
        mgr.save(1, {"model": sd})


def run(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    sd = make_state(int(args.size_gib * (1 << 30)))
    nbytes = sum(t.nbytes for t in sd.values())
    views = byte_views(sd)
    fns = {
        METHODS[0]: lambda p: raw_write_floor(views, p),
        METHODS[1]: lambda p: raw_direct(views, p),
        METHODS[2]: lambda p: save_torch(sd, p),
        METHODS[3]: lambda p: save_dcp(sd, p),
        TG: lambda p: save_tg(sd, p, True),
        TG_BUFFERED: lambda p: save_tg(sd, p, False),
    }
    for fn in fns.values():  # imports and first calls outside the timed saves
        p = scratch / "warmup"
        fn(p)
        remove_path(p)
    seconds: dict[tuple[str, str], list[float]] = {(m, c): [] for m in METHODS for c in CONDITIONS}
    system: dict[tuple[str, str], list[float]] = {(m, c): [] for m in METHODS for c in CONDITIONS}
    cold = True
    prev = scratch / "none"
    ballast = scratch / "ballast.bin"
    for rep in range(args.repeat):
        k = rep % len(METHODS)
        for method in METHODS[k:] + METHODS[:k]:
            for cond in CONDITIONS:
                remove_path(prev)
                if cond == "fresh":  # state-size bytes cached, freed right before the save
                    raw_write_floor(views, ballast)
                    remove_path(ballast)
                os.sync()
                if cond == "settled":
                    cold &= drop_caches()
                    time.sleep(args.settle_s)
                path = scratch / f"{rep}-{cond}-{METHODS.index(method)}"
                c0, t0 = os.times(), time.perf_counter()
                fns[method](path)
                dt, c1 = time.perf_counter() - t0, os.times()
                seconds[(method, cond)].append(dt)
                system[(method, cond)].append(c1.system - c0.system)
                log(
                    f"  rep {rep} {cond:<7} {method:<42} {dt:6.2f} s  system CPU {c1.system - c0.system:5.2f} s"
                )
                prev = path
    remove_path(prev)
    return {
        "state_bytes": nbytes,
        "seconds": {f"{m} | {c}": v for (m, c), v in seconds.items()},
        "system_cpu_s": {f"{m} | {c}": v for (m, c), v in system.items()},
        "page_cache_dropped": cold,
    }


def verdicts(res: dict[str, Any]) -> list[tuple[str, bool, str]]:
    med = {k: statistics.median(v) for k, v in res["seconds"].items()}
    tg_s, tg_f = med[f"{TG} | settled"], med[f"{TG} | fresh"]
    peers = min(med[f"{m} | settled"] for m in (METHODS[2], METHODS[3]))
    buffered_s = med[f"{TG_BUFFERED} | settled"]
    raw_direct_s = med[f"{METHODS[1]} | settled"]
    return [
        (
            "settled: trainguard save (direct_io) faster than torch.save and dcp.save",
            tg_s < peers,
            f"{tg_s:.2f} s vs {peers:.2f} s (ratio {tg_s / peers:.2f})",
        ),
        (
            "settled: direct_io faster than the same save through the page cache",
            tg_s < buffered_s,
            f"{tg_s:.2f} s vs {buffered_s:.2f} s (ratio {tg_s / buffered_s:.2f})",
        ),
        (
            "settled: trainguard save (direct_io) <= 1.25x the raw O_DIRECT write",
            tg_s <= 1.25 * raw_direct_s,
            f"{tg_s:.2f} s vs {raw_direct_s:.2f} s (ratio {tg_s / raw_direct_s:.2f})",
        ),
        (
            "direct_io settled <= 1.5x direct_io fresh (the node's memory state does not matter)",
            tg_s <= 1.5 * tg_f,
            f"{tg_s:.2f} s vs {tg_f:.2f} s (ratio {tg_s / tg_f:.2f})",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions (median and spread; default 3)")
    ap.add_argument("--settle-s", type=float, default=20.0, help="seconds waited before a settled save (20)")
    ap.add_argument(
        "--dir", type=Path, default=None, help="scratch parent directory (on the disk to measure)"
    )
    ap.add_argument("--json", action="store_true", help="print machine-readable results instead of the table")
    args = ap.parse_args(argv)
    if not getattr(os, "O_DIRECT", 0):
        print("bench_direct_io: this platform has no O_DIRECT; nothing to measure", file=sys.stderr)
        return 0
    parent = args.dir or default_scratch_parent(REPO)
    scratch = Path(tempfile.mkdtemp(prefix="tg-direct-", dir=parent))
    try:
        if not direct_io_supported(scratch):
            print(
                f"bench_direct_io: the filesystem of {scratch} refuses O_DIRECT; nothing to measure",
                file=sys.stderr,
            )
            return 0
        res = run(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["machine"] = machine_info()
    res["args"] = {k: str(v) for k, v in vars(args).items()}
    res["reporting"] = _page_reporting()
    found = verdicts(res)
    if args.json:
        res["targets"] = [{"target": n, "pass": ok, "detail": d} for n, ok, d in found]
        dump_json(res)
        return 0
    rows = []
    for m in METHODS:
        row: dict[str, Any] = {"method": m}
        for c in CONDITIONS:
            v = res["seconds"][f"{m} | {c}"]
            row[c] = f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"
            row[f"{c} sys"] = f"{statistics.median(res['system_cpu_s'][f'{m} | {c}']):.2f}"
        rows.append(row)
    print(f"# {res['machine']}")
    print(
        f"# state {res['state_bytes']} B; median (min-max) of {args.repeat} s; settle {args.settle_s} s; "
        f"page cache {'dropped' if res['page_cache_dropped'] else 'NOT dropped'} before settled saves; "
        f"free page reporting: {res['reporting']}"
    )
    cols = [("method", "method", "<"), ("fresh", "fresh s", ">"), ("fresh sys", "sys CPU s", ">")]
    cols += [("settled", "settled s", ">"), ("settled sys", "sys CPU s", ">")]
    print(format_table(rows, cols))
    print_targets(found)
    return 0


def _page_reporting() -> str:
    """Whether this kernel reports free pages to a hypervisor, with the KiB reported so far."""
    p = Path("/sys/module/page_reporting/parameters/reported_kib")
    try:
        return f"on ({int(p.read_text())} KiB reported since boot)"
    except (OSError, ValueError):
        return "not found (no /sys/module/page_reporting)"


if __name__ == "__main__":
    raise SystemExit(main())
