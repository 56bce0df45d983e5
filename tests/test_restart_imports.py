"""A restart of a single-process job imports neither ``torch.distributed.checkpoint`` (DCP) nor DTensor: both
pull sympy and torch.fx, 0.7 s and more on every relaunch (trainguard._lazy). Nor blosc2 (with httpx, rich,
click, threadpoolctl: 0.2-0.3 s) unless a chunk it reads is compressed (trainguard.incremental.codecs). The
local load path restores bit-exactly what DCP's path restores, including a checkpoint saved by two ranks (two
shards per tensor)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

import trainguard as tg

from .conftest import run_env

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "blosc2")
# Not heavy, but a relaunch has no use for them before its first save; prometheus-client's import set off a
# full garbage collection (0.15-0.2 s) in the manager's constructor after `import torch`.
LATER = ("prometheus_client", "trainguard.tiers")


def run_fresh(code: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def heavy_loaded() -> str:
    top = "m.split('.')[0] if m.startswith(('sympy', 'blosc2')) else m"
    return f"sorted({{{top} for m in sys.modules if m.startswith({HEAVY!r})}})"


def test_import_trainguard_and_a_manager_import_no_dcp_dtensor_or_sympy(tmp_path):
    out = run_fresh(
        f"""
        import json, sys
        import trainguard as tg
        from trainguard.manager import CheckpointManager
        CheckpointManager({str(tmp_path / "run")!r}).close()
        print(json.dumps({heavy_loaded()}))
        """
    )
    assert out == []


def test_a_restart_leaves_metrics_and_tiers_to_the_first_save_and_the_registry_still_works(tmp_path):
    root = tmp_path / "run"
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    later = f"sorted({{m.split('.')[0] if m.startswith('prom') else m for m in sys.modules if m.startswith({LATER!r})}})"
    out = run_fresh(
        f"""
        import json, sys, torch
        import trainguard as tg
        state = {{"w": torch.zeros(3)}}
        mgr = tg.CheckpointManager({str(root)!r}, async_save=False)
        step = mgr.restore_latest(state)
        before = {later}
        mgr.save(2, state)
        after = {later}
        from prometheus_client import generate_latest
        text = generate_latest(mgr.metrics_registry).decode()
        mgr.close()
        print(json.dumps({{"step": step, "before": before, "after": after,
                          "saves": [l for l in text.splitlines() if l.startswith("trainguard_save_block_seconds_count")]}}))
        """
    )
    assert out["step"] == 1
    assert out["before"] == []
    assert out["after"] == ["prometheus_client"]
    assert out["saves"] == ["trainguard_save_block_seconds_count 1.0"]  # the first save is counted


def test_restore_latest_in_one_process_imports_no_dcp_and_is_bit_exact(tmp_path):
    root = tmp_path / "run"
    torch.manual_seed(0)
    state = {
        "w": torch.randn(300, 7),
        "half": torch.randn(5).half(),
        "view": torch.randn(6, 4).t(),  # saved from a non-contiguous view
        "zeros": torch.zeros(5000),  # cut into identical pieces (chunk_size_bytes=4096 below)
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "cfg": {"lr": 0.1, "name": "x", "betas": (0.9, 0.99)},
        "rng": tg.RNGState(),
    }
    with tg.CheckpointManager(root, async_save=False, chunk_size_bytes=4096) as mgr:
        mgr.save(3, state)
    want = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    torch.save(want, tmp_path / "want.pt")
    out = run_fresh(
        f"""
        import json, sys, torch
        import trainguard as tg
        want = torch.load({str(tmp_path / "want.pt")!r})
        state = {{k: torch.full_like(v, 7) for k, v in want.items()}}
        state["cfg"] = {{}}
        state["rng"] = tg.RNGState()
        with tg.CheckpointManager({str(root)!r}, read_only=True) as mgr:
            step = mgr.restore_latest(state)
            nbytes = mgr.last_restore.bytes
        same = {{k: torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in want.items()}}
        print(json.dumps({{"step": step, "same": same, "cfg": state["cfg"], "bytes": nbytes,
                          "heavy": {heavy_loaded()}}}))
        """
    )
    assert out["step"] == 3
    assert out["same"] == {k: True for k in want}, out["same"]
    assert out["cfg"] == {"lr": 0.1, "name": "x", "betas": [0.9, 0.99]}  # JSON: the tuple prints as a list
    assert out["bytes"] > 0
    assert out["heavy"] == [], "a single-process restore imported DCP or DTensor"


def test_the_local_load_reads_every_shard_of_a_two_rank_checkpoint(tmp_path):
    """A tensor saved as two shards (as two ranks write it) is loaded into its two regions by the local path,
    bit-exactly as DCP's path does (the manifest is written by hand: the shards of one saved tensor split)."""
    import dataclasses

    from trainguard.format import Segment, ShardRecord, manifest_from_json, manifest_to_json

    root = tmp_path / "run"
    w = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    with tg.CheckpointManager(root, async_save=False) as mgr:
        mgr.save(1, {"w": w})
    path = root / "step-000000001" / "manifest.json"
    m = manifest_from_json(path.read_bytes())
    e = m.entries["w"]
    [seg] = e.shards[0].segments
    halves = (
        ShardRecord((0, 0), (3, 4), (Segment(seg.chunk, seg.offset, 48),)),
        ShardRecord((3, 0), (7, 4), (Segment(seg.chunk, seg.offset + 48, 112),)),
    )
    m.entries["w"] = dataclasses.replace(e, shards=halves)
    path.write_bytes(manifest_to_json(m))
    state = {"w": torch.zeros(10, 4)}
    with tg.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.restore_latest(state) == 1
        assert mgr.last_restore.skipped == []
    assert torch.equal(state["w"], w)


