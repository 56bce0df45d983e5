"""``benchmarks/run_issue15.py``: its plumbing in ``--tiny`` mode (real runs of every benchmark it drives, tiny
sizes, N = 1): each part's targets come out as PASS/MISS lines and as rows of one markdown table, the JSON
holds every part's figures, and the scratch files are removed. Speed verdicts at these sizes mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO, run_env

SCRIPT = REPO / "benchmarks" / "run_issue15.py"


def run(tmp_path, parts: str) -> tuple[list[str], dict]:
    out = tmp_path / "res.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--only", parts, "--dir", str(scratch), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        env=run_env(),
        cwd=REPO,
    )
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert list(scratch.iterdir()) == [], "scratch files were left behind"
    lines = p.stdout.splitlines()
    assert lines[0].startswith("`") and "run_issue15.py --tiny" in lines[0] and "N = 1" in lines[0]
    assert "| part | target | trainguard | reference | ratio | verdict |" in lines
    return lines, json.loads(out.read_text())


def verdicts(lines: list[str]) -> dict[str, str]:
    out = {}
    for ln in lines:
        if ln.startswith(("PASS ", "MISS ")):
            head, _, _ = ln.rpartition(": ")
            out[head.split(" ", 1)[1]] = ln[:4]
    return out


def table_rows(lines: list[str]) -> list[list[str]]:
    return [
        [c.strip() for c in ln.strip("|").split("|")]
        for ln in lines
        if ln.startswith("| ") and "---" not in ln
    ][1:]


@pytest.mark.timeout(420)
def test_save_load_syncfs_and_retention_parts_print_every_target(tmp_path):
    lines, res = run(tmp_path, "save_load,syncfs,retention")
    v = verdicts(lines)
    assert set(v) == {
        "save_load: sync durable save >= 0.9x raw write",
        "save_load: sync save faster than torch.save",
        "save_load: sync save faster than safetensors",
        "save_load: sync save faster than dcp.save",
        "save_load: async 2nd save (to durable) >= 0.9x raw write",
        "save_load: unchanged-state save (async_save=False) <= 2x hashing alone",
        "save_load: load, one read (verify_before_load=False) >= 0.9x raw read",
        "save_load: load, verified (default: two reads) >= 0.9x raw read cold + warm",
        "syncfs: auto (default) within 1.1x of per_file, contended (0.02 GiB written beside)",
        "syncfs: auto (default) within 1.1x of batched, alone",
        "retention: sync save with keep=1 (deletes the previous checkpoint's chunks) <= 1.1x keep=None",
    }, v
    rows = table_rows(lines)
    assert len(rows) == len(v) + 3  # + the async unchanged save, the polled save, the verified load (info)
    assert sum(r[-1] == "info" for r in rows) == 3
    assert f"{sum(x == 'PASS' for x in v.values())} of {len(v)} targets PASS" in lines
    assert set(res["parts"]) == {"save_load", "syncfs", "retention"} and len(res["rows"]) == len(rows)
    # the unchanged save wrote nothing and its hashing floor was measured in the same repetition
    run0 = res["parts"]["save_load"]["runs"]["save"][0]
    assert run0["  xxh3-128 of the state (hashing alone)"] > 0
    assert run0["trainguard save (async_save=False), unchanged"] > 0
    assert all(res["parts"]["syncfs"]["runs"][m]["writer"] for m in ("auto", "batched", "per_file")), (
        "the noise writer did not run"
    )
    kept = res["parts"]["retention"]
    assert len(kept["save_s"]["keep=1"]) == len(kept["save_s"]["keep=None"]) == 1 and kept["tensors"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_async_distributed_and_ttr_parts_print_every_target(tmp_path):
    lines, res = run(tmp_path, "async,distributed,ttr")
    v = verdicts(lines)
    assert set(v) == {
        "async: async overhead at one save per 10 steps < 1%",
        "async: async overhead <= dcp.async_save with a reused stager",
        "distributed: 1 rank(s): save no slower than DCP",
        "distributed: 1 rank(s): load no slower than DCP",
        "distributed: 2 rank(s): save no slower than DCP",
        "distributed: 2 rank(s): load no slower than DCP",
        "ttr: TTR 5 MB, warm cache <= 1.2x the floor",
    }, v
    assert len(table_rows(lines)) == len(v) + 1  # + the async persist CPU (info)
    assert res["parts"]["ttr"]["runs"][0]["restored_step"] == 10
