"""The restore, download and upload paths of tiers: every byte read is checked against its CRC32C exactly once
(never zero, never twice), a chunk intact nowhere falls back to an older step even when only tiers hold it, the
second tier serves what the first holds corrupt, a download never leaves a partial or corrupt file, and an
upload sends each chunk's CRC32C as the object's checksum."""

from __future__ import annotations

import base64
import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import crc32c
import pytest

import trainguard as tg
from trainguard.format import manifest_from_json
from trainguard.recovery.events import read_events

from .helpers import CHUNK, chunks_only_in_step_2, make_state, same, save_two_steps, train, weights


def _chunks(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in (root / "chunks").rglob("*") if p.is_file()}


@pytest.fixture
def crc_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """sha256 of the bytes of every CRC32C computed while the test runs -> how many times."""
    seen: Counter[str] = Counter()
    real = crc32c.crc32c

    def counting(data: Any, value: int = 0) -> int:
        seen[hashlib.sha256(bytes(data)).hexdigest()] += 1
        return real(data, value)

    monkeypatch.setattr(crc32c, "crc32c", counting)
    return seen


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "hot_holds_it,verify_first",
    [(False, False), (True, False), (False, True)],
    ids=["tier", "hot", "tier-verify"],
)
def test_a_restore_with_tiers_checks_each_chunk_it_loads_exactly_once(
    tmp_path: Path, crc_calls: Counter[str], hot_holds_it: bool, verify_first: bool
) -> None:
    """Streaming (``verify_before_load=False``): one CRC32C per chunk, where it was read. With the check before
    the load (the default), a chunk read from a tier is still read and checked once (then copied)."""
    shared = tmp_path / "shared"
    state = make_state()
    hot = tmp_path / ("node1" if hot_holds_it else "node2")
    with tg.CheckpointManager(
        tmp_path / "node1", tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK
    ) as mgr:
        train(state, 2)
        mgr.save(3, state).wait()
    chunks = _chunks(shared)
    assert len(chunks) > 2
    crc_calls.clear()
    fresh = make_state(seed=9)
    with tg.CheckpointManager(
        hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK, verify_before_load=verify_first
    ) as mgr:
        assert mgr.restore_latest(fresh) == 3
    assert same(weights(state), weights(fresh))
    # each chunk's bytes went through CRC32C once: where they were read (hot root or tier), not again after
    assert {k: crc_calls[hashlib.sha256(v).hexdigest()] for k, v in chunks.items()} == dict.fromkeys(
        chunks, 1
    )
    assert (
        _chunks(hot) == chunks
    )  # the hot root holds every chunk (written behind the restore when it lacked them)


def test_a_step_only_tiers_hold_with_a_chunk_intact_nowhere_falls_back_to_an_older_tier_step(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "shared"
    w1, _ = save_two_steps(tmp_path / "node1", [tg.Tier(str(shared))])
    _flip(shared / chunks_only_in_step_2(shared)[0])
    hot = tmp_path / "node2"  # empty: both steps are only on the tier
    fresh = make_state(seed=5)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 1
    assert same(w1, weights(fresh))
    skipped = list(read_events(hot, event="restore_skipped"))
    assert [s["step"] for s in skipped] == [2] and "CRC32C" in skipped[0]["problem"]
    assert not (hot / "step-000000002").exists()  # no record of a step the hot root never held
    with tg.CheckpointManager(hot, read_only=True) as ro:
        assert [(i.step, i.status) for i in ro.checkpoints()] == [(1, "valid")]


def test_a_chunk_corrupt_on_the_first_tier_is_read_from_the_second(tmp_path: Path) -> None:
    a, b = tmp_path / "tier-a", tmp_path / "tier-b"
    _, w2 = save_two_steps(tmp_path / "node1", [tg.Tier(str(a)), tg.Tier(str(b))])
    bad = chunks_only_in_step_2(a)[0]
    _flip(a / bad)
    hot = tmp_path / "node2"
    fresh = make_state(seed=6)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(a)), tg.Tier(str(b))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 2
    assert same(w2, weights(fresh))
    sources = {e["chunk"]: e["from"] for e in read_events(hot, event="tier_repair")}
    assert sources[bad] == str(b)
    assert set(sources.values()) == {str(a), str(b)}  # every other chunk came from the first tier
    assert (hot / bad).read_bytes() == (b / bad).read_bytes()


