"""Shared helpers for the scripts in ``benchmarks/``: timing, the raw-disk floors, page-cache control, output.

Every benchmark here compares methods side by side *in one run*: on shared machines absolute figures drift by
30% and more, ratios measured together do not (see /work/shared/NOTES.md). The floors are what the hardware
does with no library in the way: a sequential ``write`` + ``fsync`` of the same bytes, and a sequential read
of that file under the same caching condition as the loads being compared.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

GB = 1e9  # throughput is reported in GB/s (10^9 bytes), as dd and disk vendors do
_BLOCK_BYTES = 64 << 20


# One transformer layer of the synthetic state dicts both save/load benchmarks build (name, shape): large
# matrices, medium ones, and the many small tensors (biases, norms, 0-d) a real state_dict holds.
_D, _FFN = 1024, 4096
TRANSFORMER_LAYER: list[tuple[str, tuple[int, ...]]] = [
    ("attention.wq.weight", (_D, _D)),
    ("attention.wk.weight", (_D, _D)),
    ("attention.wv.weight", (_D, _D)),
    ("attention.wo.weight", (_D, _D)),
    ("feed_forward.w1.weight", (_FFN, _D)),
    ("feed_forward.w2.weight", (_D, _FFN)),
    ("feed_forward.w3.weight", (_FFN, _D)),
    ("attention.wq.bias", (_D,)),
    ("attention.wk.bias", (_D,)),
    ("attention.wv.bias", (_D,)),
    ("attention.wo.bias", (_D,)),
    ("feed_forward.w1.bias", (_FFN,)),
    ("feed_forward.w2.bias", (_D,)),
    ("attention_norm.weight", (_D,)),
    ("ffn_norm.weight", (_D,)),
    ("attention.freqs", (512, 64)),
    ("attention.rel_pos_bias", (32, _D)),
    ("moe.router.weight", (8, _D)),
    ("adapter.down.weight", (128, _D)),
    ("attention.logit_scale", ()),
]


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[float, T]:
    """Run ``fn(*args, **kwargs)`` and return ``(wall seconds, result)``."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / GB / seconds if seconds > 0 else float("inf")


# -- durability and the page cache ----------------------------------------------------------------------------
def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path (flushes the inode's dirty pages, whoever wrote them)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: str | os.PathLike[str]) -> None:
    """Delete a file or a directory tree; missing is fine."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache, so the next read comes from the disk.

    Returns False when not allowed (not root, or a container without a writable /proc/sys): the caller must
    then say that its reads are served from the page cache.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


# -- floors ---------------------------------------------------------------------------------------------------
def raw_write_floor(buffers: Iterable[memoryview | bytes], path: str | os.PathLike[str]) -> float:
    """Seconds to write ``buffers`` sequentially to a new file ``path`` with ``os.write``, then fsync it and
    its directory (``dd conv=fsync``): the floor any durable save of the same bytes is compared to. One stream:
    on the virtio disks here, 4 threads writing separate files were measured at up to 1.5x this."""
    os.sync()  # earlier writers' dirty pages must not be flushed inside our timed region
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for buf in buffers:
            view = memoryview(buf).cast("B")
            while len(view):
                view = view[os.write(fd, view[:_BLOCK_BYTES]) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(Path(path).parent)
    return time.perf_counter() - t0


def raw_read_floor(path: str | os.PathLike[str], out: memoryview | None = None) -> float:
    """Seconds to read the file ``path`` sequentially (64 MiB ``readinto`` calls) into ``out``, a buffer the
    caller allocated and touched beforehand (at least the file's size), or into one reused block if None.

    Reads whatever the page cache holds: call :func:`drop_caches` first to measure the disk.
    """
    size = os.path.getsize(path)
    if out is None:
        out = memoryview(bytearray(min(size, _BLOCK_BYTES)))
        wrap = True
    else:
        out = out.cast("B") if out.format != "B" else out
        if len(out) < size:
            raise ValueError(f"out holds {len(out)} bytes, the file {size}")
        wrap = False
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            lo = 0 if wrap else got
            n = f.readinto(out[lo : lo + min(_BLOCK_BYTES, size - got)])
            if not n:
                raise OSError(f"{path}: short read at {got} of {size} bytes")
            got += n
    return time.perf_counter() - t0


# -- where and on what ----------------------------------------------------------------------------------------
def filesystem_of(path: str | os.PathLike[str]) -> str:
    """``"<device> <fstype>"`` of the mount holding ``path`` (from /proc/mounts), or "unknown"."""
    p = os.path.realpath(path)
    best = ("", "unknown", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, dev, fstype)
    except OSError:
        return "unknown"
    return f"{best[1]} {best[2]}"


def default_scratch_parent(repo: Path) -> Path:
    """The system temp dir when it lies on the repository's filesystem (not tmpfs), else the repository."""
    import tempfile

    tmp = Path(tempfile.gettempdir())
    if os.stat(tmp).st_dev == os.stat(repo).st_dev:
        return tmp
    return repo


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m": round(os.getloadavg()[0], 2),  # other jobs on a shared machine skew every figure
    }
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["mem_gib"] = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line for line in f if line.startswith("model name")).split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    return info


