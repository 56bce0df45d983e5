"""A bool tensor's bytes must be 0 or 1. A manifest (correctly signed) that calls a float32 chunk ``bool`` with a
shape of the same byte count is refused at restore, never loaded as bools holding other bytes (undefined
behaviour in torch's kernels). tests/faults/test_manifest_fuzz.py found it: its oracle's ``copy_`` turns every
such byte into 1, trainguard kept the raw bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from faultlib import assert_state_is, commit_save, make_state, read_manifest_json, write_manifest

import trainguard as tg
from trainguard.errors import CorruptCheckpointError
from trainguard.integrity.verify import verify


def retyped_as_bool(root: Path, step: int, fqn: str) -> None:
    """Re-sign ``step``'s manifest with ``fqn`` (float32, one shard) declared as bool of the same bytes."""
    body = read_manifest_json(root, step)
    e = body["entries"][fqn]
    assert e["dtype"] == "float32" and len(e["shards"]) == 1
    e["dtype"] = "bool"
    e["shape"][-1] *= 4
    e["shards"][0]["sizes"][-1] *= 4
    write_manifest(root, step, body)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    retyped_as_bool(root, 2, "model.frozen")
    return root


@pytest.mark.parametrize("verify_before_load", [True, False])
def test_a_float_chunk_declared_bool_is_refused_naming_the_tensor(root, verify_before_load):
    state = {"model": {}, "optim": {}, "trainer": {}, "epoch": -1}
    with tg.CheckpointManager(root, read_only=True, verify_before_load=verify_before_load) as mgr:
        with pytest.raises(
            CorruptCheckpointError, match="bool tensor model.frozen holds bytes other than 0 and 1"
        ) as e:
            mgr.restore(2, state)
    assert e.value.step == 2


def test_restore_latest_falls_back_to_the_intact_step(root):
    state = {"model": {}, "optim": {}, "trainer": {}, "epoch": -1}  # takes any dtype (a typed target refuses)
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest(state) == 1
    assert_state_is(state, 1)


def test_real_bool_tensors_restore_bit_exactly(tmp_path):
    mask = torch.rand(4099, generator=torch.Generator().manual_seed(3)) > 0.5
    empty = torch.zeros(0, dtype=torch.bool)
    with tg.CheckpointManager(tmp_path / "r") as mgr:
        commit_save(mgr, 1, {"m": {"mask": mask, "empty": empty, "one": torch.tensor(True)}})
        live = {"m": {"mask": torch.zeros_like(mask), "empty": empty.clone(), "one": torch.tensor(False)}}
        assert mgr.restore(1, live) == 1
    assert torch.equal(live["m"]["mask"], mask) and bool(live["m"]["one"])
    assert torch.equal(live["m"]["mask"].view(torch.uint8), mask.view(torch.uint8))


TWO_RANKS = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, sys.argv[3])
from faultlib import read_manifest_json, write_manifest
import trainguard as tg
from trainguard.errors import CorruptCheckpointError

def body(rank, root, pg):
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method="file://" + pg)
    # only rank 1's float bytes are not 0/1 once retyped: rank 0 must refuse with it
    state = {"m": {"flags": torch.randn(4096) if rank == 1 else torch.zeros(4096)}}
    with tg.CheckpointManager(root) as mgr:
        r = mgr.save(1, state)
        getattr(r, "wait", lambda: None)()
    dist.barrier()
    if rank == 0:
        b = read_manifest_json(root, 1)
        for k, e in b["entries"].items():
            e["dtype"] = "bool"
            e["shape"][-1] *= 4
            for sh in e["shards"]:
                sh["sizes"][-1] *= 4
        write_manifest(root, 1, b)
    dist.barrier()
    # one file per rank: two ranks printing to the shared stdout pipe interleave ("10 refused True" then
    # " refused False", seen in CI)
    out = os.path.join(os.path.dirname(root), f"rank{rank}.txt")
    try:
        with tg.CheckpointManager(root) as mgr:
            mgr.restore(1, {"m": {}})
        result = f"{rank} loaded"
    except CorruptCheckpointError as e:
        result = f"{rank} refused {'on another rank' in str(e)}"
    with open(out, "w") as f:
        f.write(result)
    dist.barrier()
    dist.destroy_process_group()
    # no interpreter finalization: a gloo thread dropping its last tensor reference then aborts the process
    # ("terminate called without an active exception", 1 run in 10; pytorch/pytorch#179291, tests/distributed/
    # worker.py)
    sys.stdout.flush()
    os._exit(0)

