"""Worker of the distributed tests, run by ``torchrun`` (gloo, CPU): ``worker.py SCENARIO SPEC.json OUT``.

Every rank writes ``OUT/<SCENARIO>-rank<r>.json`` (its observations, or ``{"error": traceback}``); the test
asserts on them. Scenarios:

- ``save``: train a tiny FSDP2 model (AdamW, stepped) with a sharded ResumableLoader, saving asynchronously
  every 2 steps; rank 0 writes the full (unsharded) model and optimizer state of every saved step to
  ``ref-<step>.pt`` beside the run root.
- ``load``: restore each given root at this world size into a fresh model and an optimizer that never
  stepped, compare the full state with the reference, then consume the rest of the loader's epoch.
- ``fail``: rank 1's chunk writes fail in the middle of a save (async, then sync saves), then rank 0's
  manifest publish fails; each failed save is followed by one that must succeed. Last, a save whose background
  commit waits on rank 1's writes while the training loop keeps running collectives.
- ``bf16``: bf16 Adam moments of FSDP2-sharded fp32 parameters restore as saved (issue 16).
- ``corrupt``: save steps A < B, flip a bit in a chunk only B references that holds a shard written by rank 1,
  restore: every rank must fall back to A together.
- ``orphans``: the last rank's chunk writes fail with ENOSPC in the save of step 2 while the other ranks write
  theirs; rank 0 then records the chunk files no checkpoint references and the listing; step 3 saves.
- ``perrank``: every rank saves state whose values differ per rank (a Stateful cursor, plain values, plain
  tensors, nested dicts) beside replicated ones, then restores into fresh objects at the same world size.
- ``perrank_load``: restore such a root at another world size, without a reshard hook (must raise naming the
  keys) and with ``tg.PerRank(obj, reshard=fn)``.
- ``collectives``: trainguard's groups inherit the init_process_group timeout (or ``dist_timeout_s``); rank 0
  alone opens a read-only manager and restores while the other ranks wait; a save whose peers never join fails
  on rank 0 within ``dist_timeout_s``.
"""

from __future__ import annotations

import datetime
import enum
import errno
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

import trainguard as tg
from trainguard.catalog import read_manifest, scan
from trainguard.format import TensorEntry, step_dir_name
from trainguard.incremental.chunkstore import ChunkStore
from trainguard.integrity.verify import verify
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, LocalStorage

DATASET_SIZE = 108  # the rest of the epoch after 4 steps at 2 or 4 ranks splits evenly over 1-4 ranks
BATCH = 3


# -- the job: a tiny MLP, sharded with FSDP2 ------------------------------------------------------------------
class Net(nn.Module):
    """Widths 70 and 7 shard unevenly over 3 and 4 ranks; ``scale`` is a replicated buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 70)
        self.l2 = nn.Linear(70, 70)
        self.l3 = nn.Linear(70, 7)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x))))) * self.scale


class Ids(torch.utils.data.Dataset):
    """Sample i is the tensor ``i`` (so what a rank consumed is visible in its batches)."""

    def __len__(self) -> int:
        return DATASET_SIZE

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


FEATURES = torch.randn(DATASET_SIZE, 16, generator=torch.Generator().manual_seed(1))


def build(rank: int, ws: int, optim_cls: Any = torch.optim.AdamW, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)  # same initial weights on every rank, as a real job has before fully_shard
    model = Net()
    for m in (model.l1, model.l2, model.l3):
        fully_shard(m)
    fully_shard(model)
    optim = optim_cls(model.parameters(), lr=0.01)
    torch.manual_seed(100 + rank)  # ranks draw different numbers: RNGState must restore each rank's own
    loader = tg.ResumableLoader(Ids(), batch_size=BATCH, shuffle=True, seed=5, rank=rank, world_size=ws)
    state = {
        "app": tg.ModelOptimizerState(model, optim),
        "rng": tg.RNGState(),
        "loader": loader,
        "extra": {"replicated": torch.arange(1000, dtype=torch.float32), "note": "same on every rank"},
    }
    return {"model": model, "optim": optim, "loader": loader, "state": state, "batches": iter(loader)}


def train_step(job: dict[str, Any]) -> list[int]:
    ids = next(job["batches"])
    x = FEATURES[ids] + 0.01 * torch.randn(len(ids), 16)  # draws from this rank's torch RNG
    loss = job["model"](x).square().mean()
    loss.backward()
    job["optim"].step()
    job["optim"].zero_grad()
    return [int(i) for i in ids]


def full_state(job: dict[str, Any]) -> dict[str, Any]:
    """The unsharded model and optimizer state (collective; full on rank 0, empty elsewhere)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(job["model"], job["optim"], options=opts)
    return {"model": msd, "optim": osd}


