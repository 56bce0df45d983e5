"""Compression and deltas (issue 12): bit-exact chains of every dtype, bounded chains, GC that keeps delta
bases, a corrupt base detected and passed over, sizes that agree everywhere, the auto decision logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli.main import main as cli_main
from trainguard.recovery.events import iter_events

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]


def evolve(step: int) -> dict:
    """A state of every dtype where a few rows change per step (large tensors get chunks of their own)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(600, 512, generator=g)
    rows = torch.randint(0, 600, (step * 3,), generator=torch.Generator().manual_seed(step))
    base[rows] += 0.5 * step
    out = {}
    for dt in DTYPES:
        if dt == torch.bool:
            t = base > 0
        elif dt == torch.complex64:
            t = torch.complex(base, -base)
        elif dt.is_floating_point:
            t = base.to(dt)
        else:
            t = (base * 50).to(torch.int64).to(dt)
        out[str(dt).split(".")[-1]] = t
    out["small"] = torch.arange(7) * step  # packed with values
    return {"model": out, "meta": {"step": step}}


def check(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        g = got["model"][k]
        assert g.dtype == v.dtype and torch.equal(g.view(torch.uint8), v.view(torch.uint8)), k


def manifest(root, step) -> dict:
    return json.loads((root / f"step-{step:09d}" / "manifest.json").read_text())


@pytest.mark.parametrize("async_save", [False, True])
def test_every_checkpoint_of_a_ten_save_delta_chain_restores_bit_exact_in_every_dtype(tmp_path, async_save):
    root = tmp_path / "run"
    with tg.CheckpointManager(
        root,
        async_save=async_save,
        compression="zstd",
        delta=True,
        max_chain=4,
        fsync=False,
        chunk_size_bytes=1 << 20,
    ) as mgr:
        for step in range(1, 11):
            mgr.save(step, evolve(step))
        mgr.wait()
        for step in range(1, 11):
            got: dict = {"model": {}, "meta": {}}
            mgr.restore(step, got)
            check(got, evolve(step))
    deltas = {s: sum("base" in c for c in manifest(root, s)["chunks"].values()) for s in range(1, 11)}
    # a save without new deltas every max_chain=4 saves (1, 5, 9), deltas in the others
    assert [s for s, n in deltas.items() if n == 0] == [1, 5, 9]
    for s in range(1, 11):
        m = manifest(root, s)
        assert m["format_version"] == 3
        for h, c in m["chunks"].items():  # every chain lies inside the manifest and stays under max_chain
            depth, cur = 0, c
            while "base" in cur:
                cur = m["chunks"][cur["base"]]
                depth += 1
            assert depth < 4, (s, h)


def test_deltas_make_a_few_changed_rows_cost_a_few_percent(tmp_path):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(20000, 64, generator=g)
    sizes = []
    with tg.CheckpointManager(tmp_path, async_save=False, compression="zstd", delta=True, fsync=False) as mgr:
        for step in range(1, 4):
            table[torch.randint(0, 20000, (200,), generator=g)] += 0.01  # 1% of the rows
            r = mgr.save(step, {"emb": table}).result
            sizes.append((r.new_bytes, r.logical_bytes))
    new, logical = sizes[-1]
    assert logical == table.numel() * 4
    assert new < 0.03 * logical  # a delta: ~1% of the rows changed


def test_sizes_agree_across_save_result_checkpoints_events_and_ls_json(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False, compression="zstd", delta=True, fsync=False) as mgr:
        results = [mgr.save(s, evolve(s)).result for s in (1, 2)]
        infos = {i.step: i for i in mgr.checkpoints()}
    out = CliRunner().invoke(cli_main, ["ls", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    rows = {r["step"]: r for r in json.loads(out.output)}
    events = {e["step"]: e for e in iter_events(tmp_path, event="save")}
    for r in results:
        i, row, ev = infos[r.step], rows[r.step], events[r.step]
        assert (r.logical_bytes, r.bytes, r.new_bytes) == (i.logical_bytes, i.bytes, i.new_bytes)
        assert (row["logical_bytes"], row["bytes"], row["new_bytes"]) == (
            i.logical_bytes,
            i.bytes,
            i.new_bytes,
        )
        assert (ev["logical_bytes"], ev["bytes"], ev["new_bytes"]) == (i.logical_bytes, i.bytes, i.new_bytes)
    first, second = results
    assert first.new_bytes == first.bytes  # nothing to share with
    assert second.new_bytes < second.bytes  # it references the first save's chunks as delta bases
    assert second.logical_bytes == first.logical_bytes > second.bytes  # compressed


def test_retention_keeps_every_delta_base_a_kept_checkpoint_needs(tmp_path):
    with tg.CheckpointManager(
        tmp_path, async_save=False, compression="zstd", delta=True, max_chain=10, keep=2, fsync=False
    ) as mgr:
        for step in range(1, 8):
            mgr.save(step, evolve(step))
        assert [i.step for i in mgr.checkpoints()] == [6, 7]
        for step in (6, 7):  # their bases were written by deleted checkpoints 1..5
            got: dict = {"model": {}, "meta": {}}
            mgr.restore(step, got)
            check(got, evolve(step))
    assert any("base" in c for c in manifest(tmp_path, 7)["chunks"].values())
    from trainguard.integrity.verify import verify

    assert verify(tmp_path).ok


_GC_KILLER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import trainguard as tg
    from trainguard.incremental.chunkstore import ChunkStore
    from test_incremental import evolve

    root = sys.argv[1]
    with tg.CheckpointManager(root, async_save=False, compression="zstd", delta=True, fsync=False) as mgr:
        for step in range(1, 8):
            mgr.save(step, evolve(step))

    def dying_collect(self, candidates, referenced, **kw):
        # delete two unreferenced chunks, then SIGKILL in the middle of the collection
        for h in sorted(set(candidates) - set(referenced))[:2]:
            os.unlink(os.path.join(root, "chunks", h[:2], h))
        os.kill(os.getpid(), signal.SIGKILL)

    ChunkStore.collect = dying_collect
    with tg.CheckpointManager(root, async_save=False, compression="zstd", delta=True, keep=2, fsync=False) as mgr:
        mgr.save(8, evolve(8))
    """
)


def test_sigkill_during_gc_loses_no_kept_checkpoint_and_no_delta_base(tmp_path):
    script = tmp_path / "killer.py"
    script.write_text(_GC_KILLER.format(tests=os.path.dirname(__file__)))
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    mgr = tg.CheckpointManager(root, read_only=True)
    steps = [i.step for i in mgr.checkpoints() if i.usable]
    # retention at open deleted the manifests of steps 1-5 first, then died collecting their chunks
    assert steps[-2:] == [6, 7] and 8 not in steps
    for step in steps:
        got: dict = {"model": {}, "meta": {}}
        mgr.restore(step, got)
        check(got, evolve(step))
    from trainguard.integrity.verify import verify

    assert verify(root).ok


def test_a_corrupt_delta_base_is_detected_and_restore_falls_back_to_an_older_valid_checkpoint(tmp_path):
    with tg.CheckpointManager(
        tmp_path, async_save=False, compression="zstd", delta=True, max_chain=3, fsync=False
    ) as mgr:
        for step in range(1, 5):  # 1 full, 2-3 deltas, 4 full (max_chain=3)
            mgr.save(step, evolve(step))
    m3 = manifest(tmp_path, 3)
    base_of_3 = {c["base"] for c in m3["chunks"].values() if "base" in c}
    m4_chunks = set(manifest(tmp_path, 4)["chunks"])
    victim = sorted(base_of_3 - m4_chunks)[0]  # a base that step 4 does not use
    p = tmp_path / m3["chunks"][victim]["path"]
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(p, 0o644)
    p.write_bytes(bytes(data))
    # step 4 (newest) is fine; remove it so that restore_latest must judge the chain of step 3
    import shutil

    shutil.rmtree(tmp_path / "step-000000004")
    mgr = tg.CheckpointManager(tmp_path)
    got: dict = {"model": {}, "meta": {}}
    step = mgr.restore_latest(got)
    mgr.close()
    assert step is not None and step < 3  # step 3 was skipped: its base fails CRC32C
    check(got, evolve(step))
    skipped = [e for e in iter_events(tmp_path, event="restore_skipped")]
    assert any(e["step"] == 3 and victim in str(e.get("chunk")) for e in skipped)


def test_a_frame_that_declares_more_bytes_than_the_manifest_is_refused_before_decoding(tmp_path):
    from trainguard.incremental.codecs import CodecError, compress, decompress_into

    frame = compress(bytes(1 << 20), 4)
    with pytest.raises(CodecError, match="declares 1048576 decoded bytes"):
        decompress_into(frame, memoryview(bytearray(1000)))
    with pytest.raises(CodecError, match="not a blosc2 frame|declares 0 decoded bytes"):
        decompress_into(b"\x00" * 40, memoryview(bytearray(1000)))


def test_a_manifest_with_a_delta_cycle_or_a_missing_base_is_refused():
    from trainguard.errors import CorruptCheckpointError
    from trainguard.format import manifest_from_json, manifest_to_json
    from trainguard.format.manifest import ChunkRecord, Manifest, Segment, ShardRecord, TensorEntry

    a, b = "a" * 32, "b" * 32

    def mk(chunks):
        e = TensorEntry("w", (("s", "w"),), "uint8", (8,), (ShardRecord((0,), (8,), (Segment(a, 0, 8),)),))
        return manifest_to_json(Manifest(1, 0.0, "", 1, {"w": e}, chunks))

    cyc = {
        a: ChunkRecord(a, f"chunks/aa/{a}", 5, 0, "blosc2", 8, b, "xor", 1),
        b: ChunkRecord(b, f"chunks/bb/{b}", 5, 0, "blosc2", 8, a, "xor", 1),
    }
    with pytest.raises(CorruptCheckpointError, match="delta chain longer"):
        manifest_from_json(mk(cyc))
    missing = {a: ChunkRecord(a, f"chunks/aa/{a}", 5, 0, "blosc2", 8, b, "xor", 1)}
    with pytest.raises(CorruptCheckpointError, match="not in the chunk table"):
        manifest_from_json(mk(missing))
    grown = {
        a: ChunkRecord(a, f"chunks/aa/{a}", 5, 0, "blosc2", 8, b, "xor", 1),
        b: ChunkRecord(b, f"chunks/bb/{b}", 5, 0, "blosc2", 1 << 30),
    }
    with pytest.raises(CorruptCheckpointError, match="delta base of"):
        manifest_from_json(mk(grown))


def test_auto_logs_its_decision_and_inputs_and_writes_the_first_save_uncompressed(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False, fsync=False) as mgr:  # compression="auto"
        for s in (1, 2):
            mgr.save(s, evolve(s))
    evs = list(iter_events(tmp_path, event="save"))
    first, second = evs[0]["compression"], evs[1]["compression"]
    assert first["compress"] is False and "not measured yet" in first["reason"]
    assert first["codec_Bps"] > 0 and 0 < first["ratio"] < 1.2  # measured on a sample of the state
    assert second["write_bw_Bps"] is not None and second["write_bw_Bps"] > 0
    assert second["reason"].startswith("auto:") and second["t_off_s"] > 0
    assert manifest(tmp_path, 1)["format_version"] == 1  # raw chunks only: older readers still read it


def test_blosc2_encodes_and_decodes_without_holding_the_gil_once_trainguard_loads_it(tmp_path):
    """blosc2 holds the GIL while it encodes unless told otherwise (its default): an async save compressing in
    the background then stopped the training thread for each chunk's whole encode, and the writing and reading
    threads encoded one at a time (benchmarks/RESULTS.md, "blosc2 held the GIL"). ``load_library`` turns the
    release on, once, and compressed saves still round-trip from several threads."""
    code = textwrap.dedent(
        """
        import json, sys, torch, trainguard as tg
        from trainguard.incremental import codecs
        b2 = codecs.load_library()
        released = b2.set_releasegil(True)  # returns the state before this call: the one load_library left
        g = torch.Generator().manual_seed(0)
        state = {"w": {f"t{i}": torch.randn(300_000, generator=g) for i in range(6)}}
        with tg.CheckpointManager(sys.argv[1], compression="zstd", async_save=False,
                                  chunk_size_bytes=1 << 20) as mgr:
            res = mgr.save(1, state).wait()
        out = {"w": {}}
        tg.CheckpointManager(sys.argv[1], read_only=True).restore(1, out)
        same = all(torch.equal(out["w"][k], v) for k, v in state["w"].items())
        print(json.dumps({"released": released, "same": same, "stored": res.bytes_written}))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"released": True, "same": True, "stored": got["stored"]} and got["stored"] > 0


def test_auto_models_the_encoding_threads_of_the_save_it_decides():
    """The model's ``n`` is the writer threads of this save: codec 1 GB/s per thread, storage 1 GB/s, ratio
    0.3, 128 MiB in 1 MiB pieces: with 2 threads compressing is modelled faster (t_on ~0.5 t_off), with one
    (an async save's background writer on 2 CPUs) not (t_on ~ t_off)."""
    from trainguard.incremental.auto import CompressionChooser

    c = CompressionChooser("auto", threads=2)
    if c.threads < 2:
        pytest.skip("needs 2 CPUs")
    c.bw_Bps, c.codec_Bps, c.ratio = 1e9, 1e9, 0.3
    L = 128 << 20
    two = c.decide(L, piece_bytes=1 << 20)
    one = c.decide(L, piece_bytes=1 << 20, threads=1)
    assert two.compress is True and two.inputs["threads"] == 2
    assert one.compress is False and one.inputs["threads"] == 1 and "storage is faster" in one.reason
    assert one.inputs["t_on_s"] > 1.9 * two.inputs["t_on_s"] - 1e-9  # twice the encoding time, one thread
    assert c.decide(L, piece_bytes=1 << 20, threads=64).inputs["threads"] == 2  # never above the manager's


def test_an_async_save_decides_compression_with_its_background_writer_threads(tmp_path, monkeypatch):
    """An async save's persist runs ``WriterOptions.background()`` threads (1 on 2 CPUs): the auto decision
    models those, so a storage/codec pair where only 2+ encoding threads pay is not compressed in the
    background (each compressed trial would take CPU from training for a save no faster). Before, the model
    used the synchronous save's threads and an async save on 2 CPUs compressed its 2nd save and every 17th."""
    import dataclasses

    from trainguard.distributed.options import WriterOptions

    monkeypatch.setattr(WriterOptions, "background", lambda self: dataclasses.replace(self, threads=1))
    state = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(80)}  # 80 MiB in 1 MiB tensors
    reasons = {}
    for async_save in (False, True):
        root = tmp_path / str(async_save)
        with tg.CheckpointManager(root, async_save=async_save, fsync=False) as mgr:
            chooser = mgr.ctx.compression
            if chooser.threads < 2:
                pytest.skip("needs 2 CPUs")
            chooser.bw_Bps, chooser.codec_Bps, chooser.ratio = 1e9, 1e9, 0.3  # as measured on an earlier save
            mgr.save(1, state).wait()
        ev = next(iter_events(root, event="save"))["compression"]
        reasons[async_save] = (ev["compress"], ev["threads"])
    assert reasons == {False: (True, chooser.threads), True: (False, 1)}, reasons


def test_off_writes_raw_chunks_and_delta_without_compression_is_a_config_error(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False, compression="off", fsync=False) as mgr:
        mgr.save(1, evolve(1))
    assert {c["codec"] for c in manifest(tmp_path, 1)["chunks"].values()} == {"raw"}
    with pytest.raises(tg.ConfigError, match="delta=True needs compressed saves"):
        tg.CheckpointManager(tmp_path / "x", compression="off", delta=True)
    with pytest.raises(tg.ConfigError, match="compression must be one of"):
        tg.CheckpointManager(tmp_path / "y", compression="lz4")
    with pytest.raises(tg.ConfigError, match="max_chain"):
        tg.CheckpointManager(tmp_path / "z", max_chain=0)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=4096),
    flips=st.lists(st.tuples(st.integers(0, 4095), st.integers(1, 255)), max_size=20),
    itemsize=st.sampled_from([1, 2, 4, 8, 16]),
    op=st.sampled_from(["xor", "sub"]),
)
def test_encode_decode_of_random_bytes_and_random_deltas_round_trips_bitwise(data, flips, itemsize, op):
    import numpy as np

    from trainguard.incremental.codecs import (
        compress,
        decompress_into,
        delta_decode_inplace,
        delta_encode,
    )
    from trainguard.incremental.delta import delta_word

    out = bytearray(len(data))
    decompress_into(compress(data, itemsize), memoryview(out))
    assert bytes(out) == data
    cur = bytearray(data)
    for pos, x in flips:
        if cur:
            cur[pos % len(cur)] ^= x
    word = delta_word(itemsize)
    d = delta_encode(memoryview(cur), memoryview(data), op, word)
    got = bytearray(len(cur))
    decompress_into(compress(memoryview(d).cast("B"), word), memoryview(got))
    delta_decode_inplace(memoryview(got), data, op, word)
    assert bytes(got) == bytes(cur)
    assert np.frombuffer(got, np.uint8).nbytes == len(cur)
