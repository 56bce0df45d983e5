"""``benchmarks/bench_gpu.py``: its logic runs on CPU (``--device cpu --tiny``) and every check it prints holds
where it does not depend on speed; without CUDA the default run skips cleanly (exit 0). On a CUDA machine the
``gpu`` test runs the full benchmark and requires its bit-exactness checks to pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import REPO, run_benchmark

SCRIPT = REPO / "benchmarks" / "bench_gpu.py"


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_benchmark(SCRIPT.name, *args, timeout=timeout)


@pytest.mark.timeout(300)
def test_the_cpu_run_prints_every_target_and_restores_bit_exactly(tmp_path):
    out = tmp_path / "res.json"
    p = bench("--device", "cpu", "--tiny", "--every", "5", "--json", str(out), "--scratch", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    verdicts = [ln for ln in p.stdout.splitlines() if ln.startswith(("PASS ", "MISS "))]
    targets = [ln.split(" ", 1)[1].split(":")[0] for ln in verdicts]
    assert targets[:4] == [
        "blocking stall <= 1.3x the copy floor",
        "staging buffers unpinned on CPU and <= 2 sets",
        "trainguard async overhead < 1%",
        "trainguard async overhead <= dcp.async_save's in the same run",
    ], verdicts
    exact = [ln for ln in verdicts if "bit-exact restore" in ln]
    assert len(exact) == 9 and all(ln.startswith("PASS") for ln in exact), exact
    assert exact[-1] == "PASS bit-exact restore, DTensor async save (one-rank mesh)", exact
    assert verdicts[1].startswith("PASS"), verdicts[1]  # on CPU nothing is pinned, at most 2 sets
    assert (
        verdicts[4] == "PASS a synchronous save counts the device tensors' bytes (SaveResult.logical_bytes)"
    )
    assert verdicts[5].startswith("PASS a DTensor's async save keeps no device copy of its shard"), verdicts[
        5
    ]
    assert "dcp.async_save's stager: DefaultStager" in p.stdout
    res = json.loads(out.read_text())
    assert res["errors"] == {} and res["counts_device_bytes"] is True
    assert res["loop"]["dtensor"]["exact"] is True and res["loop"]["dtensor"]["device_growth_bytes"] == 0
    assert res["device"] == "cpu" and res["pinned_bytes"] == 0
    # the 1 MiB loose tensor's staging buffer is aligned, so its chunk is written from it without a copy
    from trainguard.storage.local import direct_io_supported

    takes_direct = direct_io_supported(tmp_path)
    assert res["direct_path"] == {"buffers": 1, "aligned": 1, "scratch_direct_io": takes_direct}
    info = [ln for ln in p.stdout.splitlines() if ln.startswith("info the async save's staging buffers")]
    assert info and info[0].endswith(
        "(no bounce copy)" if takes_direct else "copied through bounce buffers or the page cache"
    ), info
    assert 0 < res["state_bytes"] <= res["staging_bytes"] <= 2 * res["state_bytes"]
    assert len(res["stalls_s"]) == 2 and res["copy_s"] > 0
    assert set(res["loop"]) >= {"tg_async", "dcp_async", "step_s", "segments_s"}
    assert len(res["loop"]["segments_s"]) == 2  # --tiny: 2 rounds after the warm-up
    assert res["sizes"]["every"] == 5 and "one save per 5 steps" in p.stdout
    for m in ("tg_async", "dcp_async"):  # where the time goes: per round, the save's parts and every step
        w = res["loop"]["where"][m]
        assert w["block_s"] > 0 and w["persist_s"] > 0, w
        assert len(w["rounds"]) == 2 and len(w["slowest_steps"]) == 5, w
        parts = w["extra_in_steps_ms"] + w["extra_between_steps_ms"] + w["extra_rest_ms"]
        assert abs(parts - w["extra_s"] * 1e3) < 1e-6, w  # the parts of one round add up to its total
        assert sorted(i for i, _ in w["slowest_steps"]) == [0, 1, 2, 3, 4], w
    assert p.stdout.count("    blocked ") == 4 and "ms inside steps and" in p.stdout, p.stdout
    assert p.stdout.count("ms besides (mostly the wait for the persist") == 4, p.stdout
    assert (
        "raw write thread (floor)    overhead" in p.stdout
        and "raw write process (floor)   overhead" in p.stdout
        and "info trainguard async overhead vs a raw" in p.stdout
        and "info a persist process instead of a thread, raw floors: " in p.stdout
    )
    assert res["loop"]["methods"] == ["none", "tg_async", "dcp_async", "raw_thread", "raw_process"]
    assert res["loop"]["failed"] == {} and res["loop"]["raw_process_pinned"] is False  # nothing pins on CPU
    for m in ("raw_thread", "raw_process"):
        assert isinstance(res["loop"][m], float) and res["loop"]["where"][m]["persist_s"] > 0
    assert list(tmp_path.iterdir()) == [out], "the scratch checkpoints were not removed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the gpu test runs instead")
def test_without_cuda_the_default_run_skips_with_exit_0():
    p = bench(timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("SKIP: no CUDA device"), p.stdout
    assert "PASS" not in p.stdout and "MISS" not in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_require_cuda_makes_a_missing_device_an_error():
    """On the device machine a SKIP would mean the wrong python (one without the CUDA build of torch)."""
    p = bench("--require-cuda", timeout=120)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "sees no CUDA device" in p.stderr and "SKIP" not in p.stdout


@pytest.mark.parametrize("device", ["cudax", "cuda:", "cuda:-1", "gpu", "cuda:\u00b2"])
def test_a_malformed_device_is_an_error_even_without_cuda(device):
    p = bench("--device", device, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--device must be cuda, cuda:N or cpu" in p.stderr and "SKIP" not in p.stdout


@pytest.mark.parametrize("every", ["1", "0", "-3"])
def test_a_segment_shorter_than_two_steps_is_an_error_even_without_cuda(every):
    p = bench("--every", every, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--every must be at least 2 steps" in p.stderr and "SKIP" not in p.stdout


@pytest.mark.parametrize("what", ["missing", "a-file"])
def test_a_scratch_path_that_is_not_a_folder_fails_before_anything_is_measured(tmp_path, what):
    scratch = tmp_path / "x"
    if what == "a-file":
        scratch.write_text("")
    out = tmp_path / "res.json"
    p = bench("--device", "cpu", "--tiny", "--scratch", str(scratch), "--json", str(out), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--scratch" in p.stderr and "not a folder" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists() and "PASS" not in p.stdout


def test_an_unwritable_json_path_fails_before_anything_is_measured(tmp_path):
    p = bench("--device", "cpu", "--tiny", "--json", str(tmp_path / "missing" / "res.json"), timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "cannot write it" in p.stderr and "Traceback" not in p.stderr and "PASS" not in p.stdout


def test_a_failing_phase_is_reported_and_the_later_ones_still_run(tmp_path, monkeypatch):
    """A first GPU run must not lose what it measured to one phase that raises."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)

    def broken(*args, **kw):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(mod, "bit_exact", broken)
    monkeypatch.setattr(mod, "loop_overheads", lambda *a, **k: {"tg_async": 0.0})
    out = tmp_path / "res.json"
    res = mod.run("cpu", mod.TINY, tmp_path / "scratch", str(out))
    assert res["errors"] == {"exact": "RuntimeError: planted failure"}
    assert "stall_s" in res and res["loop"] == {"tg_async": 0.0}  # the phases before and after it ran
    assert json.loads(out.read_text())["errors"] == res["errors"]  # written as the run went
    lines = mod.report(res)
    assert lines[0] == "ERROR in phase exact: RuntimeError: planted failure"
    assert lines[-1].startswith("incomplete run")


