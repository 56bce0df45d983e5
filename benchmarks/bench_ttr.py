"""Time to resume (TTR) after a SIGKILL, for ~100 MB and ~1 GB states, phase by phase, beside this machine's floor.

Run (2-3 minutes on 2 cores; root lets it drop the page cache, otherwise it says so)::

    .venv/bin/python benchmarks/bench_ttr.py                        # 100 MB and 1 GB, cold and warm, 2 repeats
    .venv/bin/python benchmarks/bench_ttr.py --sizes-mb 100 --cache cold --repeat 3 --json

Each run writes a tiny training job (a dict of tensors of up to 64 MB each, a trivial step that touches every
tensor) and runs it under the recovery supervisor (``trainguard.recovery.supervisor.Supervisor``, backoff 0 s)
with a fresh run root. Attempt 0 trains, checkpoints at step ``--save-step`` through
``CheckpointManager.maybe_save`` and waits for that save to commit, takes two more steps, then waits for the
benchmark's go and SIGKILLs itself. The supervisor relaunches it; attempt 1 builds the same (uninitialized)
tensors, calls ``restore_latest`` and trains on. TTR is the supervisor's figure: the failed attempt's death to
the first step completed after the restore, with its phases (detection, teardown, backoff, relaunch = spawn to
``CheckpointManager`` ready, identification = scan, load, validation, first step).

The floor is measured in the same run and the same cache condition:

- process start + imports: spawn of ``python -c "import torch, trainguard; from trainguard.manager import
  CheckpointManager"`` to the end of its imports, median of 3 (run while attempt 0 waits for its go, after the
  page cache was prepared, so libraries are as warm as they are for the relaunch);
- plus bytes / read bandwidth: the checkpoint's chunk files read sequentially with 64 MiB ``readinto`` calls
  into one reused buffer (``_common.raw_read_floor``).

Beside it a stricter floor whose first term is only ``python -c "import torch"`` (what any training job pays,
checkpointing or not): the difference is the import cost of trainguard itself, including
``torch.distributed.checkpoint``.

Cache conditions: ``cold`` drops the page cache (``echo 3 > /proc/sys/vm/drop_caches`` after ``sync``) once the
save has committed, then re-warms the Python and torch files by running the import probe, so the relaunch finds
its libraries cached and the checkpoint on disk; the floor's read also follows a drop. ``warm`` drops
nothing: the relaunch follows the save on the same node. The job saves with ``direct_io`` (the default), which
writes the chunk files around the page cache, so in ``warm`` the supervisor's prefetch reads them from the disk
while the job starts (the relaunched job itself then reads no bytes from the disk: the ``relaunch disk MB`` column),
whereas the floor's read finds them in the page cache (they are read once before it is timed). A third read,
into freshly allocated memory (what a new process has to do: every page is faulted in on first touch), is
reported beside the floor to explain the load phase; the floor itself is the reused-buffer read, as defined in
the issue.

Prefetch: the supervisor has the newest checkpoint read into the page cache while the relaunch starts
(``SupervisorConfig.prefetch``, on by default), so in the ``cold`` condition the restore mostly reads memory
and TTR can fall below this floor, which charges the read after the imports. ``--prefetch off`` (or
``on,off``: both, alternating) measures without it; the ``prefetch`` column is the ``seconds`` of the
supervisor's ``prefetch`` event (choosing the checkpoint and issuing the reads).

Load-independent figures, for a shared machine where wall times swing with other processes' load: the CPU
seconds (user + system, all threads) of the relaunched job from its start to the end of its first step and of
the import probe (the difference is what the relaunch does beyond importing: the manager, the restore, the
step), and the bytes the relaunch read from the disk by then (``/proc/self/io`` ``read_bytes``: in the cold
condition about the checkpoint's size when the re-warm left nothing else to read).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

from _common import (
    default_scratch_parent,
    drop_caches,
    dump_json,
    format_table,
    log,
    machine_info,
    raw_read_floor,
    remove_path,
)

REPO = Path(__file__).resolve().parent.parent
TARGET_X = 1.2  # issue 15: TTR within 1.2x of the floor (run_issue15.py judges the same; was 1.5x)
TENSOR_BYTES = 64 * 10**6  # under the manager's 64 MiB chunk size: one chunk per tensor

# Each probe prints its CPU seconds (user + system, all threads), then the time its imports ended.
_CPU_THEN_TIME = "import os, time; c = os.times(); print(c.user + c.system); print(time.time())"
IMPORT_PROBE = "import torch, trainguard; from trainguard.manager import CheckpointManager; " + _CPU_THEN_TIME
TORCH_PROBE = "import torch; " + _CPU_THEN_TIME  # what any training job pays, checkpointing or not

JOB = textwrap.dedent(
    '''
    """Tiny job for bench_ttr.py: argv = root, state bytes, save step, total steps, control dir."""
    import os, signal, sys, time
    from pathlib import Path

    root, nbytes, save_step, total, ctl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    import torch
    import trainguard as tg

    attempt = int(os.environ.get("TRAINGUARD_RESTART_COUNT", "0"))
    n = max(1, -(-nbytes // TENSOR_BYTES))
    numel = nbytes // n // 4
    g = torch.Generator().manual_seed(0)
    if attempt == 0:  # random content: no two chunks alike, so nothing is deduplicated
        tensors = {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}
    else:  # restore_latest fills these in place
        tensors = {f"w{i}": torch.empty(numel) for i in range(n)}
    state = {"tensors": tensors}
    mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(save_step), keep=2)
    step = mgr.restore_latest(state) or 0
    first = True
    while step < total:
        step += 1
        for t in tensors.values():  # the "training step": touches every tensor
            t[:4096].add_(1.0)
        pending = mgr.maybe_save(step, state)
        if attempt == 1 and first:  # after the TTR's end (the first step's event): CPU and disk reads so far
            c = os.times()
            io = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
            (ctl / "relaunch.txt").write_text(f"{c.user + c.system} {io['read_bytes']}")
        first = False
        if attempt == 0 and pending is not None:
            pending.wait()
            (ctl / "saved").write_text(str(step))
        if attempt == 0 and step == save_step + 2:
            (ctl / "ready").write_text(str(os.getpid()))
            while not (ctl / "go").exists():
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    '''
).replace("TENSOR_BYTES", str(TENSOR_BYTES))


def import_time(n: int = 3, code: str = IMPORT_PROBE, cpu: list[float] | None = None) -> list[float]:
    """Seconds from spawning the import probe to the end of its imports, ``n`` times; each run's CPU seconds
    are appended to ``cpu`` when given."""
    out = []
    for _ in range(n):
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        lines = p.stdout.strip().splitlines()
        out.append(float(lines[-1]) - t0)
        if cpu is not None:
            cpu.append(float(lines[-2]))
    return out


def chunk_files(root: Path, step: int) -> list[Path]:
    from trainguard.catalog import read_manifest

    m = read_manifest(root, step)
    return [root / c.path for c in m.chunks.values()]


def read_files(files: list[Path], *, fresh: bool) -> float:
    """Seconds to read ``files`` sequentially: into one reused 64 MiB block, or into fresh memory."""
    if not fresh:
        return sum(raw_read_floor(f) for f in files)
    import torch

    total = 0.0
    for f in files:
        size = f.stat().st_size
        t0 = time.perf_counter()
        buf = torch.empty(size, dtype=torch.uint8)  # untouched: pages are faulted in by the read
        view = memoryview(buf.numpy())
        with open(f, "rb", buffering=0) as fh:
            got = 0
            while got < size:
                got += fh.readinto(view[got : got + (64 << 20)])
        total += time.perf_counter() - t0
        del view, buf
    return total


def run_once(
    size_mb: float, cache: str, scratch: Path, save_step: int, prefetch: bool = True
) -> dict[str, Any]:
    from trainguard.recovery.config import Backoff, SupervisorConfig
    from trainguard.recovery.supervisor import Supervisor

    run_dir = Path(tempfile.mkdtemp(prefix=f"ttr-{int(size_mb)}mb-{cache}-", dir=scratch))
    root, ctl = run_dir / "root", run_dir / "ctl"
    ctl.mkdir()
    job = run_dir / "job.py"
    job.write_text(JOB)
    nbytes = int(size_mb * 1e6)
    cmd = [sys.executable, str(job), str(root), str(nbytes), str(save_step), str(save_step + 5), str(ctl)]
    probe: dict[str, Any] = {}

    def coordinate() -> None:
        """When attempt 0 waits for its go: prepare the page cache, measure imports, then let it die."""
        while not (ctl / "ready").exists():
            time.sleep(0.01)
        if cache == "cold":
            probe["dropped"] = drop_caches()
            import_time(1)  # re-warm Python and torch (the drop evicted them too)
        probe["import_cpu_s"], probe["torch_cpu_s"] = [], []
        probe["import_s"] = import_time(3, cpu=probe["import_cpu_s"])
        probe["torch_s"] = import_time(3, TORCH_PROBE, cpu=probe["torch_cpu_s"])
        (ctl / "go").touch()

    th = threading.Thread(target=coordinate, daemon=True)
    th.start()
    cfg = SupervisorConfig(
        root=root,
        max_restarts=1,
        backoff=Backoff(initial_s=0.0, max_s=0.0),
        grace_period_s=5.0,
        forward_signals=False,
        prefetch=prefetch,
    )
    result = Supervisor(cmd, cfg, echo=log).run()
    th.join()
    if result.exit_code != 0 or not result.recoveries:
        raise RuntimeError(f"supervised job failed: {result.to_dict()}")
    rec = result.recoveries[0]
    from trainguard.recovery.events import read_events

    restore = [e for e in read_events(root, event="restore") if e.get("restart_count") == 1][-1]
    fetched = [e for e in read_events(root, event="prefetch") if e.get("restart_count") == 1]
    relaunch_cpu_s, relaunch_read = (float(x) for x in (ctl / "relaunch.txt").read_text().split())
    files = chunk_files(root, rec.restored_step)
    ckpt_bytes = sum(f.stat().st_size for f in files)
    reads = {}
    for fresh in (False, True):
        if cache == "cold":
            drop_caches()
        else:
            read_files(files, fresh=False)  # make sure every chunk is cached
        reads[fresh] = read_files(files, fresh=fresh)
    import_s = statistics.median(probe["import_s"])
    floor = import_s + reads[False]
    torch_s = statistics.median(probe["torch_s"])
    phases = dict(rec.phases)
    known = sum(v for v in phases.values() if v is not None)
    row = {
        "size_mb": size_mb,
        "cache": cache,
        "prefetch": prefetch,
        "prefetch_status": fetched[-1]["status"] if fetched else None,
        "prefetch_s": fetched[-1]["seconds"] if fetched else None,
        "bytes": ckpt_bytes,
        "restore_bytes": restore.get("bytes"),
        "ttr_s": rec.ttr_s,
        "floor_s": floor,
        "ttr_x": rec.ttr_s / floor if rec.ttr_s else None,
        "import_s": import_s,
        "import_all_s": probe["import_s"],
        "torch_import_s": torch_s,
        # load-independent figures (CPU seconds do not grow with other processes' load the way wall time does)
        "relaunch_cpu_s": relaunch_cpu_s,
        "import_cpu_s": statistics.median(probe["import_cpu_s"]),
        "torch_cpu_s": statistics.median(probe["torch_cpu_s"]),
        "extra_cpu_s": relaunch_cpu_s - statistics.median(probe["import_cpu_s"]),
        "relaunch_read_mb": relaunch_read / 1e6,
        "floor_torch_s": torch_s + reads[False],
        "ttr_x_torch": rec.ttr_s / (torch_s + reads[False]) if rec.ttr_s else None,
        "read_s": reads[False],
        "read_gb_s": ckpt_bytes / 1e9 / reads[False],
        "read_fresh_s": reads[True],
        "read_fresh_gb_s": ckpt_bytes / 1e9 / reads[True],
        "load_gb_s": ckpt_bytes / 1e9 / phases["load_s"] if phases.get("load_s") else None,
        "other_s": (rec.ttr_s - known) if rec.ttr_s is not None else None,
        "dropped": probe.get("dropped", False) if cache == "cold" else None,
        "restored_step": rec.restored_step,
        "steps_lost": rec.steps_lost,
        **phases,
    }
    remove_path(run_dir)
    return row


COLUMNS = [
    ("label", "state / cache", ""),
    ("ttr_s", "TTR s", ".2f"),
    ("floor_s", "floor s", ".2f"),
    ("ttr_x", "TTR/floor", ".2f"),
    ("ttr_x_range", "all runs", ""),
    ("ttr_x_torch", "vs torch-only floor", ".2f"),
    ("detection_s", "detect", ".3f"),
    ("teardown_s", "teardown", ".3f"),
    ("backoff_s", "backoff", ".3f"),
    ("relaunch_s", "relaunch", ".2f"),
    ("identification_s", "identify", ".3f"),
    ("load_s", "load", ".2f"),
    ("validation_s", "validate", ".3f"),
    ("first_step_s", "1st step", ".3f"),
    ("other_s", "other", ".3f"),
    ("prefetch_s", "prefetch", ".2f"),
]
FLOOR_COLUMNS = [
    ("label", "state / cache", ""),
    ("bytes_mb", "MB", ".0f"),
    ("import_s", "start+import s", ".2f"),
    ("torch_import_s", "python+torch s", ".2f"),
    ("read_s", "read s", ".2f"),
    ("read_gb_s", "read GB/s", ".2f"),
    ("load_gb_s", "load GB/s", ".2f"),
    ("read_fresh_s", "read fresh s", ".2f"),
    ("read_fresh_gb_s", "fresh GB/s", ".2f"),
]
CPU_COLUMNS = [
    ("label", "state / cache", ""),
    ("relaunch_cpu_s", "relaunch CPU s", ".2f"),
    ("import_cpu_s", "probe CPU s", ".2f"),
    ("extra_cpu_s", "extra CPU s", ".2f"),
    ("torch_cpu_s", "torch-only CPU s", ".2f"),
    ("bytes_mb", "checkpoint MB", ".0f"),
    ("relaunch_read_mb", "relaunch disk MB", ".0f"),
]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, cache): the run with the median TTR/floor (its phases and floor parts belong
    together), with the range of TTR/floor over all repeats."""
    out = []

    def condition(r: dict[str, Any]) -> tuple[float, str, bool]:
        return r["size_mb"], r["cache"], r.get("prefetch", True)

    keys = sorted({condition(r) for r in rows}, key=lambda k: (k[0], k[1] != "cold", not k[2]))
    for size, cache, prefetch in keys:
        group = sorted((r for r in rows if condition(r) == (size, cache, prefetch)), key=lambda r: r["ttr_x"])
        med = dict(group[(len(group) - 1) // 2])
        med["n"] = len(group)
        med["ttr_x_range"] = f"{group[0]['ttr_x']:.2f}-{group[-1]['ttr_x']:.2f}"
        med["bytes_mb"] = med["bytes"] / 1e6
        med["label"] = f"{size:g} MB / {cache}" + ("" if prefetch else " / no prefetch")
        out.append(med)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mb", default="100,1000", help="state sizes in MB (10^6 bytes), comma-separated")
    ap.add_argument("--cache", default="cold,warm", help="cache conditions: cold, warm, or cold,warm (both)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per (size, cache condition)")
    ap.add_argument(
        "--prefetch",
        default="on",
        help="the supervisor's prefetch (SupervisorConfig.prefetch): on (its default), off, or on,off (both, "
        "alternating within each repeat)",
    )
    ap.add_argument("--save-step", type=int, default=10)
    ap.add_argument("--scratch", default=None, help="parent of the scratch directory (default: the temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    a = ap.parse_args(argv)
    sizes = [float(s) for s in a.sizes_mb.split(",") if s]
    caches = ["cold", "warm"] if a.cache == "both" else [c for c in a.cache.split(",") if c]
    if not caches or any(c not in ("cold", "warm") for c in caches):
        ap.error("--cache takes cold, warm, or cold,warm (both)")
    prefetches = [p for p in a.prefetch.split(",") if p]
    if not prefetches or any(p not in ("on", "off") for p in prefetches):
        ap.error("--prefetch takes on, off or on,off")
    scratch = Path(tempfile.mkdtemp(prefix="bench_ttr-", dir=a.scratch or default_scratch_parent(REPO)))
    can_drop = drop_caches() if "cold" in caches else False
    rows = []
    try:
        for rep in range(a.repeat):
            for size in sizes:
                for cache in caches:
                    order = prefetches if rep % 2 == 0 else prefetches[::-1]
                    for pf in order:
                        row = run_once(size, cache, scratch, a.save_step, prefetch=pf == "on")
                        row["repeat"] = rep
                        rows.append(row)
                        log(
                            f"{size:g} MB {cache} prefetch {pf}: TTR {row['ttr_s']:.2f} s, floor "
                            f"{row['floor_s']:.2f} s (x{row['ttr_x']:.2f}); relaunch {row['relaunch_s']:.2f} "
                            f"load {row['load_s']:.2f}"
                        )
    finally:
        remove_path(scratch)
    import torch  # for machine_info's version

    info = machine_info()
    info["torch"] = torch.__version__
    summary = summarize(rows)
    if a.json:
        dump_json({"machine": info, "can_drop_caches": can_drop, "runs": rows, "summary": summary})
        return 0
    print(
        f"{info['date']}; {info.get('cpu', '?')}, nproc {info['nproc']}, {info.get('mem_gib', '?')} GiB; "
        f"torch {info['torch']}, python {info['python']}"
    )
    print(
        "page cache: "
        + (
            "dropped before each cold TTR and each cold floor read (echo 3 > /proc/sys/vm/drop_caches worked)"
            if can_drop
            else "not dropped (no cold rows asked for)"
            if "cold" not in caches
            else "could NOT be dropped (not root?): 'cold' rows read from the page cache"
        )
    )
    print()
    print(
        f"time to resume after SIGKILL, seconds: the run with the median TTR/floor of {a.repeat} (phases from the"
        " supervisor's join)"
    )
    print()
    print(format_table(summary, COLUMNS))
    print()
    print(
        "floor = start+import + bytes / read bandwidth (reused buffer); beside it the restore's own load rate"
    )
    print("and a read into freshly allocated memory (page faults included, as a new process must do):")
    print()
    print(format_table(summary, FLOOR_COLUMNS))
    print()
    print("load-independent: CPU seconds (user + system, all threads) of the relaunched job from its start")
    print("to the end of its first step, of the import probe, and the disk bytes it read until then:")
    print()
    print(format_table(summary, CPU_COLUMNS))
    print()
    for s in summary:
        ok = s["ttr_x"] <= TARGET_X
        print(
            f"{s['label']}: TTR {s['ttr_s']:.2f} s = {s['ttr_x']:.2f}x the floor "
            f"({s['floor_s']:.2f} s); target <= {TARGET_X:g}x: {'MET' if ok else 'NOT MET'}; "
            f"{s['ttr_x_torch']:.2f}x a floor with only python + import torch ({s['floor_torch_s']:.2f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
