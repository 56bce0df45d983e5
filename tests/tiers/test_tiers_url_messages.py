"""What a user sees for a URL run root (``s3://bucket/run``): messages name the URL, never only the local cache,
and the CLI prints a URL root like a local one (moto's S3 server on 127.0.0.1)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

import trainguard as tg
from trainguard._lock import RootLock

from .helpers import CHUNK, make_state

pytestmark = pytest.mark.s3


def test_a_second_writer_on_a_url_root_is_told_the_url_and_the_cache_as_detail(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{bucket}/run2"
    with tg.CheckpointManager(url, chunk_size_bytes=CHUNK) as mgr:
        mgr.save(1, make_state()).wait()
        with pytest.raises(tg.RootLockedError) as ei:  # same process, same cache
            tg.CheckpointManager(url, chunk_size_bytes=CHUNK)
        msg = str(ei.value)
        assert f"writing {url} (its local cache {mgr.root})" in msg, msg


def test_the_lock_held_by_another_process_names_the_url_first(tmp_path: Path) -> None:
    root = tmp_path / "cache" / "roots" / "1b199b70"
    root.mkdir(parents=True)
    # another holder: a separate open file description flock'ed (as another process's would be)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"pid 1 on elsewhere\n")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(tg.RootLockedError) as ei:
            RootLock(root, "s3://bucket1/run2").acquire()
        msg = str(ei.value)
        assert msg.startswith(
            f"run root s3://bucket1/run2 (its local cache {root}) is being written by another"
        ), msg
        assert "pid 1 on elsewhere" in msg
        with pytest.raises(tg.RootLockedError) as ei:  # a local root is named as itself
            RootLock(root).acquire()
        assert str(ei.value).startswith(f"run root {root} is being written by another process"), str(ei.value)
    finally:
        os.close(fd)


def test_ls_and_verify_print_a_url_root_like_a_local_one(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from trainguard.cli.main import main
    from trainguard.storage.objects import open_objects

    monkeypatch.setenv("TRAINGUARD_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{bucket}/run1"
    monkeypatch.chdir(tmp_path)  # a short relative root: the table title shows it whole
    local = Path("local")
    for root in (url, local):
        with tg.CheckpointManager(root, chunk_size_bytes=CHUNK) as mgr:
            for step in (1, 2):
                mgr.save(step, make_state()).wait()
    runner = CliRunner()
    shown = {}
    for root in (url, str(local)):
        r = runner.invoke(main, ["ls", root])
        assert r.exit_code == 0, r.output
        shown[root] = r.output
        assert f"checkpoints in {root}" in r.output and "time (UTC)" in r.output, r.output
        v = runner.invoke(main, ["verify", root, "--all"])
        assert v.exit_code == 0, v.output
        assert "OK 2 checkpoint(s) checked," in v.output and " re-read" in v.output, v.output
    # the same columns and the same time format (to the second, no "T", no milliseconds)
    for out in shown.values():
        assert "step" in out and "status" in out and "size" in out, out
        assert "T" not in "".join(line for line in out.splitlines() if "valid" in line), out
    # a corrupt manifest: one "corrupt", not "CORRUPT corrupt"
    store = open_objects(url)
    [manifest] = [n for n in store.list("step-") if n.endswith("manifest.json") and "0002" in n]
    store.put(manifest, b"{not json")
    v = runner.invoke(main, ["verify", url, "--step", "2"])
    assert v.exit_code == 1, v.output
    assert "step 2: CORRUPT manifest" in v.output and "CORRUPT corrupt" not in v.output, v.output
    assert "FAILED: 1 of 1 checkpoint(s) checked failed," in v.output, v.output


def test_steps_kept_only_while_they_uploaded_are_deleted_by_retention_at_close(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep=2 on the hot root with an S3 tier: steps protected because their upload had not finished are
    deleted once it has (at close at the latest); the tier holds every step it was sent."""
    import threading

    from trainguard.storage.objects import open_objects
    from trainguard.tiers.remote import RemoteRoot
    from trainguard.tiers.upload import Uploader

    gate = threading.Event()
    real = Uploader.upload

    def gated(self: Uploader, link: object, step: int) -> None:
        gate.wait(60)  # every upload waits: retention after each commit must keep every step
        real(self, link, step)  # type: ignore[arg-type]

    monkeypatch.setattr(Uploader, "upload", gated)
    hot, url = tmp_path / "hot", f"s3://{bucket}/run1"
    mgr = tg.CheckpointManager(hot, keep=2, tiers=[tg.Tier(url)], chunk_size_bytes=CHUNK)
    for step in range(1, 6):
        mgr.save(step, make_state()).wait()
    steps = sorted(int(d.name.split("-")[1]) for d in hot.glob("step-*"))
    assert steps == [1, 2, 3, 4, 5], "uploads pending: retention keeps them"
    gate.set()
    mgr.close()
    assert [i.step for i in tg.CheckpointManager(hot, read_only=True).checkpoints()] == [4, 5]
    assert sorted(int(d.name.split("-")[1]) for d in hot.glob("step-*")) == [4, 5]
    assert [r.step for r in RemoteRoot(open_objects(url)).scan()] == [1, 2, 3, 4, 5]
