"""The checked read works block by block (issue 15, load speed): each block's CRC32C and NaN/Inf scan run right
after its read, while it is in the CPU cache. These tests pin what must not change with that: the scan counts
each element once (a read retried after a CRC32C mismatch counts only the read that passed), a chunk copied
from elsewhere is still scanned, the bytes and the checks are the same as a whole-chunk read."""

from __future__ import annotations

import struct

import pytest
import torch

import trainguard as tg
import trainguard.incremental.chunkstore as chunkstore_mod
from trainguard.catalog import read_manifest
from trainguard.incremental.chunkstore import CRC_BLOCK_BYTES, ChunkStore
from trainguard.storage import Fault, FaultyStorage, LocalStorage
from trainguard.validation.finite import count_nonfinite

ELEMS = (2 * CRC_BLOCK_BYTES + CRC_BLOCK_BYTES // 2) // 4  # float32: two full blocks and a half one
FINITE_FLIPS_TO_INF = struct.unpack("<f", (0x7E800000).to_bytes(4, "little"))[0]  # byte 3 ^ 0x01: +Inf


def saved_state() -> torch.Tensor:
    t = torch.randn(ELEMS, generator=torch.Generator().manual_seed(0))
    t[0] = FINITE_FLIPS_TO_INF  # finite; a flipped bit 0 of its byte 3 makes it +Inf
    t[CRC_BLOCK_BYTES // 4 + 5] = float("nan")  # block 2
    t[-1] = float("-inf")  # the last, shorter block
    return t


def one_chunk(tmp_path) -> tuple[torch.Tensor, object]:
    t = saved_state()
    with tg.CheckpointManager(tmp_path, async_save=False, check_finite="off", compression="off") as mgr:
        mgr.save(1, {"w": t})
    (rec,) = [r for r in read_manifest(tmp_path, 1).chunks.values() if r.length == t.nbytes]
    return t, rec


def scan_f32(sizes: list[int]):
    def scan(block: memoryview) -> int:
        sizes.append(len(block))
        return count_nonfinite(torch.frombuffer(block, dtype=torch.uint8).view(torch.float32))

    return scan


def test_readinto_scans_each_block_as_it_lands_and_returns_the_count(tmp_path):
    t, rec = one_chunk(tmp_path)
    out = torch.zeros_like(t)
    sizes: list[int] = []
    got = ChunkStore(tmp_path).readinto(rec, memoryview(out.view(torch.uint8).numpy()), scan=scan_f32(sizes))
    assert got == 2  # the NaN of block 2 and the -Inf of the last block
    assert sizes == [CRC_BLOCK_BYTES, CRC_BLOCK_BYTES, CRC_BLOCK_BYTES // 2]
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))
    assert ChunkStore(tmp_path).readinto(rec, memoryview(out.view(torch.uint8).numpy())) is None  # no scan


def test_a_read_retried_after_a_crc_mismatch_counts_only_the_read_that_passed(tmp_path):
    """The first read returns one flipped bit that turns a finite value into +Inf (its CRC32C fails); the
    confirming read is intact: the count is the intact bytes' 2, not 3 and not 5."""
    t, rec = one_chunk(tmp_path)
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("read", match=rec.path, flip_byte=3, times=1))
    out = torch.zeros_like(t)
    sizes: list[int] = []
    got = ChunkStore(disk).readinto(rec, memoryview(out.view(torch.uint8).numpy()), scan=scan_f32(sizes))
    assert disk.injected and disk.injected[0][1] == rec.path  # the flip was served once
    assert len(sizes) == 6  # both reads were scanned block by block
    assert got == 2
    assert torch.equal(out.view(torch.int32), t.view(torch.int32))


def test_a_persistent_flip_still_fails_the_check(tmp_path):
    t, rec = one_chunk(tmp_path)
    disk = FaultyStorage(LocalStorage(tmp_path), Fault("read", match=rec.path, flip_byte=3, times=None))
    out = torch.zeros_like(t)
    with pytest.raises(tg.CorruptCheckpointError, match="fails CRC32C"):
        ChunkStore(disk).readinto(rec, memoryview(out.view(torch.uint8).numpy()), scan=scan_f32([]))


@pytest.mark.parametrize("block", [1 << 40, CRC_BLOCK_BYTES, 4096])
def test_restore_finds_the_non_finite_values_whatever_the_block_size(tmp_path, monkeypatch, block):
    """A restore with check_finite="error" reports the saved NaN/Inf (found by the reading threads' per-block
    scan); with the check off it loads the same bytes."""
    monkeypatch.setattr(chunkstore_mod, "CRC_BLOCK_BYTES", block)
    t, _ = one_chunk(tmp_path)
    live = torch.zeros_like(t)
    with pytest.raises(tg.SuspectCheckpointError, match="2 non-finite"):
        tg.CheckpointManager(tmp_path, read_only=True, check_finite="error").restore(1, {"w": live})
    tg.CheckpointManager(tmp_path, read_only=True, check_finite="off").restore(1, {"w": live})
    assert torch.equal(live.view(torch.int32), t.view(torch.int32))


@pytest.mark.parametrize("verify", [True, False])
def test_chunks_read_from_a_tier_are_still_scanned_whole(tmp_path, verify):
    """A chunk the hot root lacks comes from a tier (copied, not read block by block): the reader scans it
    whole after the copy, so a NaN in it is still found."""
    t = torch.randn(64 * 1024, generator=torch.Generator().manual_seed(1))
    t[50_000] = float("nan")
    shared = tmp_path / "shared"
    with tg.CheckpointManager(
        tmp_path / "node1", tiers=[tg.Tier(str(shared))], chunk_size_bytes=16 << 10, check_finite="off"
    ) as mgr:
        mgr.save(1, {"w": t}).wait()
    live = torch.zeros_like(t)
    node2 = tg.CheckpointManager(
        tmp_path / "node2", tiers=[tg.Tier(str(shared))], verify_before_load=verify, check_finite="error"
    )
    with node2, pytest.raises(tg.SuspectCheckpointError, match="1 non-finite"):
        node2.restore(1, {"w": live})


