"""Re-signed manifests that would make verify or restore allocate far more than they declare: each is refused
before allocating, and ``restore_latest`` uses the intact step 1 instead.

The rule: memory needed by verify or restore is bounded by the tensor and value bytes the manifest declares,
and those must agree with the dtypes, the chunk lengths and the memory available for the target state.
"""

# ruff: noqa: F811 - the fixtures root, base and guard_allocations come from test_malicious
from __future__ import annotations

import io
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from faultlib import blank_state, read_manifest_json, run_limited, write_manifest
from test_malicious import (  # noqa: F401 - fixtures
    GUARD_BYTES,
    add_chunk,
    assert_refused,
    base,
    guard_allocations,
    own_chunk_of,
    root,
)

import trainguard as tg
from trainguard.errors import CorruptCheckpointError, UnsafeCheckpointError


def new_entry(body: dict[str, Any], name: str, dtype: str, numel: int, segments: list[list[Any]]) -> None:
    """Add ``model.<name>``: a 1-D tensor the live state does not have (restore must allocate it)."""
    body["entries"][f"model.{name}"] = {
        "kind": "tensor",
        "path": [["s", "model"], ["s", name]],
        "dtype": dtype,
        "shape": [numel],
        "shards": [{"offsets": [0], "sizes": [numel], "segments": segments}],
    }


def test_a_bits8_entry_of_2_to_the_40_elements_is_refused_by_ls_verify_and_restore(
    root, tmp_path, guard_allocations
):
    body = read_manifest_json(root, 2)
    h = own_chunk_of(body, "model.big")
    new_entry(body, "evil", "bits8", 2**40, [[h, 0, body["chunks"][h]["length"]]])
    write_manifest(root, 2, body)
    with tg.CheckpointManager(root, read_only=True) as mgr:  # before any restore wrote a marker
        assert {i.step: i.status for i in mgr.checkpoints()} == {1: "valid", 2: "corrupt"}
    msg = assert_refused(root, tmp_path, CorruptCheckpointError, ["bits8", "1099511627776"])
    assert "model.evil" in msg
    assert max(guard_allocations, default=0) <= GUARD_BYTES


def test_a_shard_listing_part_of_a_chunk_twice_is_refused(root, tmp_path, guard_allocations):
    body = read_manifest_json(root, 2)
    seg = body["entries"]["model.small"]["shards"][0]["segments"][0]  # 4 KiB inside the shared pack chunk
    new_entry(body, "evil", "float32", 1024 * 2000, [list(seg)] * 2000)
    write_manifest(root, 2, body)
    assert_refused(root, tmp_path, CorruptCheckpointError, ["more than once"])