def flat_items(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flat_items(v, f"{prefix}{k}/"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flat_items(v, f"{prefix}{i}/"))
        return out
    return {prefix.rstrip("/"): obj}


def differences(got: Any, want: Any) -> list[str]:
    """Paths where ``got`` and ``want`` differ (tensors bitwise, with dtype and shape)."""
    a, b = flat_items(got), flat_items(want)
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x, y)
            )
        else:
            same = x == y
        if not same:
            diff.append(k)
    return diff


def rng_digest() -> str:
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


# -- scenarios -------------------------------------------------------------------------------------------------
def scenario_save(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    job = build(rank, ws)
    mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(2))
    consumed: list[int] = []
    saved: dict[int, dict[str, Any]] = {}
    pendings = []
    for step in range(1, spec["steps"] + 1):
        consumed += train_step(job)
        pending = mgr.maybe_save(step, job["state"])
        if pending is not None:
            pendings.append(pending)
            saved[step] = {"rng": rng_digest(), "loader": job["loader"].state_dict()}
            full = full_state(job)
            if rank == 0:
                torch.save(full, root.parent / f"ref-{step}.pt")
    results = [p.wait() for p in pendings]
    mgr.close()
    return {
        "consumed": consumed,
        "saved": saved,
        "bytes_written": {str(r.step): r.bytes_written for r in results},
        "manifest_bytes": {str(r.step): r.bytes for r in results} if rank == 0 else {},
    }


