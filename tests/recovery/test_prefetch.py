"""The supervisor's prefetch: the newest usable checkpoint's chunk files are in the page cache when a
(re)launched job restores; corrupt or suspect checkpoints, symlinks and the memory cap are respected."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from pathlib import Path

import pytest
import torch

import trainguard as tg
import trainguard.recovery.prefetch as prefetch_module
from trainguard.catalog import read_manifest, record_corrupt
from trainguard.eventlog import iter_events
from trainguard.format import MANIFEST_NAME, step_dir_name
from trainguard.recovery.config import Backoff, SupervisorConfig
from trainguard.recovery.prefetch import Prefetch, newest_chunks
from trainguard.recovery.supervisor import Supervisor
from trainguard.validation.suspect import mark_suspect

_libc = ctypes.CDLL(None, use_errno=True)


def resident_share(path: Path) -> float:
    """Share of ``path``'s pages in the page cache (mincore(2) on a private mapping: nothing is written)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        try:
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
            return sum(v & 1 for v in vec) / pages
        finally:
            del addr


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def save_steps(root: Path, steps: list[int], numel: int = 1 << 20) -> None:
    g = torch.Generator().manual_seed(0)
    with tg.CheckpointManager(root, async_save=False, keep=10) as mgr:
        for s in steps:
            mgr.save(s, {"w": torch.randn(numel, generator=g), "v": torch.randn(numel, generator=g)})


def chunk_paths(root: Path, step: int) -> list[Path]:
    return [root / c.path for c in read_manifest(root, step).chunks.values()]


@pytest.mark.parametrize("advise", [True, False], ids=["fadvise", "read"])
def test_the_newest_checkpoint_is_read_into_the_page_cache(tmp_path, advise):
    root = tmp_path / "root"
    save_steps(root, [10, 20])
    files = chunk_paths(root, 20)
    for f in files:
        evict(f)
    if max(resident_share(f) for f in files) > 0.5:
        pytest.skip("this filesystem keeps the pages after POSIX_FADV_DONTNEED")
    result = Prefetch(root, advise=advise).start().join(60)
    assert result is not None
    assert (result.status, result.step, result.files) == ("done", 20, len(files))
    assert result.bytes == result.total_bytes == sum(f.stat().st_size for f in files)
    deadline = time.monotonic() + 30  # fadvise returns once the reads are submitted, not completed
    while min(resident_share(f) for f in files) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert min(resident_share(f) for f in files) == 1.0


def test_a_corrupt_or_suspect_newest_checkpoint_is_passed_over(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10, 20, 30])
    assert newest_chunks(root)[0] == 30  # type: ignore[index]
    assert mark_suspect(root, 30, "loss spiked")
    assert newest_chunks(root)[0] == 20  # type: ignore[index]
    assert record_corrupt(root, 20, "bit flip in a chunk")
    found = newest_chunks(root)
    assert found is not None and found[0] == 10
    assert {p for p, _ in found[1]} == {c.path for c in read_manifest(root, 10).chunks.values()}


def test_an_unparsable_manifest_is_passed_over_and_an_empty_root_is_skipped(tmp_path):
    root = tmp_path / "root"
    assert Prefetch(root).start().join(30).status == "skipped"  # type: ignore[union-attr]
    save_steps(root, [10, 20])
    (root / step_dir_name(20) / MANIFEST_NAME).write_text("{not json")
    assert newest_chunks(root)[0] == 10  # type: ignore[index]


def test_a_checkpoint_with_a_symlinked_chunk_is_refused_and_the_link_never_followed(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10, 20])
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x" * 4096)
    victim = sorted(set(chunk_paths(root, 20)) - set(chunk_paths(root, 10)))[0]
    victim.unlink()
    victim.symlink_to(outside)
    evict(outside)
    result = Prefetch(root).start().join(30)
    assert result is not None and (result.status, result.step) == ("done", 10)
    assert result.files == len(chunk_paths(root, 10))


def test_at_most_half_the_available_memory_is_read(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10])
    sizes = sorted((f.stat().st_size for f in chunk_paths(root, 10)), reverse=True)
    result = Prefetch(root, memory_bytes=2 * sizes[0] + 1).start().join(30)
    assert result is not None and result.status == "partial"
    assert result.bytes <= sizes[0] and result.files == 1
    assert "50% of the available memory" in (result.reason or "")


def test_a_stopped_prefetch_says_so(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10])
    p = Prefetch(root, threads=1)
    p._stop.set()  # noqa: SLF001 - stopped before the first read
    result = p.start().join(30)
    assert result is not None and (result.status, result.files) == ("stopped", 0)