# -- output ---------------------------------------------------------------------------------------------------
def compare_rows(seconds: dict[str, float], nbytes: int, floor: str) -> list[dict[str, Any]]:
    """One row per method: seconds, GB/s of ``nbytes`` and the fraction of the floor's bandwidth
    (``floor seconds / method seconds``: 1.0 = as fast as the raw disk)."""
    base = seconds[floor]
    return [
        {"method": m, "seconds": s, "gb_s": gbps(nbytes, s), "of_raw": base / s if s > 0 else float("inf")}
        for m, s in seconds.items()
    ]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A plain-text table. ``columns`` are ``(key, header, format spec)``; a row may omit a key (blank)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([format(r[k], spec) if r.get(k) is not None else "" for k, _, spec in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = []
    for n, c in enumerate(cells):
        lines.append(
            "  ".join(
                v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(c, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


COMPARE_COLUMNS = [
    ("method", "method", ""),
    ("seconds", "seconds", ".2f"),
    ("gb_s", "GB/s", ".3f"),
    ("of_raw", "of raw", ".0%"),
]


Verdict = tuple[str, bool, str]  # (target, met, detail)


def cache_note(cold: bool) -> str:
    """How the loads of a run read their data, for the report's header."""
    if cold:
        return "page cache dropped before each load (cold, from disk)"
    return "LOADS READ FROM THE PAGE CACHE (drop_caches not permitted): load figures are not disk figures"


def report_json(
    *, load_start: float, scratch: Path, nbytes: int, repeat: int, cold: bool, verdicts: Sequence[Verdict]
) -> dict[str, Any]:
    """The fields every save/load benchmark's ``--json`` report has; the script adds its rows and runs."""
    return {
        "machine": machine_info(),
        "loadavg_1m_at_start": load_start,
        "scratch_fs": filesystem_of(scratch),
        "state_bytes": nbytes,
        "repeat": repeat,
        "statistic": "best",
        "loads_cold": cold,
        "targets": {name: {"met": ok, "detail": det} for name, ok, det in verdicts},
    }


def print_targets(verdicts: Sequence[Verdict]) -> None:
    print("\nTARGETS (trainguard)")
    for name, ok, det in verdicts:
        print(f"  {'PASS' if ok else 'MISS'}  {name}: {det}")


def dump_json(obj: Any, file: Any = None) -> None:
    json.dump(obj, file or sys.stdout, indent=2, default=str)
    (file or sys.stdout).write("\n")


def log(msg: str) -> None:
    """Progress on stderr (stdout is for the table or the JSON)."""
    print(msg, file=sys.stderr, flush=True)


def sized_run_main(
    doc: str,
    run: Callable[[float, int, Path], dict[str, Any]],
    *,
    default_size_gib: float,
    size_help: str,
    scratch_help: str,
    prefix: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The command line of a benchmark that measures ``run(size_gib, repeat, scratch)`` in a scratch folder:
    ``--size-gib``, ``--repeat`` (timed rounds after a warm-up), ``--scratch`` (its parent) and ``--json FILE``.
    Refuses a size or repeat below 1 (exit code 2), removes the scratch folder after the run, adds the machine
    to the result, writes the JSON and prints the date, machine and trainguard's location.

    Returns:
        The result of ``run`` (with ``machine``) and the machine's description.
    """
    import argparse
    import tempfile

    import trainguard

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, default=default_size_gib, help=size_help)
    ap.add_argument("--repeat", type=int, default=5, help="timed rounds after a warm-up (default 5)")
    ap.add_argument("--scratch", help=scratch_help)
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON to FILE")
    a = ap.parse_args()
    if a.repeat < 1 or a.size_gib <= 0:
        ap.error("--repeat must be >= 1 and --size-gib > 0")
    info = machine_info()
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=a.scratch))
    try:
        res = run(a.size_gib, a.repeat, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["machine"] = info
    if a.json:
        with open(a.json, "w") as f:
            dump_json(res, f)
    print(f"# {info['date']}  {info.get('cpu', '?')} x{info['nproc']}, load average {info['loadavg_1m']}")
    print(f"# trainguard from {Path(trainguard.__file__).parent}")
    return res, info
