"""CLI messages and listings a new user met: tier-only steps in ``ls``, hints naming paths, URL roots in
``ls``/``status``/``report``, ``info`` of a missing step, ``verify``'s summary, ``plan``'s layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.cli.main import main as cli


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_ls_of_a_hot_root_lists_tier_only_steps_like_checkpoints_and_a_tier_hint_names_its_path(
    tmp_path: Path,
) -> None:
    hot, tier = tmp_path / "hot", tmp_path / "tier"
    with tg.CheckpointManager(hot, keep=1, tiers=[tg.Tier(str(tier))]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((1000,), float(step))}).wait()
    with tg.CheckpointManager(hot, read_only=True, tiers=[tg.Tier(str(tier))]) as mgr:
        api = {i.step: (i.status, i.problem) for i in mgr.checkpoints()}
    assert sorted(api) == [1, 2, 3] and "only on tiers" in str(api[1][1])
    r = invoke("ls", str(hot), "--json")
    assert r.exit_code == 0, r.output
    rows = {x["step"]: x for x in json.loads(r.stdout)}
    assert {s: (x["status"], x["problem"]) for s, x in rows.items()} == api
    assert rows[1]["tiers"] == {str(tier): "valid"}
    table = invoke("ls", str(hot))
    assert "only on tiers" in table.output
    r = invoke("ls", str(tier), "--json")
    problems = [x["problem"] for x in json.loads(r.stdout) if x["problem"]]
    assert problems, r.stdout  # the tier's steps were never fully re-read here: the hint says how
    assert all(f"trainguard verify {tier} --step" in p and "Storage(" not in p for p in problems)


def test_verify_summary_says_how_many_failed() -> None:
    from trainguard.cli.inspect import verify_summary

    assert verify_summary(False, 7, 3, 2048).startswith("FAILED: 3 of 7 checkpoint(s) checked failed,")
    assert verify_summary(True, 7, 0, 2048).startswith("OK 7 checkpoint(s) checked,")


def test_plan_prints_no_trailing_spaces() -> None:
    r = invoke("plan", "--checkpoint-time", "5min", "--restart-time", "10min", "--mtbf", "24h")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) > 5 and "goodput" in r.output
    assert [line for line in lines if line != line.rstrip()] == []


def test_run_help_lists_every_environment_variable_the_job_gets() -> None:
    text = " ".join(invoke("run", "--help").output.split())
    for name in ("RESTART_COUNT", "RUN_ID", "HEARTBEAT_FILE", "ROOT", "ATTEMPT_ID"):
        assert f"TRAINGUARD_{name}" in text, name


def test_the_documented_fault_injection_examples_inject_as_written(tmp_path: Path, monkeypatch) -> None:
    """README's ENOSPC example and docs/tiers.md's tier PUT example, run as written (a local directory in
    place of the S3 store): each fault fires (`unfired()` is empty), as the comments say."""
    import errno

    from trainguard.storage import Fault, FaultyStorage, LocalStorage

    monkeypatch.chdir(tmp_path)
    state = {"w": torch.randn(1 << 20)}  # 4 MiB: four 1 MiB chunks
    disk = FaultyStorage(
        LocalStorage("ckpts/run1"), Fault("write", match="chunks/*", nth=2, errno=errno.ENOSPC)
    )
    with tg.CheckpointManager(disk, async_save=False, chunk_size_bytes=1 << 20) as mgr:
        try:
            mgr.save(1, state)
            raise AssertionError("the save did not fail")
        except tg.StorageFullError:
            pass
        assert mgr.checkpoints() == []
    assert [(op, what) for op, _, what in disk.injected] == [("write", "errno 28")]
    assert disk.unfired() == []
    never = FaultyStorage(
        LocalStorage("ckpts/run2"), Fault("write", match="chunks/*", nth=9, errno=errno.ENOSPC)
    )
    with tg.CheckpointManager(never, async_save=False, chunk_size_bytes=1 << 20) as mgr:
        mgr.save(1, state)  # 4 chunks: the 9th chunk write never comes
    assert never.injected == [] and len(never.unfired()) == 1

    s3 = FaultyStorage(LocalStorage("shared/run1"), Fault("write", match="chunks/*", nth=2, errno=errno.EIO))
    with tg.CheckpointManager("nvme/run1", chunk_size_bytes=1 << 20, tiers=[tg.Tier(s3)]) as mgr:
        mgr.save(1, state).wait()
    assert [(op, what) for op, _, what in s3.injected] == [("write", "errno 5")] and s3.unfired() == []
    with tg.CheckpointManager("nvme/run1", read_only=True, tiers=[tg.Tier(s3)]) as mgr:
        assert {i.step: i.tiers for i in mgr.checkpoints()} == {1: {s3.url: "valid"}}  # retried, completed
