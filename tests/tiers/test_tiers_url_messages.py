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