def crc_bytes_counter(monkeypatch) -> list[int]:
    """Count the bytes the chunk store computes CRC32C over (every checked read goes through it)."""
    seen: list[int] = []
    real = chunkstore_mod.crc32c.crc32c

    class Counting:
        @staticmethod
        def crc32c(data, value=0):
            seen.append(len(memoryview(data).cast("B")))
            return real(data, value)

    monkeypatch.setattr(chunkstore_mod, "crc32c", Counting)
    return seen


def test_a_verified_restore_computes_each_chunks_crc32c_once(tmp_path, monkeypatch):
    """The pass before the load checks every chunk; the load reads the same files again without computing
    the CRC32C a second time (issue 15: the verified restore's CPU)."""
    t, rec = one_chunk(tmp_path)
    seen = crc_bytes_counter(monkeypatch)
    out = {"w": torch.zeros_like(t)}
    mgr = tg.CheckpointManager(tmp_path, read_only=True, check_finite="off")
    mgr.restore(1, out)
    assert torch.equal(out["w"].view(torch.int32), t.view(torch.int32))
    assert mgr.last_restore.verify_bytes == rec.length
    assert sum(seen) == rec.length  # once, in the pass before the load (twice before)


def test_a_chunk_replaced_between_the_check_and_the_load_is_checked_again(tmp_path, monkeypatch):
    """A file swapped for damaged bytes after the pass checked it (a new inode: another object) is not
    trusted: the load computes its CRC32C, finds the damage and raises."""
    import trainguard._restore as restore_mod

    t, rec = one_chunk(tmp_path)
    real = restore_mod.verify_chunks
    path = tmp_path / rec.path

    def verify_then_swap(*a, **k):
        n = real(*a, **k)
        data = bytearray(path.read_bytes())
        data[10] ^= 0x01
        tmp = path.with_name(path.name + ".swap")
        tmp.write_bytes(bytes(data))
        tmp.replace(path)  # same name, new inode
        return n

    monkeypatch.setattr(restore_mod, "verify_chunks", verify_then_swap)
    seen = crc_bytes_counter(monkeypatch)
    out = {"w": torch.zeros_like(t)}
    with pytest.raises(tg.CorruptCheckpointError, match="CRC32C"):
        tg.CheckpointManager(tmp_path, read_only=True, check_finite="off").restore(1, out)
    assert sum(seen) >= 2 * rec.length  # the swapped file's CRC32C was computed by the load


def test_packed_chunks_too_are_crc32c_checked_once_per_verified_restore(tmp_path, monkeypatch):
    """Small tensors share packed chunks, read whole by the loading thread while the reading threads load the
    large ones: each chunk's CRC32C is still computed once, and every value comes back."""
    g = torch.Generator().manual_seed(1)
    state = {f"s{i}": torch.randn(100 + i, generator=g) for i in range(40)}
    state["big"] = torch.randn(ELEMS, generator=g)
    state["meta"] = {"lr": 0.1, "name": "x"}
    with tg.CheckpointManager(tmp_path, async_save=False, compression="off") as mgr:
        mgr.save(1, {"m": state})
    chunks = read_manifest(tmp_path, 1).chunks.values()
    assert any(r.length < 4 * ELEMS for r in chunks)  # a packed chunk exists
    seen = crc_bytes_counter(monkeypatch)
    out = {"m": {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}}
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    mgr.restore(1, out)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out["m"][k], v), k
        else:
            assert out["m"][k] == v
    assert sum(seen) == sum(r.length for r in chunks) == mgr.last_restore.verify_bytes


@pytest.mark.parametrize("verify", [True, False])
def test_the_non_finite_scan_reads_each_byte_once_and_counts_each_value_once(tmp_path, monkeypatch, verify):
    """With ``verify_before_load`` the NaN/Inf count of a tensor read straight into memory runs in the pass
    that checks the chunks (the disk is the bottleneck there), not again in the load; without it, in the load.
    Either way each byte is scanned once and the saved NaN/Inf are each counted once, also for two tensors
    that share one chunk (same bytes: deduplicated)."""
    import trainguard.distributed.chunkread as chunkread_mod

    t, _ = one_chunk(tmp_path / "a")
    with tg.CheckpointManager(tmp_path, async_save=False, check_finite="off", compression="off") as mgr:
        mgr.save(1, {"w": t, "twin": t.clone()})
    (rec,) = read_manifest(tmp_path, 1).chunks.values()  # the twin shares the chunk
    scanned: list[int] = []
    real = chunkread_mod.count_nonfinite_buffer

    def counting(view, dtype):
        scanned.append(len(view))
        return real(view, dtype)

    monkeypatch.setattr(chunkread_mod, "count_nonfinite_buffer", counting)
    out = {"w": torch.zeros_like(t), "twin": torch.zeros_like(t)}
    mgr = tg.CheckpointManager(tmp_path, read_only=True, check_finite="error", verify_before_load=verify)
    with pytest.raises(tg.SuspectCheckpointError, match="non-finite") as e:
        mgr.restore(1, out)
    assert "w (2 non-finite" in str(e.value) and "twin (2 non-finite" in str(e.value), str(e.value)
    assert sum(scanned) == (1 if verify else 2) * rec.length  # verify: one scan of the shared chunk