def test_a_whole_chunk_listed_2000_times_is_refused_before_allocating(root, tmp_path, guard_allocations):
    """The issue's input: a 95 KB manifest whose new shard lists one 1.28 MB chunk 2,000 times (2.56 GB). A
    save repeats only whole chunks of its split size (``chunk_sizes``, 64 MiB here), so it is refused by the
    manifest check, on any machine, before anything is allocated."""
    body = read_manifest_json(root, 2)
    assert body["chunk_sizes"] == [64 << 20]  # recorded by the save: model.big was cut with chunk_size_bytes
    h = own_chunk_of(body, "model.big")  # 1.28 MB: the shard declares 2.56 GB
    n = body["chunks"][h]["length"]
    new_entry(body, "evil", "float32", n // 4 * 2000, [[h, 0, n]] * 2000)
    write_manifest(root, 2, body)
    assert len(json.dumps(body)) < 200_000
    msg = assert_refused(
        root, tmp_path, CorruptCheckpointError, ["model.evil", "more than once", "split size"]
    )
    assert max(guard_allocations, default=0) <= GUARD_BYTES
    # a manifest that records no split sizes (written before they were recorded) is read with the default
    del body["chunk_sizes"]
    write_manifest(root, 2, body)
    assert msg == assert_refused(root, tmp_path, CorruptCheckpointError, ["more than once"])
    assert max(guard_allocations, default=0) <= GUARD_BYTES


REPEAT = """
import json, resource, sys
sys.path.insert(0, {tests!r})
from faultlib import blank_state
import trainguard as tg
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more than now
with tg.CheckpointManager({root!r}, read_only=True) as mgr:
    state = blank_state()
    state["model"] = {{}}  # an empty dict takes what was saved: model.evil must be allocated
    step = mgr.restore_latest(state)
    print(json.dumps({{"restored": step, "skipped": mgr.last_restore.skipped}}))
"""


@pytest.mark.timeout(180)
def test_a_repeated_chunk_with_a_forged_split_size_is_not_allocated_beyond_the_memory_available(root):
    """The same input made self-consistent (``chunk_sizes`` forged to the chunk's length, as an honest save
    of a 2.56 GB constant tensor with ``chunk_size_bytes=1.28 MB`` would record): the declared bytes are then
    checked against the memory available before they are allocated."""
    body = read_manifest_json(root, 2)
    h = own_chunk_of(body, "model.big")
    n = body["chunks"][h]["length"]
    body["chunk_sizes"] = [n]
    new_entry(body, "evil", "float32", n // 4 * 2000, [[h, 0, n]] * 2000)
    write_manifest(root, 2, body)
    rc, out, err = run_limited(
        ["-c", REPEAT.format(tests=str(Path(__file__).parent), root=str(root))], address_space_bytes=1 << 40
    )
    assert rc == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["restored"] == 1
    [skip] = result["skipped"]
    assert skip["step"] == 2 and re.search(r"needs 256\d{7} bytes", skip["problem"]), skip


def deflated_torch_payload(n: int) -> bytes:
    """What ``torch.save`` writes for a tuple and an ``n``-byte tensor, re-zipped with deflate (n zero bytes
    compress to almost nothing; torch.load still reads it)."""
    buf = io.BytesIO()
    torch.save({"betas": (0.9, 0.999), "pad": torch.zeros(n, dtype=torch.uint8)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


def test_a_compressed_torch_value_is_refused_before_decoding(root, tmp_path):
    payload = deflated_torch_payload(40 << 20)
    assert len(payload) < 100_000  # 40 MiB decoded from under 100 KB
    assert torch.load(io.BytesIO(payload), weights_only=True)["pad"].numel() == 40 << 20  # it is armed
    h, rec = add_chunk(root, payload)
    body = read_manifest_json(root, 2)
    body["chunks"][h] = rec
    body["entries"]["optim"]["segments"] = [[h, 0, rec["length"]]]
    write_manifest(root, 2, body)
    assert_refused(root, tmp_path, UnsafeCheckpointError, ["optim", "compressed"])


def sparse_chunk(root: Path, size: int) -> tuple[str, dict[str, Any]]:
    h = "ab" * 16
    p = root / "chunks" / h[:2] / h
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "wb") as f:
        f.truncate(size)  # a hole: no disk blocks
    return h, {"path": f"chunks/{h[:2]}/{h}", "length": size, "crc32c": 0, "codec": "raw"}


def test_a_64_gib_sparse_chunk_behind_a_1_mb_tensor_is_refused_before_it_is_read(
    root, tmp_path, guard_allocations
):
    h, rec = sparse_chunk(root, 64 << 30)
    assert os.stat(root / rec["path"]).st_blocks == 0
    body = read_manifest_json(root, 2)
    body["chunks"][h] = rec
    n = body["entries"]["model.big"]["shards"][0]["segments"][0][2]
    old = own_chunk_of(body, "model.big")
    del body["chunks"][old]
    body["entries"]["model.big"]["shards"][0]["segments"] = [[h, 0, n]]
    write_manifest(root, 2, body)
    assert_refused(root, tmp_path, CorruptCheckpointError, ["68719476736 bytes long"])
    assert max(guard_allocations, default=0) <= GUARD_BYTES


def test_a_64_gib_sparse_chunk_behind_a_64_gib_new_tensor_is_not_allocated(root, guard_allocations):
    h, rec = sparse_chunk(root, 64 << 30)
    body = read_manifest_json(root, 2)
    body["chunks"][h] = rec
    new_entry(body, "evil", "float32", (64 << 30) // 4, [[h, 0, 64 << 30]])
    write_manifest(root, 2, body)
    with tg.CheckpointManager(root) as mgr:
        state = blank_state()
        state["model"] = {}  # an empty dict takes what was saved: model.evil must be allocated
        with pytest.raises(
            tg.TrainguardError, match=r"needs 687\d{8} bytes for tensors the live state lacks"
        ):
            mgr.restore(2, state)
        assert mgr.restore_latest(state) == 1
        assert [s["step"] for s in mgr.last_restore.skipped] == [2]
    assert max(guard_allocations, default=0) <= GUARD_BYTES


def test_a_value_path_5000_levels_deep_is_refused(root, tmp_path):
    body = read_manifest_json(root, 2)
    body["entries"]["deep"] = {
        "kind": "value",
        "path": [["s", "epoch"]] + [["s", "x"]] * 5000,
        "codec": "json",
        "value": 1,
    }
    write_manifest(root, 2, body)
    assert sys.getrecursionlimit() < 5000
    assert_refused(root, tmp_path, CorruptCheckpointError, ["5001 levels deep"])


def test_the_same_half_shard_listed_twice_is_refused(root, tmp_path):
    body = read_manifest_json(root, 2)
    e = body["entries"]["model.big"]
    half = e["shape"][0] // 2
    h = own_chunk_of(body, "model.big")
    shard = {"offsets": [0], "sizes": [half], "segments": [[h, 0, half * 4]]}
    e["shards"] = [shard, json.loads(json.dumps(shard))]
    write_manifest(root, 2, body)
    assert_refused(root, tmp_path, CorruptCheckpointError, ["overlap", "exactly once"])


def test_an_honest_save_repeating_pieces_of_a_constant_tensor_records_its_split_size_and_restores(tmp_path):
    """The rule honest saves never break: a constant tensor cut into identical pieces lists one chunk once per
    piece, of the split size the manifest records."""
    w = torch.zeros(5 * 1024 + 7)  # five identical 4 KiB pieces and a short last one
    with tg.CheckpointManager(tmp_path / "r", chunk_size_bytes=4096, async_save=False) as mgr:
        mgr.save(1, {"w": w, "v": torch.full((3000,), 2.5)})
    body = read_manifest_json(tmp_path / "r", 1)
    assert body["chunk_sizes"] == [4096]
    segs = body["entries"]["w"]["shards"][0]["segments"]
    assert len(segs) == 6 and len({s[0] for s in segs[:5]}) == 1 and segs[5][2] == 28
    state = {"w": torch.ones_like(w), "v": torch.zeros(3000)}
    with tg.CheckpointManager(tmp_path / "r", read_only=True) as mgr:
        assert mgr.restore_latest(state) == 1
    assert torch.equal(state["w"], w) and torch.equal(state["v"], torch.full((3000,), 2.5))


def legacy_manifest(piece: int, repeats: int) -> bytes:
    """A manifest without ``chunk_sizes`` (as written before they were recorded) whose tensor lists one whole
    chunk of ``piece`` bytes ``repeats`` times (the chunk file need not exist to parse it)."""
    from trainguard.format import ChunkRecord, Manifest, Segment, ShardRecord, TensorEntry, manifest_to_json

    h = "ab" * 16
    shard = ShardRecord((0,), (piece * repeats,), (Segment(h, 0, piece),) * repeats)
    m = Manifest(
        step=1,
        t=1.0,
        time="t",
        world_size=1,
        entries={"w": TensorEntry("w", (("s", "w"),), "uint8", (piece * repeats,), (shard,))},
        chunks={h: ChunkRecord(h, f"chunks/ab/{h}", piece, 0)},
    )
    return manifest_to_json(m)


def test_a_manifest_recording_no_split_size_repeats_only_whole_chunks_of_the_default_64_mib():
    from trainguard.format import manifest_from_json

    assert b"chunk_sizes" not in legacy_manifest(64 << 20, 3)
    m = manifest_from_json(legacy_manifest(64 << 20, 3), expect_step=1)
    assert m.chunk_sizes is None and len(m.entries["w"].shards[0].segments) == 3  # type: ignore[union-attr]
    with pytest.raises(CorruptCheckpointError, match="more than once.*67108864 bytes"):
        manifest_from_json(legacy_manifest(1 << 20, 3), expect_step=1)
