"""Rate-capped verify, the background scrubber, ``trainguard gc`` and ``trainguard mark`` (issue 11)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli.main import main
from trainguard.integrity.verify import verify
from trainguard.recovery.events import read_events
from trainguard.validation.scrub import RateLimiter, gc


def _save(root, steps, *, n=1 << 18, **kw):
    with tg.CheckpointManager(root, save_policy=tg.EveryNSteps(1), chunk_size_bytes=1 << 20, **kw) as mgr:
        for s in steps:
            g = torch.Generator().manual_seed(s)
            mgr.save(s, {"w": torch.randn(n, generator=g)}).wait()


def test_verify_at_a_50MBps_cap_reads_at_most_55MBps(tmp_path):
    _save(tmp_path, [1, 2], compression="off")  # 2 x 1 MiB of distinct chunks, stored as they are
    limiter = RateLimiter(50e6)
    t0 = time.monotonic()
    report = verify(tmp_path, None, limiter=limiter)
    took = time.monotonic() - t0
    assert report.ok and report.bytes_read == 2 * (1 << 20)
    assert report.bytes_read / took <= 55e6  # sleeping never ends early: a lower bound on time, not flaky


def test_cli_verify_max_bandwidth(tmp_path):
    _save(tmp_path, [1])
    r = CliRunner().invoke(main, ["verify", str(tmp_path), "--all", "--max-bandwidth", "100MB/s", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["ok"] is True
    r = CliRunner().invoke(main, ["verify", str(tmp_path), "--max-bandwidth", "fast"])
    assert r.exit_code == 2 and "--max-bandwidth" in r.output


def test_background_scrubber_finds_bit_rot_before_a_restore(tmp_path):
    mgr = tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), scrub_interval_s=3600)
    for s in (1, 2):
        mgr.save(s, {"w": torch.full((1000,), float(s))}).wait()
    from trainguard.catalog import read_manifest

    m = read_manifest(tmp_path, 2)
    rec = next(iter(m.chunks.values()))
    path = tmp_path / rec.path
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    mgr._scrubber.scrub_once()  # what the thread does every scrub_interval_s
    mgr.close()
    st = {i.step: i for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()}
    assert st[2].status == "corrupt" and st[2].reason and "CRC32C" in st[2].reason
    ev = list(read_events(tmp_path, event="scrub"))
    assert ev and ev[-1]["corrupt"] == [2]
    with pytest.raises(tg.ConfigError, match="scrub_interval_s"):
        tg.CheckpointManager(tmp_path / "x", scrub_interval_s=0)


def test_gc_never_removes_a_referenced_chunk(tmp_path):
    _save(tmp_path, [1, 2, 3], keep=None)
    from trainguard.catalog import read_manifest

    referenced = set()
    for s in (1, 2, 3):
        referenced |= {c.path for c in read_manifest(tmp_path, s).chunks.values()}
    sub = tmp_path / "chunks" / "ab"
    sub.mkdir(exist_ok=True)
    orphan_old, orphan_new = sub / ("ab" + "0" * 30), sub / ("ab" + "1" * 30)
    quarantined_old = sub / ("ab" + "2" * 30 + ".corrupt-1000")
    quarantined_new = sub / ("ab" + "3" * 30 + f".corrupt-{int(time.time())}")
    for f in (orphan_old, orphan_new, quarantined_old, quarantined_new):
        f.write_bytes(b"x" * 100)
    old = time.time() - 2 * 86400
    os.utime(orphan_old, (old, old))
    os.utime(quarantined_old, (old, old))
    report = gc(tmp_path)
    assert report.orphans == [f"chunks/ab/{orphan_old.name}"]
    assert report.quarantined == [f"chunks/ab/{quarantined_old.name}"]
    assert report.bytes_freed == 200 and report.referenced == len({p.rsplit("/", 1)[1] for p in referenced})
    assert orphan_new.exists() and quarantined_new.exists()
    assert all((tmp_path / p).exists() for p in referenced)
    # everything unreferenced and old enough goes, referenced chunks still stay
    r = CliRunner().invoke(
        main, ["gc", str(tmp_path), "--quarantine-older-than", "0s", "--orphans-older-than", "0s", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["bytes_freed"] == 200
    assert all((tmp_path / p).exists() for p in referenced)
    fresh = {"w": torch.empty(1 << 18)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(fresh) == 3


def test_gc_takes_the_root_lock(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        r = CliRunner().invoke(main, ["gc", str(tmp_path)])
        assert r.exit_code == 1 and "lock" in r.output.lower()


def test_mark_and_ls_show_suspect_with_reason(tmp_path):
    _save(tmp_path, [1, 2])
    runner = CliRunner()
    r = runner.invoke(main, ["mark", str(tmp_path), "2", "--suspect", "loss spiked at 2"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["ls", str(tmp_path), "--json"])
    rows = {row["step"]: row for row in json.loads(r.output)}
    assert rows[2]["status"] == "suspect" and rows[2]["reason"] == "loss spiked at 2"
    assert rows[1]["status"] == "valid" and rows[1]["reason"] is None
    r = runner.invoke(main, ["ls", str(tmp_path)])
    assert "suspect" in r.output and "loss spiked at 2" in r.output
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": torch.empty(1 << 18)}) == 1
    r = runner.invoke(main, ["mark", str(tmp_path), "2", "--clear"])
    assert r.exit_code == 0 and "cleared" in r.output
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": torch.empty(1 << 18)}) == 2
    assert runner.invoke(main, ["mark", str(tmp_path), "2"]).exit_code == 2
    assert runner.invoke(main, ["mark", str(tmp_path), "9", "--clear"]).exit_code == 2


def test_mark_works_while_a_job_holds_the_lock_and_refuses_a_symlinked_marker(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3)}).wait()
        r = CliRunner().invoke(main, ["mark", str(tmp_path), "1", "--suspect", "checking"])
        assert r.exit_code == 0, r.output
    marker = tmp_path / "step-000000001" / "suspect.json"
    marker.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"reason": "not mine"}))
    marker.symlink_to(target)
    info = {i.step: i for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()}[1]
    assert info.status == "suspect" and "unreadable marker" in info.reason  # counted, never followed


def test_scrub_max_bandwidth_caps_the_background_scrubber_and_is_checked(tmp_path):
    mgr = tg.CheckpointManager(
        tmp_path, save_policy=tg.EveryNSteps(1), scrub_interval_s=3600, scrub_max_bandwidth="200MB/s"
    )
    assert mgr.scrub_max_bandwidth == 200e6 and mgr._scrubber.max_bytes_per_s == 200e6
    mgr.save(1, {"w": torch.ones(1000)}).wait()
    mgr._scrubber.scrub_once()
    mgr.close()
    assert list(read_events(tmp_path, event="scrub"))[-1]["corrupt"] == []
    with tg.CheckpointManager(tmp_path / "n", scrub_interval_s=3600, scrub_max_bandwidth=5e6) as m:
        assert m._scrubber.max_bytes_per_s == 5e6  # a number is bytes per second
    with tg.CheckpointManager(tmp_path / "d") as m:
        assert m.scrub_max_bandwidth is None  # default: uncapped
    for bad in ("fast", 0, -1, "200MB", float("nan"), float("inf"), True, [1]):
        with pytest.raises(tg.ConfigError, match="scrub_max_bandwidth") as e:
            tg.CheckpointManager(tmp_path / "x", scrub_interval_s=3600, scrub_max_bandwidth=bad)
        assert "200MB/s" in str(e.value)  # the fix is named
