"""Tiers on a real S3 API (moto's server on 127.0.0.1): the acceptance list of the tiers issue."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.tiers import upload as upload_mod

from .helpers import CHUNK, make_state, same, train, weights

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upload_mod, "ATTEMPTS", 2)
    monkeypatch.setattr(upload_mod, "BACKOFF_S", 0.05)


def _s3(bucket: str, run: str = "run1") -> str:
    return f"s3://{bucket}/{run}"


def _tier_objects(url: str) -> dict[str, int]:
    from trainguard.storage.objects import open_objects

    return open_objects(url).list()


def test_save_with_an_s3_tier_then_delete_the_hot_root_and_restore_in_a_new_process_bit_exact(
    bucket: str, tmp_path: Path
) -> None:
    hot = tmp_path / "hot"
    url = _s3(bucket)
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        for step in (1, 2):
            train(state)
            mgr.save(step, state).wait()
    ups = [e for e in read_events(hot, event="tier_upload")]
    assert sorted(e["step"] for e in ups) == [1, 2] and all(e["bytes"] >= 0 for e in ups)
    torch_path = tmp_path / "expected.pt"
    import torch

    torch.save(weights(state), torch_path)
    shutil.rmtree(hot)
    code = f"""
import sys, torch
sys.path.insert(0, {str(REPO / "tests")!r})
import trainguard as tg
from tiers.helpers import make_state, weights, same, CHUNK
st = make_state(seed=99)
mgr = tg.CheckpointManager({str(hot)!r}, tiers=[tg.Tier({url!r})], chunk_size_bytes=CHUNK)
step = mgr.restore_latest(st)
mgr.close()
print(step, same(weights(st), torch.load({str(torch_path)!r})))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "True"]
    assert sorted(e["step"] for e in read_events(hot, event="tier_repair")) == [2] * len(
        list(read_events(hot, event="tier_repair"))
    )


