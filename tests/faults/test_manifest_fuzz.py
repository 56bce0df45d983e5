"""A hypothesis fuzzer over the manifest fields that size what verify and restore allocate: dtypes, shapes,
shard lists, chunk ranges (repeated ranges too, with the recorded split sizes forged), value encodings and path
depth. Each re-signed manifest must either restore
bit-exactly (every tensor equals the bytes its shards name) or be refused with a trainguard error, while the
process runs under ``RLIMIT_AS`` = its size + the bytes the manifest declares + a fixed margin
(``bounds_worker.py``, one long-lived subprocess so that torch is imported once)."""

from __future__ import annotations

import copy
import io
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from faultlib import commit_save, make_state, read_manifest_json, write_manifest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_128_hexdigest

import trainguard as tg

MARGIN_BYTES = 768 << 20
"""Address space the worker may use beyond its size before the example and the manifest's declared bytes."""
WORKER = Path(__file__).with_name("bounds_worker.py")
DTYPES = ["float32", "bfloat16", "int64", "uint8", "bool", "bits8", "float8_e4m3fn", "complex64", "nosuch"]
SIZES = [0, 1, 2, 3, 100, 4096, 1 << 20, (1 << 31) + 1, 1 << 40, 1 << 48]


class Worker:
    """The long-lived ``bounds_worker.py``; restarted when an example killed it (the test fails then)."""

    def __init__(self) -> None:
        import tempfile

        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
        )

    def run(self, root: Path) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"root": str(root), "margin": MARGIN_BYTES}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            rc = self.proc.wait()
            self.err.seek(0)
            tail = self.err.read()[-3000:]
            self.err.seek(0)
            self.err.truncate()
            self.proc = self._start()
            return {"outcome": "died", "detail": f"exit {rc}: {tail}"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fuzz") / "root"
    with tg.CheckpointManager(root) as mgr:
        for s in (1, 2):
            commit_save(mgr, s, make_state(s))
    body = read_manifest_json(root, 2)
    # a compressed torch payload (a zip bomb in miniature: 4 MiB of zeros in a few KB) as an extra chunk
    buf = io.BytesIO()
    torch.save({"betas": (0.9, 0.999), "pad": torch.zeros(4 << 20, dtype=torch.uint8)}, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    bomb = out.getvalue()
    h = xxh3_128_hexdigest(bomb)
    (root / "chunks" / h[:2]).mkdir(exist_ok=True)
    (root / "chunks" / h[:2] / h).write_bytes(bomb)
    import crc32c

    extra = {
        "bomb": (
            h,
            {
                "path": f"chunks/{h[:2]}/{h}",
                "length": len(bomb),
                "crc32c": crc32c.crc32c(bomb),
                "codec": "raw",
            },
        )
    }
    yield root, {"body": body, "extra": extra}


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


def tensors(body: dict[str, Any]) -> list[str]:
    return sorted(k for k, e in body["entries"].items() if e["kind"] == "tensor")


@st.composite
def mutations(draw: st.DrawFn, body: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(body)
    names = tensors(body)
    for _ in range(draw(st.integers(1, 3), label="edits")):
        fqn = draw(st.sampled_from(names), label="tensor")
        e = body["entries"][fqn]
        op = draw(
            st.sampled_from(
                [
                    "dtype",
                    "shape",
                    "duplicate-shard",
                    "drop-shard",
                    "split-shard",
                    "range",
                    "repeat",
                    "split-sizes",
                    "value-codec",
                    "bomb",
                    "depth",
                    "new-entry",
                ]
            ),
            label="op",
        )
        if not e["shards"]:
            continue
        sh = e["shards"][0]
        if op == "dtype":
            e["dtype"] = draw(st.sampled_from(DTYPES))
        elif op == "shape" and e["shape"]:
            d = draw(st.integers(0, len(e["shape"]) - 1))
            n = draw(st.sampled_from(SIZES))
            where = draw(st.sampled_from(["shape", "sizes", "both"]))
            if where in ("shape", "both"):
                e["shape"][d] = n
            if where in ("sizes", "both"):
                sh["sizes"][d] = n
        elif op == "duplicate-shard":
            e["shards"].append(copy.deepcopy(sh))
        elif op == "drop-shard":
            e["shards"] = e["shards"][1:]
        elif op == "split-shard" and e["shape"] and e["shape"][0] >= 2 and len(sh["segments"]) == 1:
            # an honest resharding along dim 0: two shards that tile the tensor (must restore bit-exactly)
            c, off, ln = sh["segments"][0]
            rows, row_bytes = e["shape"][0], ln // e["shape"][0]
            cut = draw(st.integers(1, rows - 1))
            first = {
                "offsets": [0] + sh["offsets"][1:],
                "sizes": [cut] + sh["sizes"][1:],
                "segments": [[c, off, cut * row_bytes]],
            }
            second = {
                "offsets": [cut] + sh["offsets"][1:],
                "sizes": [rows - cut] + sh["sizes"][1:],
                "segments": [[c, off + cut * row_bytes, (rows - cut) * row_bytes]],
            }
            e["shards"] = [first, second]
        elif op == "range" and sh["segments"]:
            seg = sh["segments"][draw(st.integers(0, len(sh["segments"]) - 1))]
            seg[draw(st.sampled_from([1, 2]))] = draw(st.sampled_from(SIZES + [seg[2] - 1, seg[2] + 1]))
        elif op == "repeat" and sh["segments"] and len(e["shape"]) == 1:
            k = draw(st.sampled_from([2, 3, 50]))  # 2000 repeats: test_manifest_bounds (2.56 GB)
            sh["segments"] = sh["segments"] * k
            sh["sizes"][0] *= k
            e["shape"][0] *= k
        elif op == "split-sizes":
            # what the manifest says large tensors were cut with: forged to a chunk's own length (so that a
            # repeat of it passes the manifest check and the memory bound must hold), dropped, or malformed
            lengths = [c["length"] for c in body["chunks"].values()]
            body["chunk_sizes"] = draw(
                st.sampled_from(
                    [[], [draw(st.sampled_from(lengths))], lengths, [0], [-1], "64", [1 << 41], None]
                )
            )
            if body["chunk_sizes"] is None:
                del body["chunk_sizes"]
        elif op == "value-codec":
            v = body["entries"][draw(st.sampled_from(["optim", "trainer"]))]
            v["codec"] = draw(st.sampled_from(["json", "torch", "pickle"]))
        elif op == "bomb":
            h, rec = extra["bomb"]
            body["chunks"][h] = rec
            body["entries"]["optim"]["segments"] = [[h, 0, rec["length"]]]
            body["entries"]["optim"]["codec"] = "torch"
        elif op == "depth":
            e["path"] = e["path"] + [["s", "x"]] * draw(st.sampled_from([1, 50, 199, 200, 5000]))
        elif op == "new-entry":
            name = f"model.new{len(body['entries'])}"
            new = copy.deepcopy(e)
            new["path"] = [["s", "model"], ["s", name.split(".")[1]]]
            new["dtype"] = draw(st.sampled_from(DTYPES))
            body["entries"][name] = new
    return body


@pytest.mark.timeout(900)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_manifests_restore_bit_exactly_or_are_refused_within_the_declared_memory(
    fuzz_root, worker, data
):
    root, parts = fuzz_root
    body = data.draw(mutations(parts["body"], parts["extra"]), label="manifest")
    write_manifest(root, 2, body)
    result = worker.run(root)
    assert result["outcome"] in ("ok", "refused"), result


def test_the_worker_restores_an_honest_manifest_and_refuses_a_huge_one(fuzz_root, worker):
    root, parts = fuzz_root
    write_manifest(root, 2, parts["body"])
    assert worker.run(root)["outcome"] == "ok"
    body = copy.deepcopy(parts["body"])
    e = body["entries"]["model.big"]
    e["dtype"], e["shape"], e["shards"][0]["sizes"] = "bits8", [1 << 40], [1 << 40]
    write_manifest(root, 2, body)
    result = worker.run(root)
    assert result["outcome"] == "refused" and "bits8" in result["detail"], result