def scenario_load(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, root in spec["roots"].items():
        root = Path(root)
        job = build(rank, ws)
        mgr = tg.CheckpointManager(root, read_only=True)
        step = mgr.restore_latest(job["state"])
        mgr.close()
        full = full_state(job)
        diff = None
        if rank == 0:
            diff = differences(full, torch.load(root.parent / f"ref-{step}.pt", weights_only=True))
        rest = [int(i) for batch in job["loader"] for i in batch]  # the rest of the epoch on this rank
        res[name] = {
            "step": step,
            "differences": diff,
            "optim_steps": sorted({int(s["step"]) for s in job["optim"].state.values()}),
            "rng": rng_digest(),
            "rest": rest,
        }
    return res


class Injector:
    """Arms a fault on ``disk`` (this rank's storage of the run root, the manager's) inside the ``with`` block,
    counting what it does. ``fail``: every write raises EIO; ``enospc``: every write raises ENOSPC;
    ``fail_manifest``: the manifest's write raises EIO; ``gate``: every write first waits for ``gate``;
    ``none``: pass through."""

    def __init__(self, disk: FaultyStorage, mode: str) -> None:
        self.disk = disk
        self.mode = mode
        self.gate = threading.Event()
        self._calls_before = 0
        failure = OSError(errno.EIO, "injected write failure")
        self.fault = {
            "fail": Fault("write", times=None, exc=failure),
            "enospc": Fault("write", times=None, errno=errno.ENOSPC),
            "fail_manifest": Fault("write", match="*/manifest.json", times=None, exc=failure),
            "gate": Fault("write", times=None, stall=self.gate),
            "none": None,
        }[mode]

    @property
    def calls(self) -> int:
        return self.disk.calls["write"] - self._calls_before

    @property
    def injected(self) -> int:
        return len(self.disk.injected)

    def __enter__(self) -> Injector:
        self.disk.clear()
        self.disk.injected.clear()
        self._calls_before = self.disk.calls["write"]
        if self.fault is not None:
            self.disk.add(self.fault)
        return self

    def __exit__(self, *exc: object) -> None:
        self.disk.clear()
        self.gate.set()


def scenario_fail(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    job = build(rank, ws)
    res: dict[str, Any] = {}
    step = 0
    # (failing rank, injection, async): rank 1's chunk writes fail, or rank 0's manifest publish (the commit)
    modes = {"async": (1, "fail", True), "sync": (1, "fail", False), "commit": (0, "fail_manifest", True)}
    for mode, (bad_rank, injection, async_save) in modes.items():
        disk = FaultyStorage(LocalStorage(root))
        mgr = tg.CheckpointManager(disk, async_save=async_save, save_policy=tg.EveryNSteps(10**9))
        r: dict[str, Any] = res.setdefault(mode, {})
        step += 1
        train_step(job)
        ok_step = step
        mgr.save(ok_step, job["state"]).wait()
        step += 1
        train_step(job)
        failed_step = step
        with Injector(disk, injection if rank == bad_rank else "none") as inj:
            try:
                handle = mgr.save(failed_step, job["state"])  # sync: raises here
                r["returned"] = True
                handle.wait()  # async: raises here
                r["error"] = None
            except Exception as e:  # noqa: BLE001 - recorded for the test
                r["error"] = {
                    "type": type(e).__name__,
                    "is_save_error": isinstance(e, tg.SaveError),
                    "message": str(e),
                    "step": getattr(e, "step", None),
                    "rank_errors": {str(k): repr(v) for k, v in getattr(e, "rank_errors", {}).items()},
                }
        r["injected"] = inj.injected
        dist.barrier()
        if rank == 0:
            r["failed_step_dir"] = (root / step_dir_name(failed_step)).exists()
            rep = verify(root)
            r["verify_after_failure"] = {"ok": rep.ok, "checked": rep.checked}
        step += 1
        train_step(job)
        r["next"] = mgr.save(step, job["state"]).wait().step  # the next save succeeds on every rank
        mgr.close()
        if rank == 0:
            rep = verify(root)
            r["verify_after_next"] = {"ok": rep.ok, "checked": rep.checked}
        r["steps"] = [ok_step, failed_step, step]
    # A background commit that waits on rank 1 does not hold up the training loop's collectives.
    disk = FaultyStorage(LocalStorage(root))
    mgr = tg.CheckpointManager(disk, save_policy=tg.EveryNSteps(10**9))
    with Injector(disk, "gate" if rank == 1 else "none") as inj:
        step += 1
        train_step(job)  # new values: rank 1 has chunks to write
        handle = mgr.save(step, job["state"])
        for _ in range(3):
            train_step(job)  # FSDP all-gathers and reduce-scatters on the default group
        t = torch.ones(1)
        dist.all_reduce(t)
        done_while_training = handle.done()
        inj.gate.set()
        result = handle.wait()
    mgr.close()
    res["overlap"] = {
        "done_while_training": done_while_training,
        "all_reduce": float(t.item()),
        "committed": result.step,
        "gated_writes": inj.calls if rank == 1 else None,
    }
    return res


def scenario_corrupt(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    a, b = 2, 4
    job = build(rank, ws)
    # 4 KiB chunks: a shard of l2 (at least 17 x 70 float32) gets chunks of its own instead of a shared pack
    mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(2), chunk_size_bytes=4096)
    for step in range(1, b + 1):
        train_step(job)
        pending = mgr.maybe_save(step, job["state"])
        if pending is not None:
            full = full_state(job)
            if rank == 0:
                torch.save(full, root.parent / f"ref-{step}.pt")
    mgr.close()
    res: dict[str, Any] = {}
    if rank == 0:
        ma, mb = read_manifest(root, a), read_manifest(root, b)
        only_b = set(mb.chunks) - set(ma.chunks)
        # A chunk whose every byte belongs to shards starting past row 0 of dim-0-sharded tensors: written by
        # rank 1 (ranks never share a chunk they write) and, at the same world size, read back by rank 1 alone.
        users: dict[str, list[tuple[str, bool]]] = {}
        for e in mb.entries.values():
            segs = []
            if isinstance(e, TensorEntry):
                for sh in e.shards:
                    segs += [(seg.chunk, len(e.shards) > 1 and sh.offsets[0] > 0) for seg in sh.segments]
            elif e.segments:
                segs += [(seg.chunk, False) for seg in e.segments]
            for h, rank1 in segs:
                users.setdefault(h, []).append((e.fqn, rank1))
        candidates = sorted(h for h in only_b if all(r1 for _, r1 in users.get(h, [("", False)])))
        h = candidates[0]
        rec = mb.chunks[h]
        path = root / rec.path
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
        res["corrupted"] = {"chunk": rec.path, "hash": h, "fqns": sorted({f for f, _ in users[h]})}
    dist.barrier()
    job = build(rank, ws)
    mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(2))
    read: set[str] = set()  # chunks this rank reads (every chunk read ends in ChunkStore.readinto)
    real_readinto = ChunkStore.readinto

    def recording_readinto(self: ChunkStore, rec: Any, *a: Any, **k: Any) -> None:
        read.add(rec.hash)
        real_readinto(self, rec, *a, **k)

    ChunkStore.readinto = recording_readinto  # type: ignore[method-assign]
    try:
        res["restored"] = mgr.restore_latest(job["state"])
    finally:
        ChunkStore.readinto = real_readinto  # type: ignore[method-assign]
    res["chunks_read"] = sorted(read)
    full = full_state(job)
    if rank == 0:
        res["differences"] = differences(full, torch.load(root.parent / f"ref-{a}.pt", weights_only=True))
    res["skipped"] = mgr.last_restore.skipped
    # Training goes on: the next save of step B replaces the corrupt checkpoint.
    for step in range(res["restored"] + 1, b + 1):
        train_step(job)
        mgr.maybe_save(step, job["state"])
    mgr.close()
    full = full_state(job)
    if rank == 0:
        ref_b = torch.load(root.parent / f"ref-{b}.pt", weights_only=True)
        res["retrained_differences"] = differences(full, ref_b)
        res["events"] = [
            {k: e.get(k) for k in ("rank", "step", "chunk", "tensors")}
            for e in read_events(root, event="restore_skipped")
        ]
        rep = verify(root)
        res["verify_after_resave"] = {"ok": rep.ok, "checked": rep.checked}
    return res


def scenario_orphans(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    job = build(rank, ws)
    disk = FaultyStorage(LocalStorage(root))
    mgr = tg.CheckpointManager(disk, async_save=spec["async"], save_policy=tg.EveryNSteps(10**9))
    train_step(job)
    mgr.save(1, job["state"]).wait()
    train_step(job)  # new values: every rank has new chunks to write
    res: dict[str, Any] = {"failure": None}
    with Injector(disk, "enospc" if rank == ws - 1 else "none") as inj:
        try:
            mgr.save(2, job["state"]).wait()
        except Exception as e:  # noqa: BLE001 - recorded for the test
            res["failure"] = {
                "type": type(e).__name__,
                "is_storage_full": isinstance(e, tg.StorageFullError),
                "message": str(e),
                "step": getattr(e, "step", None),
                "rank_errors": {str(k): repr(v) for k, v in getattr(e, "rank_errors", {}).items()},
            }
    res["injected"] = inj.injected
    dist.barrier()
    if rank == 0:
        referenced = {c.path for c in read_manifest(root, 1).chunks.values()}
        files = {p.relative_to(root).as_posix() for p in (root / "chunks").rglob("*") if p.is_file()}
        res["orphans"] = sorted(files - referenced)
        res["listed"] = [[i.step, i.status, i.problem] for i in scan(root, failed_saves=True)]  # as `ls`
    dist.barrier()
    train_step(job)
    mgr.save(3, job["state"]).wait()
    mgr.close()
    if rank == 0:
        res["verify_ok"] = verify(root).ok
    return res


def scenario_refused_value(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    """The last rank's state holds a value the save refuses (a set holding a bool tensor whose bytes are not 0
    and 1); the other ranks' do not. Every rank must raise, none wait in a collective for its timeout."""
    root = Path(spec["root"])
    mgr = tg.CheckpointManager(root, async_save=spec["async"])
    evil = torch.tensor([2, 0, 255, 1], dtype=torch.uint8).view(torch.bool)
    good = torch.tensor([True, False])
    mgr.save(1, {"w": torch.ones(2), "v": {good}}).wait()
    res: dict[str, Any] = {"failure": None}
    t0 = time.monotonic()
    try:
        mgr.save(2, {"w": torch.ones(2), "v": {evil if rank == ws - 1 else good}}).wait()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res["failure"] = {"type": type(e).__name__, "message": str(e)}
    res["seconds"] = time.monotonic() - t0
    mgr.save(3, {"w": torch.ones(2), "v": {good}}).wait()
    res["steps"] = [i.step for i in mgr.checkpoints()]
    mgr.close()
    return res


class Phase(str, enum.Enum):
    TRAIN = "train"


def scenario_split_checks(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    """What every rank must refuse together before a save writes anything, and PerRank under an Enum key."""
    root = Path(spec["root"])
    mgr = tg.CheckpointManager(root, async_save=spec["async"])
    res: dict[str, Any] = {}

    def attempt(name: str, step: int, state: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            mgr.save(step, state).wait()
            res[name] = "saved"
        except Exception as e:  # noqa: BLE001 - recorded for the test
            res[name] = f"{type(e).__name__}: {e}"
        res[name + "_s"] = time.monotonic() - t0

    class Raises:  # rank 1's state_dict() raises: every rank must refuse this save, then go on in step
        def state_dict(self) -> dict[str, Any]:
            if rank == 1:
                raise tg.ConfigError("planted: state_dict failed on rank 1")
            return {"x": torch.ones(1)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    attempt("collect", 0, {"s": Raises()})
    if spec["async"]:  # rank 1's staging fails (a pinned allocation, say): rank 0 must not persist alone
        from trainguard.staging.buffers import BufferSet

        real_stage = BufferSet.stage

        def failing_stage(self: Any, flat: Any) -> Any:
            if rank == 1:
                raise MemoryError("planted: staging failed on rank 1")
            return real_stage(self, flat)

        BufferSet.stage = failing_stage  # type: ignore[method-assign]
        try:
            attempt("staging", 1, {"w": torch.ones(2)})
        finally:
            BufferSet.stage = real_stage  # type: ignore[method-assign]
    attempt("steps", 1 if rank == 0 else 2, {"w": torch.ones(2)})
    # only rank 0 holds a key named like rank 1's per-rank copy of "a" (whose values differ per rank)
    state = {"a": torch.full((2,), float(rank))}
    if rank == 0:
        state["a@rank1"] = torch.ones(2)
    attempt("reserved", 3, state)
    attempt("enum_per_rank", 4, {Phase.TRAIN: tg.PerRank({"cursor": torch.tensor([5])})})  # equal on both
    res["entries"] = sorted(read_manifest(root, 4).entries) if res["enum_per_rank"] == "saved" else []
    res["steps_listed"] = [i.step for i in mgr.checkpoints()]
    mgr.close()
    return res


def scenario_bf16(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    """FSDP2 parameters (fp32 DTensors) with bf16 moments, through ModelOptimizerState: the restored moments are
    bf16 DTensors equal to the saved ones, and both runs continue identically."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bf16_optim import BF16MomentsAdamW

    root = Path(spec["root"])
    job = build(rank, ws, BF16MomentsAdamW)
    for _ in range(2):
        train_step(job)
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(2, job["state"])
    ref = full_state(job)
    fresh = build(rank, ws, BF16MomentsAdamW, seed=7)
    with tg.CheckpointManager(root, read_only=True) as mgr:
        restored = mgr.restore_latest(fresh["state"])
    res: dict[str, Any] = {
        "restored": restored,
        "moment_dtypes": sorted(
            {str(st[k].dtype) for st in fresh["optim"].state.values() for k in ("exp_avg", "exp_avg_sq")}
        ),
        "local_types": sorted({type(st["exp_avg"]).__name__ for st in fresh["optim"].state.values()}),
    }
    got = full_state(fresh)
    rng = torch.get_rng_state()  # both jobs live in this process: the same noise for both steps
    train_step(job)
    torch.set_rng_state(rng)
    train_step(fresh)
    ref_after, got_after = full_state(job), full_state(fresh)
    if rank == 0:
        res["differences"] = differences(got, ref)
        res["differences_after_a_step"] = differences(got_after, ref_after)
    return res


# -- per-rank state -----------------------------------------------------------------------------------------------
class Cursor:
    """State that is genuinely per rank (an iterable loader's position, a per-rank counter)."""

    def __init__(self, rank: int) -> None:
        self.sd: dict[str, Any] = {"offset": rank, "consumed": torch.tensor([rank * 10]), "rank": rank}

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def per_rank_state(rank: int) -> dict[str, Any]:
    return {
        "cursor": Cursor(rank),
        "vals": {
            "offset": rank,  # a value
            "t": torch.full((3,), float(rank * 10)),  # a plain tensor
            "nested": {
                "a": {"b": [rank, "x"]},
                "same_t": torch.ones(2),
            },  # a nested dict; a replicated tensor
        },
        "shared": {"lr": 0.1, "w": torch.arange(4.0)},  # identical on every rank: stored once
    }


def observed(state: dict[str, Any]) -> dict[str, Any]:
    """What a rank holds, as JSON."""
    c = state["cursor"]
    c = c.obj if isinstance(c, tg.PerRank) else c
    v = state["vals"]
    v = v.obj if isinstance(v, tg.PerRank) else v
    return {
        "cursor": {"offset": c.sd["offset"], "consumed": c.sd["consumed"].tolist(), "rank": c.sd["rank"]},
        "vals": {"offset": v["offset"], "t": v["t"].tolist(), "b": v["nested"]["a"]["b"]},
        "same_t": v["nested"]["same_t"].tolist(),
        "shared": {"lr": state["shared"]["lr"], "w": state["shared"]["w"].tolist()},
    }


def fresh_per_rank_state() -> dict[str, Any]:
    return {
        "cursor": Cursor(-1),
        "vals": {"offset": -1, "t": torch.zeros(3), "nested": {"a": {"b": None}, "same_t": torch.zeros(2)}},
        "shared": {"lr": 0.0, "w": torch.zeros(4)},
    }


def scenario_perrank(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    root = Path(spec["root"])
    mgr = tg.CheckpointManager(root, save_policy=tg.EveryNSteps(10**9))
    mgr.save(1, per_rank_state(rank)).wait()
    mgr.close()
    state = fresh_per_rank_state()
    mgr = tg.CheckpointManager(root)
    step = mgr.restore_latest(state)
    mgr.close()
    res: dict[str, Any] = {"step": step, "restored": observed(state)}
    if rank == 0:
        m = read_manifest(root, 1)
        res["entries"] = {fqn: e.rank for fqn, e in m.entries.items()}
        res["format_version"] = m.format_version
    return res


def scenario_perrank_load(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, root in spec["roots"].items():
        state = fresh_per_rank_state()
        try:
            tg.CheckpointManager(root, read_only=True).restore_latest(state)
            no_hook: dict[str, Any] = {"error": None}
        except tg.StateMismatchError as e:
            no_hook = {"error": str(e), "untouched": observed(state)}
        calls: list[dict[str, Any]] = []

        def reshard(saved: list[Any], r: int, w: int, calls: list[dict[str, Any]] = calls) -> Any:
            calls.append({"saved_ranks": len(saved), "rank": r, "world_size": w})
            return saved[r % len(saved)]  # a rule the user chose: rank r takes saved rank r mod N

        state = fresh_per_rank_state()
        state["cursor"] = tg.PerRank(state["cursor"], reshard=reshard)
        state["vals"] = tg.PerRank(state["vals"], reshard=reshard)
        step = tg.CheckpointManager(root, read_only=True).restore_latest(state)
        res[name] = {"no_hook": no_hook, "step": step, "hooked": observed(state), "calls": calls}
    return res


def group_timeout_s(group: Any) -> float:
    return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())


def scenario_collectives(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    import time

    base = Path(spec["root"])
    res: dict[str, Any] = {}
    # (a) the groups' timeouts: inherited from init_process_group, or dist_timeout_s
    mgr = tg.CheckpointManager(base / "a", async_save=False)
    res["inherited"] = [group_timeout_s(mgr.dist.io_group), group_timeout_s(mgr.dist.ctl_group)]
    # "pr" is the same on every rank, but PerRank stores it per rank all the same
    mgr.save(1, {"w": {"t": torch.arange(8.0) + 1}, "note": "x", "pr": tg.PerRank({"k": torch.ones(2)})})
    mgr.close()
    if rank == 0:
        res["entries"] = {fqn: e.rank for fqn, e in read_manifest(base / "a", 1).entries.items()}
    dist.barrier()  # ranks arrive together at new_group (whose store barrier waits dist_timeout_s at most)
    mgr = tg.CheckpointManager(base / "b", async_save=False, dist_timeout_s=spec["override_timeout_s"])
    res["override"] = [group_timeout_s(mgr.dist.io_group), group_timeout_s(mgr.dist.ctl_group)]
    mgr.close()
    # (b) rank 0 alone: a read-only manager for inspection and a one-rank export; the others wait
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        ro = tg.CheckpointManager(base / "a", read_only=True)
        export: dict[str, Any] = {"w": {}, "note": None}
        res["alone"] = {
            "latest": ro.latest_step(),
            "listed": [i.step for i in ro.checkpoints()],
            "restored": ro.restore_latest(export),
            "w": export["w"]["t"].tolist(),
            "elapsed_s": time.monotonic() - t0,
        }
        ro.close()
    dist.barrier()
    # (c) a save whose peers never join fails on rank 0 within dist_timeout_s, not 30 minutes
    mgr = tg.CheckpointManager(base / "c", async_save=False, dist_timeout_s=spec["dead_timeout_s"])
    dist.barrier()
    if rank == 0:
        t0 = time.monotonic()
        try:
            mgr.save(1, {"w": torch.ones(4)})
            res["dead_peers"] = {"error": None}
        except Exception as e:  # noqa: BLE001 - recorded for the test
            res["dead_peers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["dead_peers"]["elapsed_s"] = time.monotonic() - t0
    else:
        time.sleep(spec["peers_away_s"])  # never joins the save
    res["_exit"] = True  # the manager's groups are broken now: leave without tearing them down
    return res


def scenario_validation(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    """check_finite and the probe under FSDP2 (issue 11): a NaN in one rank's shard rejects the save on every
    rank; the probe (a collective forward) is stored at save and matches after restore."""
    root = Path(spec["root"])
    job = build(rank, ws)
    probe_x = FEATURES[:4]

    def probe() -> torch.Tensor:
        with torch.no_grad():
            return job["model"](probe_x)

    mgr = tg.CheckpointManager(root, async_save=spec["async"], save_policy=tg.EveryNSteps(10**9), probe=probe)
    train_step(job)
    mgr.save(1, job["state"]).wait()
    res: dict[str, Any] = {"failure": None}
    local = job["model"].l2.weight.to_local()
    saved = local.detach().clone()
    if rank == ws - 1:
        with torch.no_grad():
            local.view(-1)[3] = float("nan")
    try:
        mgr.save(2, job["state"]).wait()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res["failure"] = {"type": type(e).__name__, "tensors": getattr(e, "tensors", None), "message": str(e)}
    with torch.no_grad():
        local.copy_(saved)
    mgr.save(3, job["state"]).wait()
    mgr.close()
    res["listed"] = [[i.step, i.status] for i in scan(root)] if rank == 0 else None
    job2 = build(rank, ws, seed=7)
    mgr2 = tg.CheckpointManager(root, probe=lambda: job2["model"](probe_x).detach())
    res["restored"] = mgr2.restore_latest(job2["state"])
    res["validate_s"] = mgr2.last_restore.validate_s
    mgr2.close()
    return res


def scenario_finite_load(spec: dict[str, Any], out: Path, rank: int, ws: int) -> dict[str, Any]:
    """The NaN/Inf scan after a sharded load (issue 15): the reading threads count the NaN/Inf of each
    rank's whole local shard as its chunks land (``known``, not scanned again), and a NaN saved with
    ``check_finite="off"`` in the last rank's shard makes the restore fail as suspect on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import trainguard.validation.finite as finite

    root = Path(spec["root"])
    mesh = init_device_mesh("cpu", (ws,))

    def sharded(rows: int, seed: int) -> Any:
        local = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(seed * 100 + rank))
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows * ws, 1024)), stride=(1024, 1)
        )

    # 2 MiB: a chunk of its own; 32 and 16 KiB: packed together into one chunk
    state = {"big": sharded(512, 1), "small": sharded(8, 2), "bias": sharded(4, 5)}
    if rank == ws - 1:
        state["big"].to_local()[5, 7] = float("nan")
    with tg.CheckpointManager(root, async_save=False, check_finite="off") as mgr:
        mgr.save(1, {"m": state})
    seen: list[list[str]] = []
    real_scan = finite.scan

    def recording_scan(flat: Any, only: Any = None, known: Any = None) -> dict[str, int]:
        seen.append(sorted(known or {}))
        return real_scan(flat, only, known)

    finite.scan = recording_scan  # type: ignore[assignment]
    target = {"m": {"big": sharded(512, 3), "small": sharded(8, 4), "bias": sharded(4, 6)}}
    res: dict[str, Any] = {}
    with tg.CheckpointManager(root, async_save=False) as mgr2:
        try:
            mgr2.restore(1, target)
            res["failure"] = None
        except tg.SuspectCheckpointError as e:
            res["failure"] = str(e)
    res["known"] = seen
    res["bitwise"] = {
        k: bool(
            torch.equal(target["m"][k].to_local().view(torch.int32), state[k].to_local().view(torch.int32))
        )
        for k in state
    }
    return res


SCENARIOS = {
    "finite_load": scenario_finite_load,
    "validation": scenario_validation,
    "perrank": scenario_perrank,
    "perrank_load": scenario_perrank_load,
    "collectives": scenario_collectives,
    "bf16": scenario_bf16,
    "save": scenario_save,
    "orphans": scenario_orphans,
    "refused_value": scenario_refused_value,
    "split_checks": scenario_split_checks,
    "load": scenario_load,
    "fail": scenario_fail,
    "corrupt": scenario_corrupt,
}


def main() -> int:
    scenario, spec_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("pg_timeout_s", 120)))
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    try:
        res = SCENARIOS[scenario](spec, out, rank, ws)
        res.update(rank=rank, world_size=ws)
    except Exception:  # noqa: BLE001 - reported to the test
        res = {"error": f"rank {rank}: {traceback.format_exc()}"}
    tmp = out / f".{scenario}-rank{rank}.json.tmp"
    tmp.write_text(json.dumps(res))
    os.replace(tmp, out / f"{scenario}-rank{rank}.json")
    if res.get("_exit"):
        os._exit(0)
    if "error" in res:
        os._exit(1)  # a peer may be stuck in a collective: do not wait for it in destroy_process_group
    dist.destroy_process_group()
    # Leave without interpreter finalization: a gloo worker thread may still drop the last reference to a
    # finished collective's tensors, and taking the GIL during finalization aborts the process ("terminate called
    # without an active exception", SIGABRT) after a successful run; seen 3 times in 30 loads at 3-4 ranks on a
    # loaded 2-core machine. Known torch issue: pytorch/pytorch#179291.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