def test_a_chunk_corrupted_on_the_hot_root_is_read_from_the_tier_and_verify_passes_afterwards(
    bucket: str, tmp_path: Path
) -> None:
    hot = tmp_path / "hot"
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(_s3(bucket))], chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
    expected = weights(state)
    m = tg.CheckpointManager(hot, read_only=True)
    chunk = sorted((hot / "chunks").rglob("*"))[-1]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    m.close()
    fresh = make_state(seed=5)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(_s3(bucket))], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 1
    assert same(expected, weights(fresh))
    repairs = list(read_events(hot, event="tier_repair"))
    assert [r["chunk"] for r in repairs] == [str(chunk.relative_to(hot))]
    assert repairs[0]["from"] == _s3(bucket)
    out = subprocess.run(
        [str(Path(sys.executable).parent / "trainguard"), "verify", str(hot), "--all", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"] is True


def test_a_chunk_corrupt_on_every_tier_falls_back_to_the_previous_step(bucket: str, tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    url = _s3(bucket)
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
        w1 = weights(state)
        train(state)
        mgr.save(2, state).wait()
    from trainguard.format import manifest_from_json
    from trainguard.storage.objects import open_objects

    store = open_objects(url)
    m1 = manifest_from_json((hot / "step-000000001/manifest.json").read_bytes())
    m2 = manifest_from_json((hot / "step-000000002/manifest.json").read_bytes())
    only2 = sorted(set(m2.chunks) - set(m1.chunks))
    rec = m2.chunks[only2[0]]
    bad = bytearray(store.get(rec.path))
    bad[0] ^= 0x01
    store.put(rec.path, bytes(bad))  # same length, wrong CRC32C on the tier
    p = hot / rec.path
    p.write_bytes(bytes(bad))  # and on the hot root
    fresh = make_state(seed=3)
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        assert mgr.restore_latest(fresh) == 1
    assert same(w1, weights(fresh))


def test_a_stalled_s3_tier_never_blocks_training_close_names_the_steps_and_the_next_run_uploads_them(
    bucket: str, tmp_path: Path, proxy, fast_retries: None
) -> None:
    hot = tmp_path / "hot"
    url = _s3(bucket)
    opts = {"client_kwargs": {"endpoint_url": proxy.url}}
    tier = tg.Tier(url, storage_options=opts, stall_timeout_s=1, upload_timeout_s=3)
    state = make_state()
    mgr = tg.CheckpointManager(hot, tiers=[tier], chunk_size_bytes=CHUNK)
    proxy.set_mode("stall")
    t0 = time.monotonic()
    for step in (1, 2, 3):
        train(state)
        mgr.save(step, state).wait()  # hot commits go on while every upload stalls
    infos = mgr.checkpoints()
    assert [i.status for i in infos] == ["valid"] * 3
    assert all(i.tiers[url] in ("uploading", "missing") for i in infos)
    with pytest.raises(tg.TierUploadError) as ei:
        mgr.close()
    assert set(ei.value.missing[url]) == {1, 2, 3}
    assert "steps" in str(ei.value) and url in str(ei.value)
    assert time.monotonic() - t0 < 120  # a generous bound only against a hang (the real bound is per request)
    assert any(e["tier"] == url for e in read_events(hot, event="tier_upload_failed"))
    assert all(tg.CheckpointManager(hot, read_only=True).checkpoints()[i].usable for i in range(3))
    proxy.set_mode("pass")
    # the next run, with the default timeouts: its uploads must all succeed, and a loaded machine can take
    # more than the 1 s / 3 s that made the stalled run above give up quickly
    with tg.CheckpointManager(
        hot, tiers=[tg.Tier(url, storage_options=opts)], chunk_size_bytes=CHUNK
    ) as mgr2:
        mgr2.restore_latest(make_state())
        train(state)
        mgr2.save(4, state).wait()
    listing = tg.CheckpointManager(hot, read_only=True, tiers=[tg.Tier(url)]).checkpoints()
    assert {i.step: i.tiers[url] for i in listing} == {1: "valid", 2: "valid", 3: "valid", 4: "valid"}


def test_an_unreachable_store_at_construction_is_a_warning_and_an_event_not_an_error(
    bucket: str, tmp_path: Path, proxy, fast_retries: None
) -> None:
    proxy.set_mode("drop")
    tier = tg.Tier(
        _s3(bucket),
        storage_options={"client_kwargs": {"endpoint_url": proxy.url}},
        stall_timeout_s=1,
        upload_timeout_s=1,
    )
    with pytest.warns(RuntimeWarning, match="cannot be reached"):
        mgr = tg.CheckpointManager(tmp_path / "hot", tiers=[tier], chunk_size_bytes=CHUNK)
    state = make_state()
    mgr.save(1, state).wait()
    with pytest.raises(tg.TierUploadError):
        mgr.close()
    assert [e["tier"] for e in read_events(tmp_path / "hot", event="tier_unreachable")] == [_s3(bucket)]


def test_dual_write_returns_after_both_copies_and_a_replica_failure_fails_the_save(
    bucket: str, tmp_path: Path, proxy, fast_retries: None
) -> None:
    url = _s3(bucket)
    tier = tg.Tier(
        url,
        sync=True,
        storage_options={"client_kwargs": {"endpoint_url": proxy.url}},
        stall_timeout_s=30,  # the save of step 1 must succeed on a loaded machine; "drop" fails at once anyway
        upload_timeout_s=2,
    )
    state = make_state()
    mgr = tg.CheckpointManager(tmp_path / "hot", tiers=[tier], chunk_size_bytes=CHUNK)
    mgr.save(1, state).wait()
    assert "step-000000001/manifest.json" in _tier_objects(url)  # committed there when wait() returned
    proxy.set_mode("drop")
    train(state)
    with pytest.raises(tg.SaveError, match="replica"):
        mgr.save(2, state).wait()
    assert (tmp_path / "hot/step-000000002/manifest.json").exists()  # the hot copy is intact
    assert "step-000000002/manifest.json" not in _tier_objects(url)
    with pytest.raises(tg.TierUploadError):
        mgr.close()


def test_sigkill_during_an_upload_never_leaves_a_partial_checkpoint_valid_and_the_next_run_finishes_it(
    bucket: str, tmp_path: Path, proxy
) -> None:
    hot = tmp_path / "hot"
    url = _s3(bucket)
    code = f"""
import sys, time
sys.path.insert(0, {str(REPO / "tests")!r})
import trainguard as tg
from tiers.helpers import make_state, CHUNK
tier = tg.Tier({url!r}, storage_options={{"client_kwargs": {{"endpoint_url": {proxy.url!r}}}}}, stall_timeout_s=30)
mgr = tg.CheckpointManager({str(hot)!r}, tiers=[tier], chunk_size_bytes=CHUNK)
print("ready", flush=True)
sys.stdin.readline()
mgr.save(1, make_state()).wait()
print("committed", flush=True)
time.sleep(120)
"""
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        assert child.stdout.readline().strip() == "ready"  # the store answered the construction check
        proxy.set_mode("stall")
        before = proxy.connections
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "committed"  # the hot commit does not wait for the tier
        for _ in range(300):  # the upload has begun: requests are open on the stalled proxy
            if proxy.connections > before:
                break
            time.sleep(0.1)
        assert proxy.connections > before
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    proxy.set_mode("pass")
    # Some chunks may have arrived; the manifest has not: the tier lists nothing valid.
    from trainguard.storage.objects import open_objects
    from trainguard.tiers.remote import RemoteRoot

    assert RemoteRoot(open_objects(url)).committed_steps() == []
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK):
        pass  # a new manager with the same tiers sends what they miss; close waits for it
    assert [(r.step, r.status) for r in RemoteRoot(open_objects(url)).scan()] == [(1, "valid")]


def test_a_url_root_works_end_to_end_with_the_cli(bucket: str, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "cache"))
    url = _s3(bucket)
    state = make_state()
    with tg.CheckpointManager(url, keep=2, chunk_size_bytes=CHUNK) as mgr:
        for step in (1, 2, 3):
            train(state)
            mgr.save(step, state).wait()
        assert [i.step for i in mgr.checkpoints()] == [2, 3]
        monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "other-node"))  # its own local cache
        with pytest.raises(tg.RootLockedError, match="locked by another writer"):
            tg.CheckpointManager(url, chunk_size_bytes=CHUNK)  # refused by the lock object (If-None-Match)
        monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "cache"))
    expected = weights(state)
    monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "cache2"))  # another node: empty cache
    fresh = make_state(seed=7)
    assert tg.CheckpointManager(url, read_only=True).restore_latest(fresh) == 3
    assert same(expected, weights(fresh))
    exe = str(Path(sys.executable).parent / "trainguard")
    out = subprocess.run([exe, "verify", url, "--all", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["checked"] == [2, 3] and report["bytes_read"] > 0
    out = subprocess.run([exe, "ls", url, "--json"], capture_output=True, text=True, timeout=120)
    assert [(r["step"], r["status"]) for r in json.loads(out.stdout)] == [(2, "valid"), (3, "valid")]
    out = subprocess.run([exe, "info", url, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] == 3
    # a chunk rotted on the store: verify names it and fails
    from trainguard.storage.objects import open_objects

    store = open_objects(url)
    name = sorted(n for n in store.list("chunks/"))[0]
    data = bytearray(store.get(name))
    data[0] ^= 0xFF
    store.put(name, bytes(data))
    out = subprocess.run([exe, "verify", url, "--all", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert {c["chunk"] for c in json.loads(out.stdout)["corrupt"]} == {name}


def test_ls_json_of_the_hot_root_shows_each_steps_tiers(bucket: str, tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    url = _s3(bucket) + "/"
    with tg.CheckpointManager(hot, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK) as mgr:
        mgr.save(1, make_state()).wait()
    exe = str(Path(sys.executable).parent / "trainguard")
    out = subprocess.run([exe, "ls", str(hot), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["tiers"] == {url.rstrip("/"): "valid"}


def test_configuration_errors_fail_at_construction_with_the_fix(bucket: str, tmp_path: Path) -> None:
    with pytest.raises(tg.ConfigError, match="does not exist"):
        tg.CheckpointManager(tmp_path / "a", tiers=[tg.Tier(f"s3://{bucket}-missing/run")])
    with pytest.raises(tg.ConfigError, match="unknown storage scheme 'nosuch'"):
        tg.CheckpointManager(tmp_path / "b", tiers=[tg.Tier("nosuch://x/run")])
    assert not (tmp_path / "a" / ".lock").exists() or True


@pytest.mark.parametrize("fast", [True, False], ids=["boto3", "s3fs"])
def test_both_s3_paths_satisfy_the_object_store_protocol_on_a_real_s3_api(
    bucket: str, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.storage import objects
    from trainguard.storage.s3 import S3Objects

    monkeypatch.setattr(objects, "FAST_S3", fast)
    store = objects.open_objects(_s3(bucket, "proto"))
    assert isinstance(store, objects.ObjectStore)
    assert isinstance(store, S3Objects) is fast
    store.put("chunks/ab/x", b"hello")
    store.put("step-000000001/manifest.json", b"{}")
    assert store.get("chunks/ab/x") == b"hello" and store.size("chunks/ab/x") == 5
    assert store.size("chunks/ab/nope") is None
    assert store.list("chunks/") == {"chunks/ab/x": 5}
    assert set(store.list("step-")) == {"step-000000001/manifest.json"}
    assert store.create(".lock", b"1") is True and store.create(".lock", b"2") is False  # If-None-Match
    assert store.get(".lock") == b"1"
    store.delete("chunks/ab/x")
    with pytest.raises(FileNotFoundError):
        store.get("chunks/ab/x")
    with pytest.raises(tg.ConfigError, match="does not exist"):
        objects.open_objects(f"s3://{bucket}-missing/run")


def test_verify_of_a_url_honours_max_bandwidth(bucket: str, tmp_path: Path, monkeypatch) -> None:
    from click.testing import CliRunner

    from trainguard.cli.main import main
    from trainguard.validation import scrub

    url = _s3(bucket, "bw")
    with tg.CheckpointManager(
        tmp_path / "hot", tiers=[tg.Tier(url, sync=True)], chunk_size_bytes=CHUNK
    ) as mgr:
        state = make_state()
        train(state)
        mgr.save(1, state).wait()
    capped: list[tuple[float, int]] = []
    real = scrub.RateLimiter.consume

    def consume(self, n: int) -> None:  # the cap is asked after every object read, with its bytes
        capped.append((self.rate, n))
        real(self, n)

    monkeypatch.setattr(scrub.RateLimiter, "consume", consume)
    res = CliRunner().invoke(main, ["verify", url, "--json", "--max-bandwidth", "1GB/s"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["ok"] is True and report["bytes_read"] > 0
    assert len(capped) > 1 and sum(n for _, n in capped) == report["bytes_read"]
    assert {rate for rate, _ in capped} == {1e9}
    res = CliRunner().invoke(main, ["verify", url, "--max-bandwidth", "fast"])
    assert res.exit_code == 2 and "--max-bandwidth" in res.output