if __name__ == "__main__":
    mp.spawn(body, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


def test_under_torch_distributed_every_rank_refuses_together(tmp_path):
    """Only rank 1's shard holds bytes other than 0 and 1: rank 0 refuses too (a rank that went on alone
    would wait forever in the job's next collective), and the step is marked corrupt."""
    import subprocess
    import sys

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    root = tmp_path / "root"
    r = subprocess.run(
        [sys.executable, str(script), str(root), str(tmp_path / "pg"), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    results = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert results == ["0 refused True", "1 refused False"], r.stdout + r.stderr
    assert (root / "step-000000001" / "corrupt.json").exists()


def test_verify_reports_the_forged_step_only_and_keeps_its_corrupt_marker(root):
    """``trainguard verify`` reads what restore refuses as refused: step 2 is reported (its chunk, shared with
    the intact step 1, is not blamed), and the marker a restore wrote stays."""
    report = verify(root, record=False)
    assert not report.ok
    assert [(c["step"], c["tensors"]) for c in report.corrupt] == [(2, ["model.frozen"])], report.corrupt
    assert "bytes other than 0 and 1" in report.corrupt[0]["problem"]
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest({"model": {}, "optim": {}, "trainer": {}, "epoch": -1}) == 1
    marker = root / "step-000000002" / "corrupt.json"
    assert marker.exists()
    assert not verify(root).ok  # recording: the marker is kept, step 1 stays valid
    assert marker.exists() and not (root / "step-000000001" / "corrupt.json").exists()


def _tensor_holding(evil: torch.Tensor) -> torch.Tensor:
    holder = torch.zeros(2)
    holder.mask = evil  # type: ignore[attr-defined]  # a Python attribute: torch.load restores it
    return holder


@pytest.mark.parametrize("where", ["nested", "attribute"])
@pytest.mark.parametrize("verify_before_load", [True, False])
def test_a_bool_tensor_inside_a_stored_value_is_refused_too(tmp_path, verify_before_load, where):
    """A torch-codec value decodes with ``torch.load(weights_only=True)``, which returns a bool tensor with any
    bytes: decoding refuses one nested in dicts and lists, or held as a tensor's Python attribute (which the
    check did not look at before), at restore and in verify."""
    import io

    import crc32c
    import xxhash

    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, {"a": torch.zeros(3), "v": torch.float32})
    evil = torch.tensor([2, 0, 255, 1], dtype=torch.uint8).view(torch.bool)
    buf = io.BytesIO()
    torch.save({"k": [{"deep": (evil,)}]} if where == "nested" else {"k": _tensor_holding(evil)}, buf)
    data = buf.getvalue()
    h = xxhash.xxh3_128_hexdigest(data)
    rel = f"chunks/{h[:2]}/{h}"
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)
    body = read_manifest_json(root, 1)
    body["chunks"][h] = {"path": rel, "length": len(data), "crc32c": crc32c.crc32c(data), "codec": "raw"}
    e = body["entries"]["v"]
    e.pop("value", None)
    e["codec"] = "torch"
    e["segments"] = [[h, 0, len(data)]]
    write_manifest(root, 1, body)
    state = {"a": torch.ones(3), "v": None}
    with tg.CheckpointManager(root, read_only=True, verify_before_load=verify_before_load) as mgr:
        with pytest.raises(
            CorruptCheckpointError, match="a bool tensor in it holds bytes other than 0 and 1"
        ):
            mgr.restore(1, state)
    report = verify(root, record=False)
    assert not report.ok and report.corrupt[0]["tensors"] == ["v"], report.corrupt


def test_export_and_a_plain_dcp_load_refuse_the_forged_bools_too(root, tmp_path):
    """Outside a restore, the DCP reader (``trainguard export``, ``tg.dcp_reader`` with a user's own
    ``dcp.load``) checks a bool tensor's bytes as it reads it: the export writes no file, the load raises (its
    target, read in place, is as undefined as after any failed ``dcp.load``)."""
    import torch.distributed.checkpoint as dcp

    from trainguard._persist import unwrap
    from trainguard.interop.export import export

    out = tmp_path / "model.pt"
    with pytest.raises(
        CorruptCheckpointError, match="bool tensor model.frozen holds bytes other than 0 and 1"
    ):
        export(root, out, format="torch", step=2)
    assert not out.exists() and not list(tmp_path.glob("model.pt*"))
    export(root, out, format="torch", step=1)  # the intact step exports
    assert torch.equal(torch.load(out, weights_only=True)["frozen"], make_state(1)["model"]["frozen"])

    shape = read_manifest_json(root, 2)["entries"]["model.frozen"]["shape"]
    # a bool target, and targets DCP converts into: each forged byte would become 0 or 1, undetectable after
    for dtype in (torch.bool, torch.float32, torch.uint8, torch.int64):
        target = {"model.frozen": torch.zeros(shape, dtype=dtype)}
        with pytest.raises(BaseException) as e:  # DCP's CheckpointException (a BaseException) around ours
            dcp.load(target, storage_reader=tg.dcp_reader(root, 2))
        inner = unwrap(e.value, 2, prefer=CorruptCheckpointError)
        assert isinstance(inner, CorruptCheckpointError), (dtype, e.value)
        assert "holds bytes other than 0 and 1" in str(inner), (dtype, inner)
    # real bools convert as DCP converts them
    real = tmp_path / "real"
    mask = torch.arange(10) % 3 == 0
    with tg.CheckpointManager(real, async_save=False) as mgr:
        mgr.save(1, {"mask": mask})
    target = {"mask": torch.full((10,), 7.0)}
    dcp.load(target, storage_reader=tg.dcp_reader(real, 1))
    assert torch.equal(target["mask"], mask.float())


def _forged_column_shards(root: Path, split: bool) -> None:
    """Step 2 declares a float32 tensor's chunk as bool ``m.flags`` of shape (4, 32), in two column shards
    (as a ``Shard(1)`` save at 2 ranks writes them) or one; step 1 holds a real ``m.flags``."""
    with tg.CheckpointManager(root, async_save=False, compression="off") as mgr:
        mgr.save(1, {"m": {"flags": torch.zeros(4, 32, dtype=torch.bool)}})
        mgr.save(2, {"m": {"f": torch.randn(4, 8, generator=torch.Generator().manual_seed(0))}})
    body = read_manifest_json(root, 2)
    e = body["entries"].pop("m.f")
    e.update(dtype="bool", shape=[4, 32], path=[["s", "m"], ["s", "flags"]])
    h, off, n = e["shards"][0]["segments"][0]
    if split:
        e["shards"] = [
            {"offsets": [0, 0], "sizes": [4, 16], "segments": [[h, off, n // 2]]},
            {"offsets": [0, 16], "sizes": [4, 16], "segments": [[h, off + n // 2, n // 2]]},
        ]
    else:
        e["shards"][0]["sizes"] = [4, 32]
    body["entries"]["m.flags"] = e
    write_manifest(root, 2, body)


@pytest.mark.parametrize(
    ("split", "live"),
    [
        (True, lambda: torch.zeros(4, 32, dtype=torch.bool)),  # each shard is a strided part of the tensor
        (False, lambda: torch.zeros(32, 4, dtype=torch.bool).t()),  # a non-contiguous live tensor
    ],
    ids=["column-shards", "non-contiguous-destination"],
)
def test_forged_bools_read_through_a_copy_are_refused(tmp_path, split, live):
    """A read that is not a byte copy into the destination goes through ``copy_``, which turns each nonzero
    byte into 1 (into a bool tensor too): checking the destination afterwards would find nothing, so the saved
    bytes are checked before the copy. Before, restore, restore_latest, export and dcp.load took such bools."""
    import torch.distributed.checkpoint as dcp

    from trainguard._persist import unwrap

    root = tmp_path / "root"
    _forged_column_shards(root, split)
    state = {"m": {"flags": live()}}
    with pytest.raises(CorruptCheckpointError, match="bool tensor m.flags holds bytes other than 0 and 1"):
        tg.CheckpointManager(root, read_only=True).restore(2, state)
    with tg.CheckpointManager(root) as mgr:
        assert mgr.restore_latest({"m": {"flags": live()}}) == 1  # falls back to the intact step
    assert (root / "step-000000002" / "corrupt.json").exists()
    target = {"m.flags": live()}
    with pytest.raises(BaseException) as e:
        dcp.load(target, storage_reader=tg.dcp_reader(root, 2))
    assert isinstance(unwrap(e.value, 2, prefer=CorruptCheckpointError), CorruptCheckpointError)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_live_bool_tensor_with_other_bytes_is_stored_as_torch_copies_it(tmp_path, async_save):
    """A uint8 tensor viewed as bool holds bytes other than 0 and 1. A synchronous save stored them as they were,
    and then every restore refused the step as corrupt (an async save's staging copy turned them into 0/1).
    Both modes now store what ``clone`` gives, every nonzero byte as 1, and the checkpoint verifies and
    restores."""
    live = torch.tensor([2, 0, 1, 255, 0, 7], dtype=torch.uint8).view(torch.bool)
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"mask": live, "w": torch.ones(2)}).wait()
    assert verify(tmp_path, record=False).ok
    out = {"mask": torch.zeros(6, dtype=torch.bool), "w": torch.zeros(2)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(out) == 1
    assert out["mask"].view(torch.uint8).tolist() == [1, 0, 1, 1, 0, 1]
    assert live.view(torch.uint8).tolist() == [2, 0, 1, 255, 0, 7]  # the live tensor is not touched


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_value_holding_a_bool_tensor_with_other_bytes_is_refused_at_save(tmp_path, async_save):
    """Such a value would be stored as its bytes are and refused by every restore: the save refuses it, naming
    the entry and the fix, and leaves the earlier checkpoints as they were."""
    evil = torch.tensor([2, 0, 255, 1], dtype=torch.uint8).view(torch.bool)
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"w": torch.ones(2), "v": {"ok"}}).wait()
        for bad in ({evil}, {_tensor_holding(evil)}):  # a set is a value: it is stored whole
            with pytest.raises(
                tg.ConfigError, match=r"'v' holds a bool tensor with bytes other than 0 and 1"
            ):
                mgr.save(2, {"w": torch.ones(2), "v": bad}).wait()
        mgr.save(3, {"w": torch.ones(2), "v": {evil.clone()}}).wait()  # the fix the message names
        assert [i.step for i in mgr.checkpoints()] == [1, 3]


def test_a_strided_part_of_a_saved_shard_is_checked_on_its_own_bytes(tmp_path):
    """A rank of a column-sharded load (``Shard(1)`` on more ranks than saved) reads a strided part of a saved
    shard. The check copied it with ``.contiguous()``, and torch's bool copy turns every nonzero byte into 1, so
    forged bytes passed; the saved bytes of the part are checked through a uint8 view now."""
    from trainguard.catalog import read_manifest
    from trainguard.distributed.chunkread import ShardReader
    from trainguard.state.values import bool_bytes_valid

    raw = torch.zeros(4, 32, dtype=torch.uint8)
    raw[1, 9] = 7
    assert not bool_bytes_valid(raw.view(torch.bool)[:, 8:16])  # strided
    assert not bool_bytes_valid(raw.view(torch.bool).t())
    assert bool_bytes_valid(raw.view(torch.bool)[:, 16:])  # the part without the byte

    root = tmp_path / "root"
    _forged_column_shards(root, split=False)
    m = read_manifest(root, 2)
    with tg.CheckpointManager(root, read_only=True) as mgr:
        reader = ShardReader(mgr.store, m)
        dest = torch.zeros(4, 8, dtype=torch.bool)
        with pytest.raises(
            CorruptCheckpointError, match="bool tensor m.flags holds bytes other than 0 and 1"
        ):
            reader.read_tensor("m.flags", (0, 0), (0, 8), (4, 8), dest)
        assert not dest.any()  # nothing copied


def test_sparse_meta_and_nested_bool_tensors_are_checked_without_an_error(tmp_path):
    """Inside a stored value (a set), a sparse, meta or nested bool tensor made the check raise torch's
    NotImplementedError (a SaveError at save, a raw torch error at restore); their stored values are checked."""
    from trainguard.state.values import bool_bytes_valid

    bad = torch.tensor([2, 1], dtype=torch.uint8).view(torch.bool)
    good = torch.tensor([True, True])
    idx = torch.tensor([[0, 2]])
    assert bool_bytes_valid(torch.sparse_coo_tensor(idx, good, (3,)))
    assert not bool_bytes_valid(torch.sparse_coo_tensor(idx, bad, (3,)))
    assert not bool_bytes_valid(torch.sparse_coo_tensor(idx, bad, (3,)).coalesce())
    assert bool_bytes_valid(torch.zeros(3, dtype=torch.bool, device="meta"))
    assert bool_bytes_valid(torch.nested.nested_tensor([good, good[:1]]))
    assert not bool_bytes_valid(torch.nested.nested_tensor([good, bad]))
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"v": {torch.sparse_coo_tensor(idx, good, (3,))}})
        with pytest.raises(tg.ConfigError, match="'v' holds a bool tensor with bytes other than 0 and 1"):
            mgr.save(2, {"v": {torch.sparse_coo_tensor(idx, bad, (3,))}})
    out: dict = {"v": None}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(out) == 1
    (got,) = out["v"]
    assert torch.equal(got.to_dense(), torch.tensor([True, False, True]))