@pytest.mark.s3
def test_prefetch_streams_to_files_and_never_leaves_a_corrupt_or_partial_one(
    bucket: str, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run"
    w1, _ = save_two_steps(tmp_path / "node1", [tg.Tier(url)])
    from trainguard.storage.objects import open_objects

    store = open_objects(url)
    bad = chunks_only_in_step_2(tmp_path / "node1")[0]
    data = bytearray(store.get(bad))
    data[0] ^= 0x01
    store.put(bad, bytes(data))  # same length, wrong CRC32C on the only tier
    hot = tmp_path / "node2"
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.prefetch() == 1
    assert not (hot / bad).exists()
    assert not [p for p in hot.rglob("*") if ".tmp-" in p.name]
    assert not (hot / "step-000000002" / "manifest.json").exists()
    fresh = make_state(seed=7)
    with tg.CheckpointManager(hot, read_only=True) as ro:  # the hot root alone
        assert [(i.step, i.status) for i in ro.checkpoints()] == [(1, "valid")]
        assert ro.restore_latest(fresh) == 1
    assert same(w1, weights(fresh))


@pytest.mark.s3
def test_an_upload_sends_each_chunks_crc32c_as_the_objects_checksum(bucket: str, tmp_path: Path) -> None:
    from trainguard.storage.objects import open_objects
    from trainguard.tiers.upload import TierLink, Uploader

    hot = tmp_path / "hot"
    state = make_state()
    with tg.CheckpointManager(hot, chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
    url = f"s3://{bucket}/run"
    link = TierLink(tg.Tier(url), open_objects(url))
    sent: dict[str, str | None] = {}

    def capture(request: Any, **_: Any) -> None:
        key = request.url.split("?", 1)[0].rsplit("/run/", 1)[-1]
        sent[key] = request.headers.get("x-amz-checksum-crc32c")

    events = link.store.client.meta.events  # type: ignore[attr-defined]
    events.register("before-send.s3.PutObject", capture)
    try:
        up = Uploader(hot, [link], lambda *a, **k: None)
        up.upload(link, 1)
        up.close()
    finally:
        events.unregister("before-send.s3.PutObject", capture)
    m = manifest_from_json((hot / "step-000000001/manifest.json").read_bytes())
    expected = {
        rec.path: base64.b64encode(rec.crc32c.to_bytes(4, "big")).decode() for rec in m.chunks.values()
    }
    got = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in sent.items() if k.startswith("chunks/")}
    assert got == expected


@pytest.mark.s3
def test_stores_with_the_same_configuration_share_one_client_and_a_new_environment_gets_another(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.storage.s3 import S3Objects

    a = S3Objects(f"s3://{bucket}/a")
    b = S3Objects(f"s3://{bucket}/b")
    assert a.client is b.client
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
    c = S3Objects(f"s3://{bucket}/c")
    assert c.client is not a.client
    c.put("x", b"1")  # the new client works
    assert c.get("x") == b"1"


def test_the_nan_scan_after_a_load_runs_per_chunk_as_the_chunks_land_and_still_catches_a_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from trainguard.validation import finite

    good = {"w": torch.randn(64, 1024), "b": torch.randn(16)}
    bad = {k: v.clone() for k, v in good.items()}
    bad["w"][40, 7] = float("nan")  # in the last of the weight's 16 KiB chunks
    with tg.CheckpointManager(tmp_path, check_finite="off", chunk_size_bytes=CHUNK) as mgr:
        mgr.save(1, {"model": good}).wait()
        mgr.save(2, {"model": bad}).wait()
    scanned_whole: list[int] = []
    real = finite.count_nonfinite

    def spy(t: Any) -> int:
        scanned_whole.append(t.numel())
        return real(t)

    monkeypatch.setattr(finite, "count_nonfinite", spy)  # the scan after the load (not the reading threads')
    target = {"model": {k: torch.zeros_like(v) for k, v in good.items()}}
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest(target) == 1  # step 2's NaN found, the restore fell back
        assert (
            mgr.last_restore.skipped[0]["step"] == 2 and "model.w" in mgr.last_restore.skipped[0]["problem"]
        )
    assert torch.equal(target["model"]["w"], good["w"])
    assert 64 * 1024 not in scanned_whole  # the weight was scanned chunk by chunk as it was read
