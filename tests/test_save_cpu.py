"""CPU work per save (issue 15), counted rather than timed: every byte of a new raw chunk is hashed once, and
the unchanged-state save hashes each large tensor once and writes nothing."""

from __future__ import annotations

import pytest
import torch
import xxhash

import trainguard as tg
from trainguard.incremental.chunkstore import ChunkStore
from trainguard.incremental.delta import IncrementalState


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes passed to xxh3-128 (the chunk naming hash), one entry per call."""
    calls: list[int] = []
    real = xxhash.xxh3_128_hexdigest

    def counting(buf, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(memoryview(buf).nbytes)
        return real(buf, *args, **kwargs)

    monkeypatch.setattr(xxhash, "xxh3_128_hexdigest", counting)
    return calls


def test_each_byte_of_a_new_raw_chunk_is_hashed_once(tmp_path, hashed):
    g = torch.Generator().manual_seed(0)
    state = {"model": {"a": torch.randn(256, 1024, generator=g), "b": torch.randn(512, 512, generator=g)}}
    logical = sum(t.nbytes for t in state["model"].values())
    with tg.CheckpointManager(tmp_path, async_save=False, compression="off") as mgr:
        hashed.clear()
        res = mgr.save(1, state).wait()
        assert res.bytes_written == logical  # raw chunks, all new
        assert sum(hashed) == logical, hashed  # not twice (the piece's hash is the chunk's name)
        hashed.clear()
        res = mgr.save(2, state).wait()  # unchanged: every piece deduplicated, hashed once, nothing written
        assert res.bytes_written == 0
        assert sum(hashed) == logical, hashed
    out = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    tg.CheckpointManager(tmp_path, read_only=True).restore(2, out)
    for k, v in state["model"].items():
        assert torch.equal(out["model"][k].view(torch.uint8), v.view(torch.uint8)), k


def test_an_uncompressed_save_with_piece_memory_hashes_each_piece_once(tmp_path, hashed):
    """``compression="auto"`` deciding "off" keeps an encoder (piece memory for the next save): its piece hash
    names the raw chunk, the store does not hash the bytes again."""
    store = ChunkStore(tmp_path, fsync=False)
    piece = memoryview(torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)).numpy()).cast("B")
    (tmp_path / "partial").mkdir()
    enc = IncrementalState(delta=False, max_chain=4).begin(compress=False)
    chain, written = enc.put_piece(store, "partial", ("w", (), 0), piece, 4, step=1)
    assert written and sum(hashed) == piece.nbytes, hashed
    assert chain[0].hash == xxhash.xxh3_128_hexdigest(piece)  # the name is still the content hash


def test_the_manifest_is_encoded_once_and_byte_identical_to_the_canonical_form(tmp_path):
    """``manifest_to_json`` joins the sorted members around ``crc32c`` instead of encoding twice: the bytes are
    those of ``json.dumps(body, sort_keys=True)`` and the CRC32C is over the body without the field."""
    import json

    import crc32c

    from trainguard.format.manifest import manifest_from_json, manifest_to_json

    state = {"model": {"w": torch.randn(64, 64), "n": torch.tensor(3)}, "epoch": 2, "name": "héllo"}
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state, metrics={"loss": 0.5})
    data = (tmp_path / "step-000000001" / "manifest.json").read_bytes()
    m = manifest_from_json(data)
    out = manifest_to_json(m)
    body = json.loads(out)
    assert out == json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    crc = body.pop("crc32c")
    assert crc == crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    assert manifest_from_json(out) == m


@pytest.mark.parametrize("async_save", [False, True])
def test_a_single_process_save_builds_no_dcp_log_record_per_entry(tmp_path, async_save):
    """dcp.save wraps every entry's state_dict() in a logger that builds two DEBUG records (and a uuid4) per
    entry and save; one process drives the planner and writer itself (trainguard.distributed.local)."""
    import logging

    from torch.distributed.checkpoint.logging_handlers import DCP_LOGGER_NAME

    records: list[logging.LogRecord] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    dcp_logger = logging.getLogger(f"c10d-NullHandler-{DCP_LOGGER_NAME}")
    handler = Count(level=logging.DEBUG)
    state = {"model": {f"w{i}": torch.full((64,), float(i)) for i in range(50)}, "note": "x"}
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state).wait()  # DCP imported by now
        dcp_logger.addHandler(handler)
        try:
            mgr.save(2, state).wait()
        finally:
            dcp_logger.removeHandler(handler)
        assert mgr.latest_step() == 2
    assert records == []
    restored = {"model": {f"w{i}": torch.zeros(64) for i in range(50)}, "note": None}
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(restored) == 2
    assert all(torch.equal(restored["model"][f"w{i}"], state["model"][f"w{i}"]) for i in range(50))
    assert restored["note"] == "x"