@pytest.mark.parametrize(
    ("command", "setting", "wanted"),
    [
        (["python", "train.py"], None, True),
        (["torchrun", "--nproc-per-node", "2", "train.py"], None, True),
        (["torchrun", "--nnodes=1", "train.py"], None, True),
        (["torchrun", "--nnodes", "1:1", "--standalone", "train.py"], None, True),
        (["torchrun", "--nnodes", "2", "train.py"], None, False),
        (["torchrun", "--nnodes=1:2", "train.py"], None, False),
        (["torchrun", "--nnode=2", "train.py"], None, False),  # argparse takes the abbreviation
        (["srun", "python", "train.py"], None, False),
        (["/usr/bin/env", "torchrun", "--nnodes=2", "train.py"], None, False),
        (["uv", "run", "torchrun", "--nnodes=4", "t.py"], None, False),
        (["bash", "-c", "torchrun --nnodes=2 --nproc-per-node 8 t.py"], None, False),
        (["python", "-m", "torch.distributed.run", "--nnodes=4", "t.py"], None, False),
        (["torchrun", "--nnodes", "2", "train.py"], True, True),
        (["python", "train.py"], False, False),
    ],
)
def test_prefetch_is_on_by_default_except_for_a_multi_node_command(tmp_path, command, setting, wanted):
    sup = Supervisor(command, SupervisorConfig(root=tmp_path / "root", prefetch=setting))
    assert sup._prefetch_wanted() is wanted  # noqa: SLF001


def test_a_manifest_over_the_limit_is_not_parsed(tmp_path, monkeypatch):
    root = tmp_path / "root"
    save_steps(root, [10])
    size = (root / step_dir_name(10) / MANIFEST_NAME).stat().st_size
    monkeypatch.setattr(prefetch_module, "MAX_MANIFEST_BYTES", size - 1)
    monkeypatch.setattr(prefetch_module, "_CACHE", {})
    parsed = []
    monkeypatch.setattr("trainguard.catalog.read_manifest", lambda *a, **k: parsed.append(a))
    result = Prefetch(root).start().join(30)
    assert result is not None and result.status == "skipped" and parsed == []
    assert f"has {size} bytes" in (result.reason or "")


def test_a_chunk_file_longer_than_recorded_is_read_only_to_its_recorded_length(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10])
    victim = chunk_paths(root, 10)[0]
    recorded = victim.stat().st_size
    os.truncate(victim, 64 << 20)  # sparse: 60 MiB more than the manifest records
    for advise in (True, False):
        result = Prefetch(root, advise=advise).start().join(30)
        assert result is not None and result.status == "done"
        assert result.bytes == result.total_bytes
        assert recorded < result.total_bytes < 64 << 20
    if resident_share(victim) > 0.5:
        pytest.fail(f"{resident_share(victim):.0%} of the enlarged file was read into the page cache")


def test_the_manifest_of_the_same_checkpoint_is_parsed_once_per_supervisor(tmp_path, monkeypatch):
    import trainguard.catalog as catalog

    root = tmp_path / "root"
    save_steps(root, [10])
    monkeypatch.setattr(prefetch_module, "_CACHE", {})
    calls = []
    real = catalog.read_manifest
    monkeypatch.setattr(catalog, "read_manifest", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    for _ in range(3):
        assert Prefetch(root).start().join(30).status == "done"  # type: ignore[union-attr]
    assert calls == [10]
    save_steps(root, [20])  # a new checkpoint: parsed once more
    calls.clear()
    assert Prefetch(root).start().join(30).step == 20  # type: ignore[union-attr]
    assert calls == [20]


WAIT_FOR_PREFETCH = """
import json, sys, time
from pathlib import Path
events = Path(sys.argv[1]) / "events"
deadline = time.time() + 60
while time.time() < deadline:
    if any('"event":"prefetch"' in p.read_text().replace(" ", "") for p in events.glob("*.jsonl")):
        sys.exit(0)
    time.sleep(0.05)
sys.exit(1)
"""


@pytest.mark.parametrize("prefetch", [None, False])
def test_the_supervisor_prefetches_while_the_job_starts_and_logs_it(tmp_path, prefetch):
    root = tmp_path / "root"
    save_steps(root, [10, 20])
    script = tmp_path / "job.py"
    if prefetch is None:
        script.write_text(WAIT_FOR_PREFETCH)  # exits 0 once the supervisor logged its prefetch
    else:
        script.write_text("import time; time.sleep(0.5)\n")
    config = SupervisorConfig(
        root=root, max_restarts=0, backoff=Backoff(initial_s=0.0, max_s=0.0), prefetch=prefetch
    )
    result = Supervisor([sys.executable, str(script), str(root)], config, echo=lambda _m: None).run()
    assert result.exit_code == 0
    events = [r for r in iter_events(root) if r.get("event") == "prefetch"]
    if prefetch is False:
        assert events == []
        return
    [ev] = events
    assert (ev["status"], ev["step"], ev["attempt"], ev["restart_count"]) == ("done", 20, 0, 0)
    assert ev["bytes"] == ev["total_bytes"] == sum(f.stat().st_size for f in chunk_paths(root, 20))


def test_a_chunk_replaced_by_a_named_pipe_never_blocks_the_prefetch(tmp_path):
    root = tmp_path / "root"
    save_steps(root, [10])
    victim = chunk_paths(root, 10)[0]
    victim.unlink()
    os.mkfifo(victim)  # an open for reading would wait for a writer forever
    result = Prefetch(root).start().join(30)
    assert result is not None, "the prefetch hung on a named pipe"
    assert (result.status, result.files) == ("partial", len(chunk_paths(root, 10)) - 1)
    assert "1 chunk file(s) missing, refused" in (result.reason or "")
