"""Async tier uploads yield to training: they pause while a save stages (counted, never timed), a pause is
bounded, a chunk is streamed from the hot root in blocks with its CRC32C checked over the bytes sent, and a
corrupt chunk never becomes an object on the tier (its last block is withheld)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import crc32c
import pytest

import trainguard as tg
import trainguard.tiers.upload as upload_mod
from trainguard.errors import CorruptCheckpointError
from trainguard.format import manifest_from_json
from trainguard.storage.objects import open_objects
from trainguard.tiers.upload import ChunkBody, StagingGate, TierLink, Uploader

from .helpers import CHUNK, make_state, train


def _wait_for(cond: Any, what: str, deadline_s: float = 120.0) -> None:
    """Poll ``cond()`` until true (a generous bound against a hang, not a speed assertion)."""
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.01)


def _hot_with_step(hot: Path) -> Path:
    state = make_state()
    with tg.CheckpointManager(hot, chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
    return hot


def _chunk_records(hot: Path) -> list[Any]:
    return list(manifest_from_json((hot / "step-000000001/manifest.json").read_bytes()).chunks.values())


def test_a_pause_lasts_at_most_its_bound_once_per_save_and_never_after_release() -> None:
    gate = StagingGate()
    gate.yield_to_staging()
    assert gate.pauses == 0  # nothing staging: no wait
    with gate.staging():
        gate.yield_to_staging(max_s=0.01)  # gives up on this save
        gate.yield_to_staging(max_s=0.01)  # and does not wait for it again
        assert gate.pauses == 1
    with gate.staging():  # the next save: waited for again
        gate.yield_to_staging(max_s=0.01)
        assert gate.pauses == 2
        gate_released = StagingGate()
        with gate_released.staging():
            gate_released.release()
            gate_released.yield_to_staging()  # would wait PAUSE_MAX_S (5 s) if release did not end it
            assert gate_released.pauses == 0


def test_a_waiting_worker_goes_on_when_the_save_stops_staging() -> None:
    gate = StagingGate()
    done = threading.Event()

    def worker() -> None:
        gate.yield_to_staging(max_s=600)
        done.set()

    with gate.staging():
        t = threading.Thread(target=worker)
        t.start()
        _wait_for(lambda: gate.pauses == 1, "the worker waits")
        assert not done.is_set()
    t.join(60)
    assert done.is_set()


@pytest.mark.s3
def test_async_uploads_send_no_chunk_while_a_save_stages(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload_mod, "PAUSE_MAX_S", 600.0)  # this test holds the staging as long as it needs
    hot = _hot_with_step(tmp_path / "hot")
    records = _chunk_records(hot)
    url = f"s3://{bucket}/run"
    link = TierLink(tg.Tier(url), open_objects(url))
    events: list[dict[str, Any]] = []
    up = Uploader(hot, [link], lambda name, **k: events.append(k) if name == "tier_upload" else None)
    try:
        with up.gate.staging():
            up.submit(1)
            # every PUT worker reaches the gate before the first block of its chunk is read
            _wait_for(lambda: up.gate.pauses == min(len(records), upload_mod.POOL_WORKERS), "workers pause")
            assert link.store.list("") == {}  # nothing sent while the save stages
        assert up.wait(120) == {}
    finally:
        up.close()
    got = link.store.list("chunks/")
    assert got == {rec.path: rec.length for rec in records}
    assert link.store.list("step-000000001/") != {}
    assert [e["paused"] for e in events] == [up.gate.pauses]  # the event counts the waits


@pytest.mark.s3
@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_the_training_thread_holds_the_gate_while_inside_save(
    bucket: str, tmp_path: Path, async_save: bool
) -> None:
    state = make_state()
    seen: list[int] = []
    model = state["model"]
    real = model.state_dict

    def state_dict(*a: Any, **k: Any) -> Any:
        seen.append(mgr._tiers.uploader.gate._staging)
        return real(*a, **k)

    model.state_dict = state_dict  # type: ignore[method-assign]
    with tg.CheckpointManager(
        tmp_path / "hot", tiers=[tg.Tier(f"s3://{bucket}/run")], chunk_size_bytes=CHUNK, async_save=async_save
    ) as mgr:
        mgr.save(1, state).wait()
        assert mgr._tiers.uploader.gate._staging == 0
    assert seen and all(n == 1 for n in seen)


def test_a_chunk_body_streams_the_file_in_blocks_and_starts_over_on_seek_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload_mod, "BLOCK_BYTES", 4096)
    data = bytes(range(256)) * 70  # 17920 bytes: 4 full blocks and a partial one
    path = tmp_path / "c"
    path.write_bytes(data)
    body = ChunkBody(path, len(data), crc32c.crc32c(data))
    with body:
        assert len(body) == len(data)
        first = b"".join(bytes(body.read(1000)) for _ in range(3))
        assert body.tell() == 3000 and len(body) == len(data) - 3000
        assert body.seek(0) == 0
        assert b"".join(iter(lambda: bytes(body.read(16384)), b"")) == data
        assert body.read(10) == b"" and body.problem is None
        body.seek(0)
        assert bytes(body.read()) == data[:4096]  # one block at a time, never more
        with pytest.raises(io.UnsupportedOperation):
            body.seek(5)
    assert first == data[:3000]


@pytest.mark.parametrize("damage", ["flip-first-block", "flip-last-block", "truncate"])
def test_a_corrupt_chunk_body_withholds_its_last_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    monkeypatch.setattr(upload_mod, "BLOCK_BYTES", 4096)
    data = bytes(range(256)) * 64  # 16384 bytes: 4 blocks
    path = tmp_path / "c"
    bad = bytearray(data)
    if damage == "truncate":
        path.write_bytes(data[:-1])
        with pytest.raises(CorruptCheckpointError, match="16383 bytes long"):
            ChunkBody(path, len(data), crc32c.crc32c(data))
        return
    bad[10 if damage == "flip-first-block" else len(data) - 10] ^= 1
    path.write_bytes(bytes(bad))
    handed: list[bytes] = []
    with ChunkBody(path, len(data), crc32c.crc32c(data)) as body:
        with pytest.raises(CorruptCheckpointError, match="does not match"):
            while chunk := body.read(4096):
                handed.append(bytes(chunk))
        assert body.problem is not None
    assert len(b"".join(handed)) == len(data) - 4096  # the last block never left


@pytest.mark.s3
def test_a_chunk_corrupt_on_the_hot_root_creates_no_object_on_the_tier(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upload_mod, "BLOCK_BYTES", 4096)  # the damage is in a block that was already sent
    hot = _hot_with_step(tmp_path / "hot")
    rec = max(_chunk_records(hot), key=lambda r: r.length)
    assert rec.length > 4096
    f = hot / rec.path
    data = bytearray(f.read_bytes())
    data[1] ^= 0x40
    f.write_bytes(bytes(data))
    url = f"s3://{bucket}/run"
    link = TierLink(tg.Tier(url), open_objects(url))
    failures: list[dict[str, Any]] = []
    up = Uploader(hot, [link], lambda name, **k: failures.append(k) if name == "tier_upload_failed" else None)
    try:
        with pytest.raises(CorruptCheckpointError, match="not uploaded"):
            up.upload(link, 1)
    finally:
        up.close()
    held = link.store.list("")
    assert rec.path not in held  # no object from the damaged chunk
    assert not any(k.endswith("manifest.json") for k in held)  # not committed on the tier
    assert failures == []  # refused at once, not retried as if the store had failed