def test_a_dcp_stager_that_raises_falls_back_to_async_save_without_one_and_says_so(tmp_path, monkeypatch):
    """Seen on torch 2.11 + CUDA: DCP's DefaultStager raised ``KeyError: <class 'type'>``; the loop then
    measures ``dcp.async_save`` without a stager, and the report names the fallback."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu_stager", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)

    class Broken:
        def stage(self, state_dict):
            raise KeyError(type)

        def synchronize_staging(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(mod.Loop, "_dcp_stager", lambda self: Broken())
    res = mod.loop_overheads(mod.TINY, torch.device("cpu"), tmp_path / "loop")
    assert res["dcp_stager"].startswith("none: DefaultStager raised KeyError: <class 'type'>"), res[
        "dcp_stager"
    ]
    assert isinstance(res["dcp_async"], float) and len(res["segments_s"]) == mod.TINY.rounds


def load_module(name, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(300)
def test_the_diagnosis_methods_run_on_cpu_and_write_what_they_should(tmp_path):
    """``--methods``: trainguard with one writer thread, DCP's persist process, and the raw write process
    (its child wrote the staged bytes: the file it was asked for holds every tensor, in order)."""
    out = tmp_path / "res.json"
    p = bench(
        "--device", "cpu", "--tiny", "--every", "4", "--json", str(out), "--scratch", str(tmp_path),
        "--methods", "raw_thread,raw_process, tg_1thread,dcp_process,raw_thread_1m",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    loop = res["loop"]
    assert loop["methods"] == [
        "none", "tg_async", "raw_thread", "raw_process", "tg_1thread", "dcp_process", "raw_thread_1m",
    ], loop  # fmt: skip
    assert loop["failed"] == {} and res["errors"] == {}
    assert loop["dcp_process_stager"] == "DefaultStager (shared memory)"
    assert "info a raw write thread writing 1 MiB pieces instead of whole tensors" in p.stdout
    for m in ("raw_thread", "raw_process", "tg_1thread", "dcp_process", "raw_thread_1m"):
        assert isinstance(loop[m], float) and loop["where"][m]["persist_s"] > 0, (m, loop["where"][m])
    assert res["sizes"]["methods"] == loop["methods"]
    assert "not measured: trainguard async overhead <= dcp.async_save's" in p.stdout
    assert "trainguard, 1 writer thread overhead" in p.stdout and "dcp.async_save, process     overhead" in (
        p.stdout
    )
    assert list(tmp_path.iterdir()) == [out], "the scratch checkpoints were not removed"


def test_the_raw_write_process_writes_the_staged_bytes(tmp_path, monkeypatch):
    mod = load_module("bench_gpu_rawp", monkeypatch)
    flat = {"a": torch.arange(10, dtype=torch.float32), "b": torch.tensor([[1, 2], [3, 4]], dtype=torch.int8)}
    raw = mod.RawProcess(flat, torch.device("cpu"), tmp_path)
    try:
        for k, t in flat.items():
            raw.views[k].copy_(t)
        raw.write(tmp_path / "x.bin")
        data = (tmp_path / "x.bin").read_bytes()
        assert len(data) == raw.size == 64 + 64  # 64-byte aligned slices
        assert data[:40] == flat["a"].numpy().tobytes() and data[64:68] == bytes([1, 2, 3, 4])
        with pytest.raises(OSError, match="the raw write process answered .error .Errno 2."):
            raw.write(tmp_path / "missing" / "x.bin")  # the child reports, and goes on
        raw.write(tmp_path / "y.bin")
        assert (tmp_path / "y.bin").read_bytes() == data
    finally:
        raw.close()
    assert raw.child.returncode == 0 and not raw.path.exists()


def test_an_optional_method_that_raises_is_reported_and_left_out(tmp_path, monkeypatch):
    mod = load_module("bench_gpu_failing", monkeypatch)
    calls = []

    def broken(self):
        calls.append(self.step)
        raise OSError("planted: no /dev/shm")

    monkeypatch.setattr(mod.Loop, "_raw_process_save", broken)
    sizes = mod.dataclasses.replace(mod.TINY, methods=("none", "tg_async", "raw_thread", "raw_process"))
    res = mod.loop_overheads(sizes, torch.device("cpu"), tmp_path / "loop")
    assert len(calls) == 1, "left out after its first failure"
    assert res["failed"] == {"raw_process": "OSError: planted: no /dev/shm"}
    assert res["methods"] == ["none", "tg_async", "raw_thread"] and "raw_process" not in res
    assert all(set(s) == {"none", "tg_async", "raw_thread"} for s in res["segments_s"])
    assert set(res["where"]) == {"tg_async", "raw_thread"}
    res_all = {"stall_s": 1.0, "copy_s": 1.0, "state_bytes": 1, "staging_bytes": 1, "pinned_bytes": 0}
    res_all |= {"stalls_s": [1.0], "exact": {}, "counts_device_bytes": True, "device": "cpu", "total_s": 1.0}
    res_all |= {"sizes": {"every": 4}, "loop": res, "errors": {}}
    lines = mod.report(res_all)
    assert (
        "ERROR in the loop's raw write process (floor) (left out after it): OSError: planted: no /dev/shm"
        in (lines)
    )


def test_an_unknown_method_is_an_error_even_without_cuda():
    p = bench("--methods", "raw_thread,tg_sync", timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--methods: unknown method(s) tg_sync; choose from" in p.stderr and "SKIP" not in p.stdout


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_full_run_restores_bit_exactly_and_pins_its_staging_buffers(tmp_path):
    out = tmp_path / "res.json"
    p = bench("--json", str(out), timeout=540)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(out.read_text())
    assert res["errors"] == {}, res["errors"]
    assert all(res["exact"].values()), res["exact"]
    assert res["pinned_bytes"] == res["staging_bytes"] > 0
    assert res["counts_device_bytes"] and res["loop"]["dtensor"]["no_device_copy"]
    # pinned staging buffers come page-aligned from the CUDA host allocator: written without a bounce copy
    assert res["direct_path"]["aligned"] == res["direct_path"]["buffers"] > 0, res["direct_path"]


def test_the_raw_write_thread_in_pieces_writes_the_same_bytes(tmp_path, monkeypatch):
    """``raw_thread_1m`` differs from ``raw_thread`` only in the size of its ``write`` calls."""
    mod = load_module("bench_gpu_pieces", monkeypatch)
    loop = mod.Loop(mod.TINY, torch.device("cpu"), tmp_path / "loop")
    try:
        written = []
        for piece in (None, 3):
            loop.step += 1
            loop._raw_save(piece=piece).result()
            written.append((loop.dcp_root / f"raw-{loop.step}.bin").read_bytes())
        expect = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in loop.raw_bufs.values())
        assert written == [expect, expect] and len(expect) > 3
    finally:
        loop.close()
