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


def test_a_single_process_save_imports_no_dcp_sync_or_async_and_restores_bit_exact(tmp_path):
    """One process with plain tensors saves through trainguard's own chunk writer
    (``trainguard.distributed.chunkwrite.save_local``): neither the first synchronous nor the first async save
    imports DCP (0.3-0.6 s once per process, in an async save's persist thread holding the GIL). A tensor
    subclass still goes through DCP's planner (below)."""
    root = tmp_path / "run"
    out = run_fresh(
        f"""
        import json, sys, torch
        import trainguard as tg
        torch.manual_seed(0)
        state = {{"model": {{"w": torch.randn(300, 700), "b": torch.randn(7).half(), "mask": torch.rand(99) > 0.5,
                  "big": torch.randn(1 << 19)}}, "cfg": {{"lr": 0.1}}, "rng": tg.RNGState(), "step": 3}}
        want = {{k: v.clone() for k, v in state["model"].items()}}
        with tg.CheckpointManager({str(root)!r}, async_save=False, compression="off") as mgr:
            mgr.save(1, state)
        after_sync = {heavy_loaded()}
        with tg.CheckpointManager({str(root)!r}, async_save=True, compression="off") as mgr:
            mgr.save(2, state).wait()
        after_async = {heavy_loaded()}
        live = {{"model": {{k: torch.zeros_like(v) for k, v in want.items()}}, "cfg": {{}},
                 "rng": tg.RNGState(), "step": 0}}
        with tg.CheckpointManager({str(root)!r}, read_only=True) as mgr:
            step = mgr.restore_latest(live)
        same = all(torch.equal(live["model"][k].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())
        print(json.dumps({{"sync": after_sync, "async": after_async, "step": step, "same": same,
                          "cfg": live["cfg"], "n": live["step"]}}))
        """
    )
    assert out == {"sync": [], "async": [], "step": 2, "same": True, "cfg": {"lr": 0.1}, "n": 3}


def test_the_save_without_dcp_writes_the_manifest_dcps_planner_wrote(tmp_path, monkeypatch):
    """Same items, same packing order, same chunks: the manifest of the DCP-free save equals, field for field
    (but its time and run identity), the one the save through DCP's planner writes, so both deduplicate
    against each other's chunks."""
    import trainguard._persist as persist

    torch.manual_seed(0)
    state = {
        "model": {
            "w": torch.randn(300, 700),
            "half": torch.randn(5).half(),
            "view": torch.randn(6, 4).t(),  # non-contiguous
            "zeros": torch.zeros(500_000),  # identical pieces
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "mask": torch.rand(99) > 0.5,
            "big": torch.randn(3 << 20),  # three pieces at chunk_size_bytes=4 MiB
        },
        "cfg": {"lr": 0.1, "betas": (0.9, 0.99), "long": list(range(10_000))},  # one inline, one chunked
        "obj": {"x": (1, 2)},
        "rng": tg.RNGState(),
        "step": 5,
    }

    def manifest(root, through_dcp: bool) -> dict:
        with monkeypatch.context() as m:
            if through_dcp:
                m.setattr(persist, "plain_state", lambda flat: False)
            with tg.CheckpointManager(root, async_save=False, chunk_size_bytes=4 << 20) as mgr:
                mgr.save(1, state)
        body = json.loads((root / "step-000000001" / "manifest.json").read_text())
        for k in ("t", "time", "crc32c", "run"):
            body.pop(k)
        return body

    ours, dcps = manifest(tmp_path / "a", False), manifest(tmp_path / "b", True)
    assert len(ours["chunks"]) >= 5 and len(ours["entries"]["model.big"]["shards"][0]["segments"]) == 3
    assert ours == dcps


SUBCLASS = """
import json, sys, torch
import trainguard as tg

class Tagged(torch.Tensor):  # a tensor subclass (torchao-style): saved through DCP's planner, as before
    pass

w = torch.arange(12.0).reshape(3, 4).as_subclass(Tagged)
with tg.CheckpointManager(sys.argv[1], async_save=False) as mgr:
    mgr.save(1, {"w": w, "v": torch.ones(2)})
dcp = "torch.distributed.checkpoint" in sys.modules
live = {"w": torch.zeros(3, 4), "v": torch.zeros(2)}
with tg.CheckpointManager(sys.argv[1], read_only=True) as mgr:
    mgr.restore(1, live)
print(json.dumps({"dcp": dcp, "same": torch.equal(live["w"], torch.arange(12.0).reshape(3, 4))
                  and torch.equal(live["v"], torch.ones(2))}))
"""


def test_a_tensor_subclass_is_saved_through_dcps_planner_and_restores(tmp_path):
    out = run_fresh(SUBCLASS.replace("sys.argv[1]", repr(str(tmp_path / "run"))))
    assert out == {"dcp": True, "same": True}