def test_a_compressed_checkpoint_imports_blosc2_on_first_use_and_restores_bit_exact(tmp_path):
    """The lazy blosc2 import of the codecs: a fresh process restoring compressed chunks decodes them (blosc2
    imported by the first frame), bit-exactly, still without DCP."""
    root = tmp_path / "run"
    w = torch.arange(50_000, dtype=torch.float32).reshape(500, 100)  # compresses: the chunk is a blosc2 frame
    with tg.CheckpointManager(root, async_save=False, compression="zstd") as mgr:
        mgr.save(1, {"w": w})
    chunks = json.loads((root / "step-000000001" / "manifest.json").read_text())["chunks"]
    assert {c["codec"] for c in chunks.values()} == {"blosc2"}
    torch.save(w, tmp_path / "want.pt")
    out = run_fresh(
        f"""
        import json, sys, torch
        import trainguard as tg
        before = {heavy_loaded()}
        state = {{"w": torch.zeros(500, 100)}}
        with tg.CheckpointManager({str(root)!r}, read_only=True) as mgr:
            step = mgr.restore_latest(state)
        same = torch.equal(state["w"], torch.load({str(tmp_path / "want.pt")!r}))
        print(json.dumps({{"step": step, "same": same, "before": before, "after": {heavy_loaded()}}}))
        """
    )
    assert out == {"step": 1, "same": True, "before": [], "after": ["blosc2"]}


def test_the_codec_librarys_import_does_not_move_the_jobs_random_stream(tmp_path):
    """blosc2 is imported at the first save with compression on (not with trainguard); rich, which it pulls
    in, draws from Python's global ``random`` at import. The job's stream must not move: a resumed run
    restores that stream and must draw what the uninterrupted run drew (tests/test_resume_bitexact.py)."""
    code = textwrap.dedent(
        f"""
        import random, sys
        import torch
        import trainguard as tg
        assert "blosc2" not in sys.modules
        random.seed(7)
        with tg.CheckpointManager({str(tmp_path)!r}, compression="auto", async_save=True) as mgr:
            mgr.save(1, {{"w": torch.ones(1 << 16)}})
            got = random.random()
        assert "blosc2" in sys.modules
        random.seed(7)
        assert got == random.random(), "the first save moved the job's random stream"
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
