"""Device benchmark: trainguard's CUDA paths measured on a GPU in one command (under 5 minutes on one GPU).

Run::

    .venv/bin/python benchmarks/bench_gpu.py                  # needs CUDA; prints SKIP and exits 0 without it
    .venv/bin/python benchmarks/bench_gpu.py --json out.json  # also write every figure as JSON
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --tiny   # the same logic on CPU in seconds (a test)
    .venv/bin/python benchmarks/bench_gpu.py --methods raw_thread,raw_process,tg_1thread   # a diagnosis

What it measures, side by side in one run:

1. **Device-to-host copy bandwidth** (the floor): every tensor of a ~2 GiB state (transformer layers of
   ``benchmarks/_common.py``'s shapes) copied into preallocated pinned host buffers with non-blocking copies and
   one synchronize, best of 5.
2. **Blocking stall per GB** of an async save (``CheckpointManager(async_save=True)``): the seconds ``save()``
   blocks the caller (``PendingSave.staging_s``: pinned staging buffers, non-blocking copies, one stream
   sync), median of the saves after the first (buffers allocated). Target: stall <= 1.3x the copy floor.
3. **Pinned memory**: the staging buffers' host bytes, and how many of them are pinned (all on CUDA, none on
   CPU), against the state's bytes (at most ``staging_buffers`` = 2 sets).
4. **Bit-exact save and restore of CUDA tensors**: a model, its AdamW state, ``tg.RNGState()`` (CUDA RNG
   included) and loose tensors of several dtypes (a non-contiguous view among them, restored into a
   non-contiguous destination) saved synchronously and asynchronously, then restored into perturbed live
   objects: every tensor equal bit for bit and still on the device, and the next random draw on the device
   equal to the one taken right after the save; the synchronous save counts the device tensors' bytes
   (``SaveResult.logical_bytes``).
5. **Async overhead on a GPU training loop**: an MLP trained on the device; segments of ``--every`` steps,
   each saving at its first step with one method and waiting for the save at its end (so a persist longer
   than the interval is charged to it); methods ``none``, ``trainguard async`` and ``dcp.async_save`` (with
   a reused ``DefaultStager``: pinned, non-blocking), rotated per round, first round a warm-up; overhead =
   median over rounds of ``segment(method) / segment(none) - 1``. Targets: trainguard < 1% and not above
   ``dcp.async_save``'s overhead in the same run. ``dcp.async_save`` gets a reused ``DefaultStager`` where torch
   has one, else no stager, and none after the stager raised (torch 2.11 + CUDA: ``KeyError: <class
   'type'>``); the report says which. ``--every`` (default 100 steps, the issue's interval) sets the segment.
   A fourth method, ``raw write thread``, is the floor of any async save in this loop (info, no target):
   the same pinned copy and synchronize, then one thread writes the bytes to one file and fsyncs it. A fifth,
   ``raw write process``, is the floor of a persist *process* (info): the same copy into one pinned
   shared-memory file, written and fsynced by a child process started once (:class:`RawProcess`). If the
   thread's floor costs the loop clearly more than the process's, the interpreter (the GIL) is the cost and a
   persist process is worth building; if both cost as much, the machine is. ``--methods`` picks the methods
   (``none`` and ``tg_async`` always run); two more exist for a diagnosis: ``tg_1thread`` (trainguard with
   one background writer thread instead of up to 4) and ``dcp_process`` (``dcp.async_save`` with
   ``AsyncCheckpointerType.PROCESS`` and a pinned shared-memory ``DefaultStager``), and ``raw_thread_1m`` (the
   raw write thread writing each tensor in 1 MiB pieces instead of one ``write`` per tensor: under gVisor a
   long ``write`` from pinned memory may hold the sandbox's memory-map lock that the training thread's CUDA
   calls need; shorter writes let them in). A method other than ``none`` and ``tg_async`` that raises is reported and left out of the later rounds. The warm-up round's segments are a quarter
   of ``--every`` (at least 2 steps).
   Where the time goes, per method against the same round's ``none`` segment: seconds blocked in ``save()``,
   the persist's seconds, and CUDA-event timings of every step: extra device time inside steps (a step whose
   launches came late, e.g. its thread waiting for the GIL) and between steps, and the steps slowed most. A
   persist that outlasts the interval shows as extra time at the segment's end instead.
6. **A DTensor's async save** on a one-rank mesh of the device (in the loop's process group): the device
   memory allocated must not grow by the DTensor's bytes while the save persists (its staged shard stays in
   the pinned host buffer), and the restore is bit-exact.

The figures so far are written to ``--json`` after each phase; a phase that raises is reported as an error
(exit code 1) and the next one runs. ``--require-cuda`` exits 3 instead of printing SKIP
(for a device run, where a SKIP would mean the wrong interpreter). On a multi-GPU node ``--device cuda:N``
makes device N the current one.

Every target prints as ``PASS``/``MISS`` with its ratio. ``--device cpu`` runs every measurement with CPU
tensors (no pinning, no stream): it checks the script's logic and the bit-exactness on CPU, its ratios say
nothing about a GPU. Exit code: 0 (also when the targets are missed: this is a benchmark), 1 when a
bit-exactness check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TARGET_STALL_X = 1.3  # blocking stall per GB within 1.3x of the device-to-host copy time per GB
TARGET_OVERHEAD = 0.01  # async overhead on the training loop below 1% at one save per --every steps
METHODS = (
    "none", "tg_async", "dcp_async", "raw_thread", "raw_process", "tg_1thread", "dcp_process", "raw_thread_1m",
)  # fmt: skip
DEFAULT_METHODS = METHODS[:5]  # the last three on request (--methods): a diagnosis, not a target
REQUIRED_METHODS = ("none", "tg_async")  # the baseline and the measured library: every run has them
# their save returns a future; their files go under dcp_root
FUTURE_METHODS = ("dcp_async", "raw_thread", "raw_process", "dcp_process", "raw_thread_1m")
LABELS = {
    "none": "no checkpointing",
    "tg_async": "trainguard async",
    "dcp_async": "dcp.async_save + stager",
    "raw_thread": "raw write thread (floor)",
    "raw_process": "raw write process (floor)",
    "tg_1thread": "trainguard, 1 writer thread",
    "dcp_process": "dcp.async_save, process",
    "raw_thread_1m": "raw write thread, 1 MiB writes",
}


@dataclass(frozen=True)
class Sizes:
    """What one run measures: state layers x width for the stall, the MLP and the loop's schedule."""

    layers: int
    width: int
    saves: int
    mlp_width: int
    mlp_layers: int
    batch: int
    every: int
    rounds: int
    methods: tuple[str, ...] = DEFAULT_METHODS

    @property
    def warmup_steps(self) -> int:
        """Steps of each method's warm-up segment (round 0: buffers allocated, a persist process started; not
        measured): a quarter of ``every``, at least 2, which keeps the run under 5 minutes with 5 methods."""
        return max(2, self.every // 4)


FULL = Sizes(layers=32, width=1024, saves=6, mlp_width=2048, mlp_layers=8, batch=8192, every=100, rounds=3)
TINY = Sizes(layers=2, width=64, saves=3, mlp_width=64, mlp_layers=2, batch=16, every=4, rounds=2)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_state(sizes: Sizes, device: Any) -> dict[str, Any]:
    """``sizes.layers`` transformer layers (the shapes of ``_common.TRANSFORMER_LAYER`` scaled to
    ``sizes.width``), fp32 on ``device``."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import TRANSFORMER_LAYER

    scale = sizes.width / 1024
    g = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for i in range(sizes.layers):
        for name, shape in TRANSFORMER_LAYER:
            dims = tuple(max(1, int(d * scale)) for d in shape)
            out[f"layers.{i}.{name}"] = torch.randn(dims, generator=g, device=device)
    return out


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- 1. the floor ---------------------------------------------------------------------------------------------
def copy_floor(state: dict[str, Any], device: Any, repeat: int = 5) -> float:
    """Best seconds to copy every tensor of ``state`` into preallocated (pinned on CUDA) host buffers."""
    import torch

    pin = device.type == "cuda"
    bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    for b in bufs.values():
        b.zero_()  # first touch outside the timed region
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        for k, t in state.items():
            bufs[k].copy_(t, non_blocking=pin)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


# -- 2. and 3. the stall and the pinned buffers ---------------------------------------------------------------
def stall_and_pinning(state: dict[str, Any], sizes: Sizes, device: Any, root: Path) -> dict[str, Any]:
    import torch

    import trainguard as tg

    stalls: list[float] = []
    with tg.CheckpointManager(root, async_save=True, keep=2) as mgr:
        for i in range(sizes.saves):
            with torch.no_grad():
                for t in state.values():
                    t.add_(1.0)  # every tensor changes: no save is deduplicated
            sync(device)
            pending = mgr.save(i + 1, state)
            if i:  # the first save allocates (and pins) the buffers
                stalls.append(pending.staging_s)
            pending.wait()
        sets = mgr._stager.sets if mgr._stager is not None else []  # noqa: SLF001 - what is pinned is internal
        bufs = [b for s in sets for b in s.buffers.values()]
        pinned = sum(b.numel() * b.element_size() for b in bufs if b.is_pinned())
        staging = mgr.staging_bytes
    out: dict[str, Any] = {"stall_s": statistics.median(stalls), "stalls_s": stalls}
    out.update(staging_bytes=staging, pinned_bytes=pinned)
    if device.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        with contextlib.suppress(Exception):  # absent or empty on some builds
            out["host_memory_stats"] = {
                k: v for k, v in torch.cuda.host_memory_stats().items() if "allocated_bytes" in k
            }
    return out


# -- 4. bit-exactness -------------------------------------------------------------------------------------------
def make_model(sizes: Sizes, device: Any) -> Any:
    import torch.nn as nn

    w = sizes.mlp_width
    layers: list[Any] = []
    for _ in range(sizes.mlp_layers):
        layers += [nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w)]
    return nn.Sequential(*layers, nn.LayerNorm(w)).to(device)


def train_step(model: Any, opt: Any, x: Any) -> None:
    import torch

    loss = (model(x) - x).pow(2).mean() + 0.0 * torch.rand((), device=x.device)  # draws from the device RNG
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def bit_exact(sizes: Sizes, device: Any, root: Path) -> tuple[dict[str, bool], bool, dict[str, Any]]:
    """Save and restore a model, AdamW, RNGState and loose tensors on ``device`` synchronously and
    asynchronously; return which checks held, whether the synchronous save counted the device tensors'
    bytes (``SaveResult.logical_bytes``), and how the async save's staging buffers reached the disk:
    ``{"buffers": staging buffers of DIRECT_IO_MIN_BYTES or more, "aligned": those on a DIRECT_IO_ALIGN
    boundary, "scratch_direct_io": whether the scratch folder takes O_DIRECT}`` (both: written straight from
    the staging buffers, pinned ones on CUDA, without a bounce copy)."""
    import torch

    import trainguard as tg
    from trainguard.storage.local import DIRECT_IO_ALIGN, DIRECT_IO_MIN_BYTES, direct_io_supported

    torch.manual_seed(1)
    model = make_model(dataclasses.replace(sizes, mlp_layers=1), device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, sizes.mlp_width, device=device)
    for _ in range(2):
        train_step(model, opt, x)
    base = torch.randn(6, 10, device=device)
    loose = {
        "bf16": torch.randn(33, device=device).to(torch.bfloat16),
        "fp16": torch.randn(7, 5, device=device).half(),
        "int8": torch.randint(-128, 127, (100,), device=device, dtype=torch.int8),
        "bool": torch.rand(17, device=device) > 0.5,
        "int64": torch.arange(9, device=device) * 3,
        "view": base.t()[2:5],  # a non-contiguous view
        "fp32": torch.randn(1 << 18, device=device),  # 1 MiB: its staging buffer is written without a copy
    }
    checks: dict[str, bool] = {}
    counted = False
    direct: dict[str, Any] = {}
    for mode, async_save in (("sync", False), ("async", True)):
        state = {"model": model, "optim": opt, "rng": tg.RNGState(), "loose": loose}
        with tg.CheckpointManager(root / mode, async_save=async_save) as mgr:
            saved = mgr.save(1, state).wait()
            if async_save:
                bufs = [  # the buffers the async save just wrote its chunks from
                    b
                    for st in mgr._stager.sets  # noqa: SLF001 - a benchmark of trainguard's own staging
                    for b in st.buffers.values()
                    if b.numel() * b.element_size() >= DIRECT_IO_MIN_BYTES
                ]
                direct = {
                    "buffers": len(bufs),
                    "aligned": sum(b.data_ptr() % DIRECT_IO_ALIGN == 0 for b in bufs),
                    "scratch_direct_io": direct_io_supported(root / mode),
                }
            want_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
            want_optim = [
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for s in opt.state.values()
            ]
            want_draw = torch.randn(16, device=device)  # the first draw after the save
            for _ in range(2):
                train_step(model, opt, x)  # moves weights, optimizer state and the device RNG
            live_loose = {k: torch.zeros_like(v) for k, v in loose.items()}
            live_loose["view"] = torch.zeros(6, 10, device=device).t()[2:5]  # a non-contiguous destination
            live = {"model": model, "optim": opt, "rng": tg.RNGState(), "loose": live_loose}
            assert mgr.restore(1, live) == 1
            draw = torch.randn(16, device=device)
        got_optim = list(opt.state.values())
        checks[f"{mode}: model"] = all(
            torch.equal(model.state_dict()[k], v) and model.state_dict()[k].device == v.device
            for k, v in want_model.items()
        )
        checks[f"{mode}: optimizer state"] = len(got_optim) == len(want_optim) and all(
            all(
                torch.equal(g[k], v) and g[k].device == v.device if isinstance(v, torch.Tensor) else g[k] == v
                for k, v in w.items()
            )
            for g, w in zip(got_optim, want_optim, strict=True)
        )
        checks[f"{mode}: tensors of 7 dtypes"] = all(
            torch.equal(live_loose[k], v) and live_loose[k].device == v.device for k, v in loose.items()
        )
        checks[f"{mode}: {device.type} RNG"] = torch.equal(draw, want_draw)
        if mode == "sync":  # a synchronous save reads the device tensors themselves: their bytes count
            model_bytes = sum(v.numel() * v.element_size() for v in want_model.values())
            counted = saved.logical_bytes >= model_bytes
    return checks, counted, direct


# -- 6. a DTensor on the device ------------------------------------------------------------------------------------
def dtensor_async(sizes: Sizes, device: Any, root: Path) -> dict[str, Any]:
    """An async save of a DTensor on a one-rank mesh of ``device`` (a process group must exist): the device
    memory allocated must not grow by its bytes while the save persists, and the restore is bit-exact."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    import trainguard as tg

    mesh = DeviceMesh(device.type, [0])
    n = sizes.width * sizes.width * 16  # 64 MiB of fp32 at the full size
    local = torch.randn(n, device=device)
    src = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    nbytes_ = n * 4
    cuda = device.type == "cuda"
    with tg.CheckpointManager(root, async_save=True) as mgr:
        mgr.save(1, {"w": src}).wait()  # the first save allocates the buffers
        with torch.no_grad():
            local.add_(1.0)
        sync(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        pending = mgr.save(2, {"w": src})
        during = torch.cuda.memory_allocated(device) if cuda else 0
        pending.wait()
        want = local.clone()
        with torch.no_grad():
            local.zero_()
        live = {"w": DTensor.from_local(torch.zeros_like(local), mesh, [Replicate()], run_check=False)}
        assert mgr.restore(2, live) == 2
    got = live["w"].to_local()
    out: dict[str, Any] = {"dtensor_bytes": nbytes_, "device_growth_bytes": during - before}
    out["no_device_copy"] = during - before < nbytes_ // 2
    out["exact"] = torch.equal(got, want) and got.device == want.device
    return out


# -- 5. the training loop ---------------------------------------------------------------------------------------
RAW_CHILD = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
view = memoryview(mmap.mmap(fd, int(sys.argv[2]), prot=mmap.PROT_READ))
for line in sys.stdin:
    try:
        with open(line.rstrip("\\n"), "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())
        print("ok", flush=True)
    except OSError as e:
        print(f"error {e}", flush=True)
"""
"""The raw write process: maps the parent's shared staging file read-only, then for every path on stdin writes
the whole mapping to that file, fsyncs it and answers ``ok`` (no torch: it starts in milliseconds)."""


class RawProcess:
    """The floor of a persist *process*: one contiguous host buffer in a shared-memory file (pinned with
    ``cudaHostRegister`` on CUDA, as DCP's shared-memory stager pins), every tensor copied into its slice with
    non-blocking copies and one synchronize, then a child process started once (``RAW_CHILD``) writes the
    buffer to one file and fsyncs it. The training process's only part in the persist is one line on a pipe
    and a thread blocked reading the answer (no GIL held), so what it still costs the loop is the machine's
    (memory bandwidth, the sandbox's syscalls), not the interpreter's."""

    def __init__(self, flat: dict[str, Any], device: Any, folder: Path) -> None:
        import mmap
        import subprocess

        import torch

        self.offsets: dict[str, int] = {}
        total = 0
        for k, t in flat.items():
            self.offsets[k] = total
            total += -(-t.numel() * t.element_size() // 64) * 64  # 64-byte aligned slices
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else folder
        fd, name = tempfile.mkstemp(prefix="bench_gpu-raw-", dir=shm)
        self.path, self.size = Path(name), total
        os.ftruncate(fd, total)
        self.mm = mmap.mmap(fd, total)
        os.close(fd)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base.zero_()  # first touch outside the timed region
        self.pinned = False
        if device.type == "cuda":  # flag 1: cudaHostRegisterPortable, as torch.cuda._pin_memory_utils
            rc = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), total, 1)
            self.pinned = int(rc) == 0
            if not self.pinned:  # the runtime keeps the error for the next launch check: take it off here
                with contextlib.suppress(RuntimeError):
                    torch.ones(1, device=device).add_(1)
                    torch.cuda.synchronize(device)
                log(f"raw write process: cudaHostRegister returned {int(rc)}; its buffer is not pinned")
        self.views = {
            k: self.base[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for (k, o), t in zip(self.offsets.items(), flat.values(), strict=True)
        }
        self.child = subprocess.Popen(
            [sys.executable, "-c", RAW_CHILD, str(self.path), str(total)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def write(self, path: Path) -> None:
        """Ask the child to write the buffer to ``path`` and wait for its answer (runs in a waiting thread)."""
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(f"{path}\n")
        self.child.stdin.flush()
        answer = self.child.stdout.readline().strip()
        if answer != "ok":
            raise OSError(f"the raw write process answered {answer or 'nothing (it exited)'!r} for {path}")

    def close(self) -> None:
        import torch

        if self.child.poll() is None:
            assert self.child.stdin is not None
            self.child.stdin.close()
            self.child.wait(timeout=30)
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self.pinned = False
        self.views.clear()
        del self.base
        with contextlib.suppress(BufferError):  # a view still alive somewhere: the mapping goes with it
            self.mm.close()
        self.path.unlink(missing_ok=True)


class Loop:
    """One model trained continuously; each method saves at its segments' first step."""

    def __init__(self, sizes: Sizes, device: Any, root: Path) -> None:
        import concurrent.futures

        import torch

        import trainguard as tg

        self.device = device
        self.model = make_model(sizes, device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(sizes.batch, sizes.mlp_width, device=device)
        self.state = {"model": self.model, "optim": self.opt}
        self.every = sizes.every
        self.methods = sizes.methods
        for _ in range(2):
            train_step(self.model, self.opt, self.x)  # AdamW state exists from here on
        self.mgr = tg.CheckpointManager(root / "tg", async_save=True, keep=2)
        self.mgr_1thread: Any = None
        if "tg_1thread" in sizes.methods:
            # the same save with one background writer thread (default: 4 on 5+ CPUs): is it the threads?
            self.mgr_1thread = tg.CheckpointManager(root / "tg1", async_save=True, keep=2)
            ctx = self.mgr_1thread.ctx
            ctx.options = dataclasses.replace(ctx.options, threads=1)
        self.root = root
        self.dcp_root = root / "dcp"
        self.stager = self._dcp_stager()
        self.stager_name = (
            type(self.stager).__name__
            if self.stager is not None
            else "none (this torch has no DefaultStager)"
        )
        self.process_stager: Any = None
        self.process_stager_name = "not run"
        if "dcp_process" in sizes.methods:
            self.process_stager = self._dcp_stager(shared=True)
            self.process_stager_name = (
                type(self.process_stager).__name__ + " (shared memory)"
                if self.process_stager is not None
                else "none (this torch has no DefaultStager)"
            )
        self.step = 0
        self.raw_bufs: dict[str, Any] | None = None
        self.raw_process: RawProcess | None = None
        self.raw_process_pinned: bool | None = None
        self.raw_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raw-persist")

    def _dcp_stager(self, shared: bool = False) -> Any:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # an older torch: async_save takes no stager
            return None

        cuda = self.device.type == "cuda"
        # a CPU-only build cannot pin: NOTES.md (DefaultStager's defaults fail there)
        return DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=shared,  # a persist process reads the staged tensors without a copy
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )

    def _flat(self) -> dict[str, Any]:
        """The loop's tensors by name: the model's state_dict and every tensor of the optimizer's state."""
        import torch

        flat = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            flat.update({f"optim.{pid}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
        return flat

    def _stage(self, flat: dict[str, Any], bufs: dict[str, Any]) -> None:
        pin = self.device.type == "cuda"
        for k, t in flat.items():
            bufs[k].copy_(t, non_blocking=pin and t.device.type == "cuda")
        sync(self.device)

    def _raw_save(self, piece: int | None = None) -> Any:
        """The floor of any async save: every tensor copied into reused (pinned on CUDA) host buffers with
        non-blocking copies and one synchronize, then one background thread writes their bytes to one file
        and fsyncs it (one ``write`` per tensor, or per ``piece`` bytes of it). No format, no checksum, no
        commit."""
        import torch

        flat = self._flat()
        pin = self.device.type == "cuda"
        if self.raw_bufs is None:
            self.raw_bufs = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in flat.items()}
        bufs = self.raw_bufs
        self._stage(flat, bufs)
        path = self.dcp_root / f"raw-{self.step}.bin"

        def persist() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                for b in bufs.values():
                    data = b.reshape(-1).view(torch.uint8).numpy().data
                    step = piece or len(data) or 1
                    for off in range(0, len(data), step):
                        f.write(data[off : off + step])
                f.flush()
                os.fsync(f.fileno())

        return self.raw_pool.submit(persist)

    def _raw_process_save(self) -> Any:
        """:class:`RawProcess`: the same staging copy, the write in a child process."""
        flat = self._flat()
        if self.raw_process is None:
            self.raw_process = RawProcess(flat, self.device, self.root)
            self.raw_process_pinned = self.raw_process.pinned
        self._stage(flat, self.raw_process.views)
        path = self.dcp_root / f"rawp-{self.step}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        return self.raw_pool.submit(self.raw_process.write, path)

    def _dcp_save(self, process: bool) -> Any:
        """``dcp.async_save`` with the reused stager (``process``: the shared-memory one, and DCP's persist
        process, ``AsyncCheckpointerType.PROCESS``); without a stager once the stager raised."""
        import torch
        import torch.distributed.checkpoint as dcp

        d = self.dcp_root / f"step-{self.step}"
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        kw: dict[str, Any] = {}
        if process:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kw["async_checkpointer_type"] = AsyncCheckpointerType.PROCESS
        attr = "process_stager" if process else "stager"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stager = getattr(self, attr)
            if stager is not None:
                try:
                    fut = dcp.async_save(
                        state, storage_writer=dcp.FileSystemWriter(str(d)), async_stager=stager, **kw
                    )
                    return getattr(fut, "upload_completion", fut)
                except Exception as e:  # noqa: BLE001 - seen on torch 2.11 + CUDA: KeyError <class 'type'>
                    setattr(self, attr, None)
                    name = (
                        f"none: DefaultStager raised {type(e).__name__}: {e} on torch {torch.__version__}, "
                        "so dcp.async_save ran without a stager"
                    )
                    setattr(self, attr + "_name", name)
                    log(name)
                    shutil.rmtree(d, ignore_errors=True)
            fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(d)), **kw)
        return getattr(fut, "upload_completion", fut)

    def save(self, method: str) -> Any:
        if method == "tg_async":
            return self.mgr.save(self.step, self.state)
        if method == "tg_1thread":
            return self.mgr_1thread.save(self.step, self.state)
        if method == "raw_thread":
            return self._raw_save()
        if method == "raw_thread_1m":
            return self._raw_save(piece=1 << 20)
        if method == "raw_process":
            return self._raw_process_save()
        if method in ("dcp_async", "dcp_process"):
            return self._dcp_save(process=method == "dcp_process")
        return None

    def segment(self, method: str, steps: int | None = None) -> float:
        """Seconds of one segment of ``steps`` (default ``every``) steps saving with ``method`` at its first
        step; what the segment was made of goes to :attr:`last` (see :meth:`_timeline`)."""
        import torch

        cuda = self.device.type == "cuda"
        marks: list[Any] = []  # per step: (start, end) CUDA events, or host perf_counter() on CPU
        sync(self.device)
        t0 = time.perf_counter()
        pending = None
        block_s = b0 = 0.0
        done_at: list[float] = []
        for i in range(steps or self.every):
            self.step += 1
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            else:
                ev = [time.perf_counter(), 0.0]
            train_step(self.model, self.opt, self.x)
            if cuda:
                ev[1].record()
            else:
                ev[1] = time.perf_counter()
            marks.append(ev)
            if i == 0:
                b0 = time.perf_counter()
                pending = self.save(method)
                block_s = time.perf_counter() - b0
                if method in FUTURE_METHODS and hasattr(pending, "add_done_callback"):
                    pending.add_done_callback(lambda _f: done_at.append(time.perf_counter()))
        persist_s = None
        if method in ("tg_async", "tg_1thread"):
            pending.wait()
            persist_s = pending.persist_s
        elif method in FUTURE_METHODS:
            pending.result()
            persist_s = (done_at[0] if done_at else time.perf_counter()) - (b0 + block_s)
        sync(self.device)
        seconds = time.perf_counter() - t0
        if method in FUTURE_METHODS:
            shutil.rmtree(self.dcp_root, ignore_errors=True)
        self.last = {"seconds": seconds, "block_s": block_s, "persist_s": persist_s, **self._timeline(marks)}
        return seconds

    def _timeline(self, marks: list[Any]) -> dict[str, Any]:
        """Per step: the device time from the step's first launch to its last kernel's end (``step_ms``: a
        step whose launches came late, e.g. a training thread waiting for the GIL, takes longer) and the idle
        time before the next step (``gap_ms``)."""
        if self.device.type == "cuda":
            step_ms = [a.elapsed_time(b) for a, b in marks]
            gap_ms = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(len(marks) - 1)]
        else:
            step_ms = [(b - a) * 1e3 for a, b in marks]
            gap_ms = [(marks[i + 1][0] - marks[i][1]) * 1e3 for i in range(len(marks) - 1)]
        return {"step_ms": step_ms, "gap_ms": gap_ms}

    def close(self) -> None:
        self.mgr.close()  # a second call does nothing
        if self.mgr_1thread is not None:
            self.mgr_1thread.close()
        self.raw_pool.shutdown()
        if self.raw_process is not None:
            self.raw_process.close()
            self.raw_process = None
        if "dcp_process" in self.methods:
            # DCP's persist process lives as long as this process unless told to stop
            from torch.distributed.checkpoint import _async_process_executor as ape

            proc, ape._CHECKPOINT_PROCESS = getattr(ape, "_CHECKPOINT_PROCESS", None), None
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.__del__()


def loop_overheads(sizes: Sizes, device: Any, root: Path) -> dict[str, Any]:
    import torch.distributed as dist

    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{root / 'pg'}")
    loop = Loop(sizes, device, root)
    dtensor: dict[str, Any] = {}
    methods = list(sizes.methods)
    failed: dict[str, str] = {}  # a method besides the required ones that raised: reported, left out after
    try:
        per_round: list[dict[str, float]] = []
        details: list[dict[str, Any]] = []
        for r in range(sizes.rounds + 1):  # round 0 is a warm-up, of shorter segments
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            seg, det = {}, {}
            for m in order:
                try:
                    seg[m] = loop.segment(m, None if r else sizes.warmup_steps)
                except Exception as e:
                    if m in REQUIRED_METHODS:
                        raise
                    failed[m] = f"{type(e).__name__}: {e}"
                    log(f"{LABELS[m]} failed, left out of the later rounds:\n{traceback.format_exc()}")
                    methods.remove(m)
                    for d in (*per_round, *details):
                        d.pop(m, None)
                    continue
                det[m] = loop.last
            if r:
                per_round.append(seg)
                details.append(det)
        loop.close()
        log("DTensor async save on a one-rank mesh ...")
        try:
            dtensor = dtensor_async(sizes, device, root / "dtensor")
        except Exception as e:  # noqa: BLE001 - reported, the loop's figures are kept
            dtensor = {"error": f"{type(e).__name__}: {e}"}
            log(traceback.format_exc())
    finally:
        loop.close()
        dist.destroy_process_group()
    out: dict[str, Any] = {"segments_s": per_round, "dtensor": dtensor, "dcp_stager": loop.stager_name}
    out["methods"], out["failed"] = [m for m in METHODS if m in methods], failed
    if "dcp_process" in sizes.methods:
        out["dcp_process_stager"] = loop.process_stager_name
    if "raw_process" in sizes.methods:
        out["raw_process_pinned"] = loop.raw_process_pinned
    for m in out["methods"][1:]:
        out[m] = statistics.median(s[m] / s["none"] - 1 for s in per_round)
    out["step_s"] = statistics.median(s["none"] for s in per_round) / sizes.every
    out["where"] = where_the_time_goes(details)
    return out


def where_the_time_goes(details: list[dict[str, Any]]) -> dict[str, Any]:
    """Per saving method, the round whose extra time over the same round's ``none`` segment is the median
    (its parts add up): seconds blocked in ``save()``, the persist's seconds, the extra device time inside
    steps, between steps and besides (ms), and the steps slowed most (index in the segment, extra ms; medians
    over rounds). Tells a persist that outlasts the interval (extra time at the segment's end) from training
    steps slowed while it runs (extra time inside the steps)."""
    out: dict[str, Any] = {}
    for m in [m for m in METHODS[1:] if m in details[0]]:
        rows = []
        for d in details:
            base, cur = d["none"], d[m]
            extra = [a - b for a, b in zip(cur["step_ms"], base["step_ms"], strict=True)]
            extra_s = cur["seconds"] - base["seconds"]
            inside, between = sum(extra), sum(cur["gap_ms"]) - sum(base["gap_ms"])
            rows.append(
                {
                    "block_s": cur["block_s"],
                    "persist_s": cur["persist_s"],
                    "extra_in_steps_ms": inside,
                    "extra_between_steps_ms": between,
                    "extra_rest_ms": extra_s * 1e3 - inside - between,
                    "extra_s": extra_s,
                    "slowest": sorted(range(len(extra)), key=lambda i: -extra[i])[:3],
                    "extra_ms": extra,
                }
            )
        # the parts of the median round (by its extra seconds), so that they add up to its total
        mid = sorted(rows, key=lambda r: r["extra_s"])[(len(rows) - 1) // 2]
        med = {
            k: mid[k]
            for k in (
                "block_s",
                "persist_s",
                "extra_in_steps_ms",
                "extra_between_steps_ms",
                "extra_rest_ms",
                "extra_s",
            )
        }
        # steps slowed, summed over rounds: where in the segment the time went
        n = len(rows[0]["extra_ms"])
        per_step = [statistics.median(r["extra_ms"][i] for r in rows) for i in range(n)]
        med["slowest_steps"] = [
            [i, round(per_step[i], 1)] for i in sorted(range(n), key=lambda i: -per_step[i])[:5]
        ]
        med["rounds"] = [{k: v for k, v in r.items() if k != "extra_ms"} for r in rows]
        out[m] = med
    return out


# -- report -------------------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def run(device_name: str, sizes: Sizes, scratch: Path, json_path: str | None = None) -> dict[str, Any]:
    """Every phase in turn; the figures so far are written to ``json_path`` after each one, and a phase that
    raises is recorded in ``errors`` (the later phases still run)."""
    import torch

    device = torch.device(device_name)
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device (set_device needs an index since torch 2.11)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # the current device: where DCP's stager and the default streams sync
    t_start = time.perf_counter()
    res: dict[str, Any] = {"device": device_name, "sizes": vars(sizes), "errors": {}}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)
        res["torch"] = torch.__version__

    def write_json() -> None:
        if json_path:
            import json

            Path(json_path).write_text(json.dumps(res, indent=2, default=str) + "\n")

    def phase(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported; the next phase runs
            res["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"{name} failed: {res['errors'][name]}\n{traceback.format_exc()}")
        res["total_s"] = time.perf_counter() - t_start
        try:
            write_json()
        except OSError as e:  # main checks the path first; a disk full since must not lose the run
            log(f"--json {json_path}: {e}")

    def stall() -> None:
        state = layer_state(sizes, device)
        res["state_bytes"] = n = nbytes(state)
        log(f"state {n / 1e9:.3f} GB on {device_name}; copy floor ...")
        res["copy_s"] = copy_floor(state, device)
        log("async save stall and pinned buffers ...")
        res.update(stall_and_pinning(state, sizes, device, scratch / "stall"))

    def exact() -> None:
        log("bit-exact save and restore ...")
        res["exact"], res["counts_device_bytes"], res["direct_path"] = bit_exact(
            sizes, device, scratch / "exact"
        )

    def loop() -> None:
        log("training loop with each method ...")
        res["loop"] = loop_overheads(sizes, device, scratch / "loop")
        dt = res["loop"].get("dtensor", {})
        if "exact" in dt:
            res.setdefault("exact", {})["DTensor async save (one-rank mesh)"] = dt["exact"]

    phase("stall", stall)
    phase("exact", exact)
    phase("loop", loop)
    return res


def report(res: dict[str, Any]) -> list[str]:
    lines = [f"ERROR in phase {name}: {err}" for name, err in res.get("errors", {}).items()]
    if "stall_s" not in res or "exact" not in res or "tg_async" not in res.get("loop", {}):
        return [*lines, "incomplete run: see the errors above; figures so far in --json"]
    gb = res["state_bytes"] / 1e9
    stall_x = res["stall_s"] / res["copy_s"]
    cuda = res["device"].startswith("cuda")
    lines += [
        f"# device {res['device']}{' (' + res['gpu'] + ')' if 'gpu' in res else ''}; state {gb:.3f} GB; "
        f"total {res['total_s']:.1f} s",
        f"device-to-host copy floor   {res['copy_s'] / gb:8.4f} s/GB  ({gb / res['copy_s']:.2f} GB/s)",
        f"async save blocking stall   {res['stall_s'] / gb:8.4f} s/GB  ({stall_x:.2f}x the floor; saves after the "
        f"first: {', '.join(f'{s:.4f}' for s in res['stalls_s'])} s)",
        f"staging buffers             {res['staging_bytes'] / 1e9:8.3f} GB, pinned {res['pinned_bytes'] / 1e9:.3f} GB",
    ]
    loop = res["loop"]
    lines.append(
        f"training loop: {loop['step_s'] * 1e3:.2f} ms/step, one save per {res['sizes']['every']} steps"
    )
    for m in loop.get("methods", METHODS[:4])[1:]:
        lines.append(f"  {LABELS[m]:<27} overhead {loop[m]:+.2%}")
        w = loop.get("where", {}).get(m)
        if w:
            persist = "?" if w["persist_s"] is None else f"{w['persist_s']:.2f} s"
            lines.append(
                f"    blocked {w['block_s'] * 1e3:.1f} ms, persist {persist}; vs none: "
                f"{w['extra_s']:+.3f} s, of it {w['extra_in_steps_ms']:+.0f} ms inside steps and "
                f"{w['extra_between_steps_ms']:+.0f} ms between steps ({'device' if cuda else 'host'} time), "
                f"{w['extra_rest_ms']:+.0f} ms besides (mostly the wait for the persist at the segment's end; "
                "the median round); steps slowed most (median over rounds) "
                + (", ".join(f"#{i} {ms:+.0f} ms" for i, ms in w["slowest_steps"] if round(ms) > 0) or "none")
            )
    lines.append(f"  dcp.async_save's stager: {loop.get('dcp_stager')}")
    if "dcp_process_stager" in loop:
        lines.append(f"  dcp.async_save (process)'s stager: {loop['dcp_process_stager']}")
    if "raw_process_pinned" in loop and loop["raw_process_pinned"] is not None:
        pinned = "pinned (cudaHostRegister)" if loop["raw_process_pinned"] else "not pinned"
        lines.append(f"  raw write process's shared buffer: {pinned}")
    for m, err in loop.get("failed", {}).items():
        lines.append(f"ERROR in the loop's {LABELS[m]} (left out after it): {err}")
    if "error" in loop.get("dtensor", {}):
        lines.append(f"ERROR in the DTensor phase: {loop['dtensor']['error']}")
    lines.append("")
    lines.append(
        f"{verdict(stall_x <= TARGET_STALL_X)} blocking stall <= {TARGET_STALL_X}x the copy floor: {stall_x:.2f}x"
    )
    staging_ok = res["staging_bytes"] <= 2 * res["state_bytes"] + (1 << 20)
    pinned_ok = res["pinned_bytes"] == res["staging_bytes"] if cuda else res["pinned_bytes"] == 0
    lines.append(
        f"{verdict(staging_ok and pinned_ok)} staging buffers {'all pinned' if cuda else 'unpinned on CPU'} and "
        f"<= 2 sets: {res['staging_bytes'] / max(res['state_bytes'], 1):.2f}x the state, "
        f"{res['pinned_bytes'] / max(res['staging_bytes'], 1):.0%} pinned"
    )
    tg_o = loop["tg_async"]
    lines.append(
        f"{verdict(tg_o < TARGET_OVERHEAD)} trainguard async overhead < {TARGET_OVERHEAD:.0%}: {tg_o:+.2%}"
    )
    if "dcp_async" in loop:
        lines.append(
            f"{verdict(tg_o <= loop['dcp_async'])} trainguard async overhead <= dcp.async_save's in the same "
            f"run: {tg_o:+.2%} vs {loop['dcp_async']:+.2%}"
        )
    else:
        lines.append(
            "not measured: trainguard async overhead <= dcp.async_save's (dcp_async not in --methods)"
        )
    if "raw_thread" in loop:
        lines.append(
            f"info trainguard async overhead vs a raw write thread's (the floor of any async save here): "
            f"{tg_o:+.2%} vs {loop['raw_thread']:+.2%}"
        )
    if "raw_thread" in loop and "raw_process" in loop:
        lines.append(
            "info a persist process instead of a thread, raw floors: "
            f"{loop['raw_process']:+.2%} vs {loop['raw_thread']:+.2%} (a process is worth building when its "
            "floor is clearly below the thread's and trainguard's overhead is near the thread's floor)"
        )
    if "raw_thread" in loop and "raw_thread_1m" in loop:
        lines.append(
            "info a raw write thread writing 1 MiB pieces instead of whole tensors: "
            f"{loop['raw_thread_1m']:+.2%} vs {loop['raw_thread']:+.2%} (if clearly lower, beyond the rounds' "
            "spread: long writes stall the training thread, and trainguard's persist should write in pieces; "
            "the same write calls for tensors of 1 MiB or less)"
        )
    dp = res.get("direct_path")
    if dp:
        both = dp["buffers"] and dp["aligned"] == dp["buffers"] and dp["scratch_direct_io"]
        lines.append(
            f"info the async save's staging buffers of 1 MiB or more: {dp['aligned']} of {dp['buffers']} on a "
            f"4 KiB boundary, scratch takes O_DIRECT: {'yes' if dp['scratch_direct_io'] else 'no'} -> chunks "
            + (
                "written straight from them (no bounce copy)"
                if both
                else "copied through bounce buffers or the page cache"
            )
        )
    lines.append(
        f"{verdict(res['counts_device_bytes'])} a synchronous save counts the device tensors' bytes "
        "(SaveResult.logical_bytes)"
    )
    d = loop.get("dtensor", {})
    if "no_device_copy" in d:
        lines.append(
            f"{verdict(d['no_device_copy'])} a DTensor's async save keeps no device copy of its shard while it "
            f"persists: device memory grew {d['device_growth_bytes'] / 1e6:.1f} MB for a "
            f"{d['dtensor_bytes'] / 1e6:.1f} MB DTensor"
        )
    for name, ok in res["exact"].items():
        lines.append(f"{verdict(ok)} bit-exact restore, {name}")
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (default; SKIP without one) or cpu (logic check)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: seconds on a CPU (the test runs this)")
    ap.add_argument("--json", metavar="FILE", help="also write every figure as JSON to FILE")
    ap.add_argument(
        "--every",
        type=int,
        metavar="N",
        help="steps per segment of the training loop, one save each (default: 100; 4 with --tiny)",
    )
    ap.add_argument("--scratch", help="folder for the checkpoints (default: a temp folder, removed after)")
    ap.add_argument(
        "--methods",
        metavar="M,M",
        help=f"the training loop's saving methods, comma-separated, from {', '.join(METHODS[1:])} "
        f"(default: {','.join(DEFAULT_METHODS[1:])}; none and tg_async are always run)",
    )
    ap.add_argument(
        "--require-cuda",
        action="store_true",
        help="exit 3 instead of printing SKIP when CUDA is missing (a device run: SKIP there means the wrong python)",
    )
    return ap.parse_args(argv)


@contextlib.contextmanager
def scratch_dir(parent: str | None) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="bench_gpu-", dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def valid_device(device: str) -> bool:
    """Whether ``device`` is ``cpu``, ``cuda`` or ``cuda:N`` (N a non-negative integer)."""
    return device in ("cpu", "cuda") or (
        device.startswith("cuda:") and device[5:].isascii() and device[5:].isdecimal()
    )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import torch

    if not valid_device(a.device):
        print(f"--device must be cuda, cuda:N or cpu, got {a.device!r}", file=sys.stderr)
        return 2
    if a.every is not None and a.every < 2:
        print(f"--every must be at least 2 steps, got {a.every}", file=sys.stderr)
        return 2
    methods: tuple[str, ...] = DEFAULT_METHODS
    if a.methods is not None:
        asked = {m.strip() for m in a.methods.split(",") if m.strip()}
        unknown = sorted(asked - set(METHODS))
        if unknown:
            print(
                f"--methods: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS[1:])}",
                file=sys.stderr,
            )
            return 2
        methods = tuple(m for m in METHODS if m in asked or m in REQUIRED_METHODS)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        if a.require_cuda:
            print(
                f"ERROR: --require-cuda, but torch {torch.__version__} at {sys.executable} sees no CUDA device "
                "(torch.cuda.is_available() is False): run on the GPU machine, with the python whose torch is a "
                "CUDA build",
                file=sys.stderr,
            )
            return 3
        print(
            f"SKIP: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); "
            "run on a GPU machine, or with --device cpu --tiny to check the logic"
        )
        return 0
    if a.device.startswith("cuda:") and int(a.device[5:]) >= torch.cuda.device_count():
        print(
            f"--device {a.device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
            f"cuda:0 to cuda:{torch.cuda.device_count() - 1}",
            file=sys.stderr,
        )
        return 2
    if a.scratch is not None and not Path(a.scratch).is_dir():
        print(
            f"--scratch {a.scratch}: not a folder; give an existing folder for the checkpoints",
            file=sys.stderr,
        )
        return 2
    sizes = TINY if a.tiny else FULL
    if a.every is not None:
        sizes = dataclasses.replace(sizes, every=a.every)
    sizes = dataclasses.replace(sizes, methods=methods)
    try:
        probe = tempfile.mkdtemp(prefix="bench_gpu-probe-", dir=a.scratch)
    except OSError as e:
        print(f"--scratch {a.scratch}: cannot create a folder in it ({e.strerror or e})", file=sys.stderr)
        return 2
    os.rmdir(probe)
    if a.json:
        try:
            Path(a.json).write_text("{}\n")
        except OSError as e:
            print(
                f"--json {a.json}: cannot write it ({e.strerror or e}); give a writable file path",
                file=sys.stderr,
            )
            return 2
    with scratch_dir(a.scratch) as scratch:
        res = run(a.device, sizes, scratch, a.json)
    print("\n".join(report(res)))
    if res["errors"]:
        return 1
    return 0 if all(res["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
