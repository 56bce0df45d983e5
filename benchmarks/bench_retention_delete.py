"""What retention's chunk deletion costs a synchronous save: ``keep=1`` (each save deletes the previous
checkpoint's chunk files) against ``keep=None`` (deletes nothing), side by side in one run.

Run (about 1 minute on 2 cores at the defaults)::

    .venv/bin/python benchmarks/bench_retention_delete.py
    .venv/bin/python benchmarks/bench_retention_delete.py --size-gib 1 --repeat 7 --json out.json
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python benchmarks/bench_retention_delete.py  # another version

Protocol: two run roots in one scratch folder on the same filesystem, one ``CheckpointManager(async_save=False,
fsync=True)`` each (``keep=1`` and ``keep=None``), a state of ``--size-gib`` fp32 tensors of 8 MiB (one chunk
file each). Each round saves once with each manager, in an order rotated per round, every tensor changed
before each save (nothing deduplicated); the timed region is ``save()`` alone. After it, the time until the
manager's background chunk deletion ends is measured apart (``ctx.collection``; 0 where the code under test
deletes inside ``save()``), so no deletion runs beside the next timed save. So that both saves write into
space just freed (on this VM a write right after a deletion runs faster than one into other free space), the
``keep=None`` save is preceded by the deletion of a ballast file of the state's size, untimed. Round 0 is a
warm-up. Medians over ``--repeat`` rounds.

Target: the ``keep=1`` save takes at most 1.1x the ``keep=None`` save (the deletion is off the save's path).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import log, sized_run_main  # noqa: E402

import trainguard as tg  # noqa: E402

TARGET_X = 1.1
TENSOR_ELEMS = 2 << 20  # 8 MiB of float32


def background_wait(mgr: tg.CheckpointManager) -> float:
    """Seconds until the manager's background chunk deletion ends (0.0 with code that has none)."""
    coll = getattr(getattr(mgr, "ctx", None), "collection", None)
    t0 = time.perf_counter()
    if coll is not None:
        coll.wait()
    return time.perf_counter() - t0


def write_ballast(path: Path, nbytes: int) -> None:
    block = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(0, nbytes, len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def run(size_gib: float, repeat: int, scratch: Path) -> dict[str, object]:
    n = max(1, round(size_gib * (1 << 30) / (TENSOR_ELEMS * 4)))
    state = {f"t{i}": torch.randn(TENSOR_ELEMS) for i in range(n)}
    nbytes = n * TENSOR_ELEMS * 4
    keeps = {"keep=1": 1, "keep=None": None}
    mgrs = {k: tg.CheckpointManager(scratch / k, keep=v, async_save=False) for k, v in keeps.items()}
    ballast = scratch / "ballast.bin"
    save_s: dict[str, list[float]] = {k: [] for k in keeps}
    gc_s: dict[str, list[float]] = {k: [] for k in keeps}
    step = 0
    try:
        for r in range(repeat + 1):
            order = list(keeps) if r % 2 == 0 else list(reversed(keeps))
            for name in order:
                step += 1
                with torch.no_grad():
                    for t in state.values():
                        t.add_(1.0)
                if name == "keep=None":
                    if not ballast.exists():
                        write_ballast(ballast, nbytes)
                    ballast.unlink()  # the same freed space the keep=1 save writes into
                t0 = time.perf_counter()
                mgrs[name].save(step, state)
                took = time.perf_counter() - t0
                waited = background_wait(mgrs[name])
                if name == "keep=None":
                    write_ballast(ballast, nbytes)  # for the next round, untimed
                if r:
                    save_s[name].append(took)
                    gc_s[name].append(waited)
                log(f"round {r} {name}: save {took:.3f} s, then background deletion {waited:.3f} s")
    finally:
        for m in mgrs.values():
            m.close()
    med = {k: statistics.median(v) for k, v in save_s.items()}
    ratio = med["keep=1"] / med["keep=None"]
    return {
        "bytes": nbytes,
        "tensors": n,
        "repeat": repeat,
        "save_s": save_s,
        "background_delete_s": gc_s,
        "median_save_s": med,
        "ratio": ratio,
        "met": ratio <= TARGET_X,
    }


def main() -> None:
    res, _ = sized_run_main(
        __doc__,
        run,
        default_size_gib=0.5,
        size_help="state size in GiB (default 0.5)",
        scratch_help="folder for the two run roots (default: a temp folder, removed after)",
        prefix="bench-retention-delete-",
    )
    print(
        f"# state {res['bytes'] / 2**30:.2f} GiB in {res['tensors']} chunk files; sync durable saves; "
        f"medians of {res['repeat']} rounds"
    )
    med = res["median_save_s"]
    for name in ("keep=None", "keep=1"):
        saves = " ".join(f"{s:.3f}" for s in res["save_s"][name])
        bg = statistics.median(res["background_delete_s"][name])
        print(f"{name:<10} save {med[name]:.3f} s (runs {saves}); background deletion after it {bg:.3f} s")
    verdict = "PASS" if res["met"] else "MISS"
    print(
        f"\n{verdict}  a save whose retention deletes the previous checkpoint's chunks <= {TARGET_X}x a save "
        f"that deletes nothing: {res['ratio']:.2f}x"
    )


if __name__ == "__main__":
    main()
