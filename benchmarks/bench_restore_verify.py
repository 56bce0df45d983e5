"""The cost of checking every chunk's CRC32C before a restore touches the caller's objects (fix1 finding 2).

Run (about 1 minute on 2 cores)::

    .venv/bin/python benchmarks/bench_restore_verify.py [--mib 256] [--repeat 5]

A state of ``--mib`` MiB (one float32 tensor, 4 MiB chunks, compression off) is saved once, then restored
``--repeat`` times each way, alternating: as shipped (one CRC32C pass over every chunk the state needs, then
the load, which checks each chunk again as it reads it) and with the pass removed (the load alone, as before
the fix; ``trainguard._restore.verify_chunks`` replaced for this script only). The checkpoint was just written,
so both read from the page cache: the extra pass costs a CRC32C over the bytes and the copies of one more read,
not disk time. A checkpoint larger than the page cache reads its bytes from disk twice: at most 2x the
restore's read time. Reports bytes read each way and the median time ratio; the target is a warm restore at
most ``TARGET_RATIO`` times the load alone.
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
from _common import log, machine_info  # noqa: E402

import trainguard as tg  # noqa: E402
import trainguard._restore as restore_mod  # noqa: E402

TARGET_RATIO = 1.6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    log(machine_info())
    n = args.mib * (1 << 20) // 4
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp) / "root"
        src = torch.randn(n)
        with tg.CheckpointManager(
            root, async_save=False, fsync=False, compression="off", chunk_size_bytes=4 << 20
        ) as mgr:
            mgr.save(1, {"w": src})
        mgr = tg.CheckpointManager(root, read_only=True)
        dest = torch.empty(n)
        real = restore_mod.verify_chunks
        times: dict[str, list[float]] = {"verify+load": [], "load only": []}
        read: dict[str, int] = {}
        for _ in range(args.repeat):
            for name in ("verify+load", "load only"):
                restore_mod.verify_chunks = real if name == "verify+load" else (lambda *a, **k: 0)
                dest.zero_()
                t0 = time.perf_counter()
                mgr.restore(1, {"w": dest})
                times[name].append(time.perf_counter() - t0)
                assert torch.equal(dest, src)
                read[name] = mgr.last_restore.bytes + mgr.last_restore.verify_bytes
        restore_mod.verify_chunks = real
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["verify+load"] / med["load only"]
    for k in times:
        log(
            f"{k:12s} median {med[k]:.3f} s  ({', '.join(f'{t:.3f}' for t in times[k])})  bytes read {read[k]}"
        )
    log(
        f"bytes ratio {read['verify+load'] / read['load only']:.2f}; time ratio {ratio:.2f} (target <= {TARGET_RATIO})"
    )
    log("PASS" if ratio <= TARGET_RATIO else "MISS")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
