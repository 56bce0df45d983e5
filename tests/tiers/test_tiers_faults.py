"""Tier faults through the FaultyStorage seam on a real S3 API (moto's server): a tier is given as
``tg.Tier(FaultyStorage(open_object_storage(url), Fault(...)))`` and every PUT, GET and listing of the tier
goes through the Storage protocol. Network stalls and drops stay in test_tiers_s3.py (a real TCP proxy)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.storage import Fault, FaultyStorage, open_object_storage
from trainguard.tiers import upload as upload_mod
from trainguard.tiers.remote import RemoteRoot

from .helpers import CHUNK, chunks_only_in_step_2, make_state, same, save_two_steps, train, weights

pytestmark = pytest.mark.s3


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_mod, "ATTEMPTS", 3)
    monkeypatch.setattr(upload_mod, "BACKOFF_S", 0.01)


def _url(bucket: str) -> str:
    return f"s3://{bucket}/run1"


def _tier_scan(url: str) -> list[tuple[int, str]]:
    from trainguard.storage.objects import open_objects

    return [(r.step, r.status) for r in RemoteRoot(open_objects(url)).scan()]


def test_a_failed_put_of_the_nth_chunk_is_retried_and_the_upload_completes(
    bucket: str, tmp_path: Path, fast_retries: None
) -> None:
    url = _url(bucket)
    s3 = FaultyStorage(open_object_storage(url), Fault("write", match="chunks/*", nth=2, errno=errno.EIO))
    hot = tmp_path / "hot"
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(s3)], chunk_size_bytes=CHUNK) as mgr:
        mgr.save(1, state).wait()
    assert [op for op, _key, what in s3.injected] == ["write"] and s3.injected[0][2] == "errno 5"
    (failed,) = read_events(hot, event="tier_upload_failed")
    assert failed["step"] == 1 and failed["attempt"] == 1 and failed["tier"] == url
    assert failed["error"].startswith("OSError")
    (up,) = read_events(hot, event="tier_upload")
    assert up["step"] == 1 and up["chunks"] > 1
    assert _tier_scan(url) == [(1, "valid")]
    problem, _chunk, nbytes = RemoteRoot(open_object_storage(url).store).verify(1)  # every CRC32C
    assert problem is None and nbytes > 0


def test_a_persistent_put_failure_names_the_step_in_tier_upload_error_and_leaves_the_hot_checkpoint(
    bucket: str, tmp_path: Path, fast_retries: None
) -> None:
    url = _url(bucket)
    s3 = FaultyStorage(
        open_object_storage(url), Fault("write", match="*/manifest.json", times=None, errno=errno.EIO)
    )
    hot = tmp_path / "hot"
    state = make_state()
    mgr = tg.CheckpointManager(hot, tiers=[tg.Tier(s3, upload_timeout_s=60)], chunk_size_bytes=CHUNK)
    train(state)
    mgr.save(1, state).wait()  # the hot commit does not wait for the tier
    with pytest.raises(tg.TierUploadError) as ei:
        mgr.close()
    assert ei.value.missing == {url: [1]}
    assert "steps [1]" in str(ei.value) and url in str(ei.value)
    fails = list(read_events(hot, event="tier_upload_failed"))
    assert [e["attempt"] for e in fails] == [1, 2, 3]  # every attempt, then given up
    assert len(s3.injected) == 3
    assert _tier_scan(url) == []  # chunks may be there; without the manifest nothing is a checkpoint
    fresh = make_state(seed=9)
    with tg.CheckpointManager(hot, read_only=True) as ro:  # the hot checkpoint is intact
        assert ro.restore_latest(fresh) == 1
    assert same(weights(state), weights(fresh))
    s3.clear()  # the store heals: a new manager with the same tier sends the missing step
    with tg.CheckpointManager(hot, tiers=[tg.Tier(s3)], chunk_size_bytes=CHUNK):
        pass
    assert _tier_scan(url) == [(1, "valid")]


def test_a_bit_flip_on_a_tier_read_is_caught_by_crc32c_and_the_restore_reads_the_next_tier_or_falls_back(
    bucket: str, tmp_path: Path
) -> None:
    url = _url(bucket)
    shared = tmp_path / "shared"  # a second tier: a shared filesystem
    hot = tmp_path / "hot"
    w1, w2 = save_two_steps(hot, [tg.Tier(url), tg.Tier(str(shared))])
    victim = chunks_only_in_step_2(hot)[0]
    shutil.rmtree(hot)  # a new node: the hot root is empty, every chunk comes from a tier

    def flipped() -> FaultyStorage:
        return FaultyStorage(open_object_storage(url), Fault("read", match=victim, times=None, flip_byte=7))

    s3 = flipped()
    fresh = make_state(seed=5)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(s3), tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 2
    assert same(w2, weights(fresh))  # bit-exact: the flipped copy was never loaded
    assert ("read", victim, "flipped byte 7") in s3.injected
    sources = {e["chunk"]: e["from"] for e in read_events(hot, event="tier_repair")}
    assert sources[victim] == str(shared) and {v for k, v in sources.items() if k != victim} == {url}
    # with the S3 tier alone the flipped chunk is intact nowhere: step 2 is passed over, step 1 restored
    shutil.rmtree(hot)
    s3 = flipped()
    fresh = make_state(seed=6)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(s3)], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 1
    assert same(w1, weights(fresh))
    assert any(op == "read" and key == victim for op, key, _ in s3.injected)


def test_a_truncated_object_on_the_tier_is_reported_corrupt_never_restored_and_resent_by_the_next_manager(
    bucket: str, tmp_path: Path
) -> None:
    url = _url(bucket)
    hot = tmp_path / "hot"
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
        w1 = weights(state)
    # close() waited for step 1's upload; now every chunk PUT is torn (the store does not report it)
    s3 = FaultyStorage(
        open_object_storage(url), Fault("write", match="chunks/*", times=None, truncate_to=100)
    )
    with tg.CheckpointManager(hot, tiers=[tg.Tier(s3)], chunk_size_bytes=CHUNK) as mgr:
        mgr.restore_latest(state)
        train(state)
        mgr.save(2, state).wait()
        w2 = weights(state)
    torn = {key for op, key, what in s3.injected if what == "truncated to 100"}
    assert torn and torn == set(chunks_only_in_step_2(hot))  # only the chunks step 1 did not have were sent
    assert _tier_scan(url) == [(1, "valid"), (2, "corrupt")]
    listing = {
        i.step: i.tiers for i in tg.CheckpointManager(hot, read_only=True, tiers=[tg.Tier(url)]).checkpoints()
    }
    assert listing == {1: {url: "valid"}, 2: {url: "corrupt"}}
    node2 = tmp_path / "node2"  # a new node restores from the tier: the torn step is passed over
    fresh = make_state(seed=8)
    with tg.CheckpointManager(node2, read_only=True, tiers=[tg.Tier(url)]) as ro:
        assert ro.restore_latest(fresh) == 1
    assert same(w1, weights(fresh))
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK):
        pass  # a new writer with the same tier re-sends the step the tier holds corrupt
    assert _tier_scan(url) == [(1, "valid"), (2, "valid")]
    shutil.rmtree(node2)
    fresh = make_state(seed=8)
    with tg.CheckpointManager(node2, read_only=True, tiers=[tg.Tier(url)]) as ro:
        assert ro.restore_latest(fresh) == 2
    assert same(w2, weights(fresh))
