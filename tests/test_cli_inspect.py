"""``trainguard ls / info / verify``: JSON interfaces and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import trainguard as tg

from .conftest import run_env


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainguard", *args],
        capture_output=True,
        text=True,
        env=run_env(),
        timeout=120,
    )


def make_run(root, steps=(1, 2, 10)):
    # raw chunks: the tests corrupt stored bytes at known offsets (compression="auto" may compress a save)
    with tg.CheckpointManager(root, compression="off") as mgr:
        for s in steps:
            mgr.save(s, {"model": {"w": torch.full((1 << 18,), float(s)), "b": torch.ones(3)}})


def test_ls_json_lists_steps_in_numeric_order_with_status_bytes_and_iso_time(tmp_path):
    make_run(tmp_path)
    r = cli("ls", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [x["step"] for x in rows] == [1, 2, 10]
    for x in rows:
        # stored bytes may be compressed (compression="auto"); the tensors hold 1 MiB in memory
        assert x["status"] == "valid" and x["logical_bytes"] > (1 << 20) and 0 < x["bytes"]
        assert 0 <= x["new_bytes"] <= x["bytes"]
        assert x["time"].startswith("20") and "T" in x["time"]


def test_verify_all_json_reports_ok_and_exit_0(tmp_path):
    make_run(tmp_path)
    r = cli("verify", str(tmp_path), "--all", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"] is True and out["checked"] == [1, 2, 10] and out["corrupt"] == []


def test_verify_names_the_corrupt_chunk_and_its_tensors_and_exits_1(tmp_path):
    make_run(tmp_path)
    from trainguard.catalog import read_manifest

    m = read_manifest(tmp_path, 10)
    big = max(m.chunks.values(), key=lambda c: c.length)
    p = tmp_path / big.path
    data = bytearray(p.read_bytes())
    data[1000] ^= 0x10
    p.write_bytes(bytes(data))
    r = cli("verify", str(tmp_path), "--all", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["ok"] is False
    assert out["corrupt"] == [
        {"step": 10, "chunk": big.path, "tensors": ["model.w"], "problem": out["corrupt"][0]["problem"]}
    ]
    text = cli("verify", str(tmp_path), "--step", "10")
    assert text.returncode == 1 and "CORRUPT" in text.stdout and "model.w" in text.stdout


def test_info_json_describes_entries(tmp_path):
    make_run(tmp_path)
    r = cli("info", str(tmp_path), "2", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["step"] == 2
    entries = {e["fqn"]: e for e in out["entries"]}
    assert entries["model.w"]["shape"] == [1 << 18] and entries["model.w"]["dtype"] == "float32"


def test_usage_errors_exit_2(tmp_path):
    assert cli("ls", str(tmp_path / "missing")).returncode == 2
    make_run(tmp_path, steps=(1,))
    assert cli("verify", str(tmp_path), "--step", "7").returncode == 2
    assert cli("verify", str(tmp_path), "--step", "1", "--all").returncode == 2
    assert cli("nonsense").returncode == 2


def test_root_names_keys_and_metrics_that_look_like_rich_markup_are_printed_verbatim(tmp_path, monkeypatch):
    from pathlib import Path

    from click.testing import CliRunner

    from trainguard.cli.main import main

    monkeypatch.chdir(tmp_path)  # a short relative root: the table title shows it whole
    root = Path("run[") / "a]"  # the path text is "run[/a]": a closing markup tag
    with tg.CheckpointManager(root) as mgr:
        mgr.save(
            1,
            {"w[/i]": torch.ones(2), "x[bold]y": torch.zeros(1)},
            metrics={"acc[/top1]": 0.5, "[red]loss": 1.0},
        ).wait()
    ls = CliRunner().invoke(main, ["ls", str(root)])
    assert ls.exit_code == 0 and ls.exception is None, ls.output
    assert "run[/a]" in ls.output
    info = CliRunner().invoke(main, ["info", str(root)])
    assert info.exit_code == 0 and info.exception is None, info.output
    for text in ("w[/i]", "x[bold]y", "acc[/top1]=0.5", "[red]loss=1.0"):
        assert text in info.output, (text, info.output)


def test_a_negative_step_is_a_usage_error_without_a_traceback(tmp_path):
    make_run(tmp_path, steps=(1,))
    for args in (("verify", str(tmp_path), "--step", "-1"), ("info", str(tmp_path), "--", "-1")):
        p = cli(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert "-1 is not in the range x>=0" in p.stderr, p.stderr


def test_control_characters_from_a_checkpoint_never_reach_the_terminal(tmp_path, monkeypatch):
    """Entry keys, values, metric names and the root's own name are untrusted: ESC, BEL, DEL and C1 bytes are
    shown as ``\\xNN`` in every human-readable output (``--json`` escapes them already)."""
    from pathlib import Path

    from click.testing import CliRunner

    from trainguard.cli.main import main

    monkeypatch.chdir(tmp_path)
    root = Path("r\x1b]0;TITLE\x07")
    key, metric = "k\x1b[2J\x1b]0;PWNED\x07", "m\x1b[5m"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {key: torch.ones(2), "v": {"x\x7f\x9b31m": 1}}, metrics={metric: 0.5}).wait()
    raw = ("\x1b", "\x07", "\x7f", "\x9b")
    runner = CliRunner()
    commands = (["ls", str(root)], ["info", str(root)], ["info", str(root), "1"], ["verify", str(root)])
    for args in (*commands, ["status", str(root)]):
        r = runner.invoke(main, args)
        assert r.exit_code == 0 and r.exception is None, (args, r.output)
        assert not any(c in r.output for c in raw), (args, r.output)
        if args[0] in ("ls", "status"):  # the table's title names the root
            assert "r\\x1b]0;TITLE\\x07" in r.output, r.output
    info = runner.invoke(main, ["info", str(root)]).output
    for shown in ("k\\x1b[2J\\x1b]0;PWNED\\x07", "m\\x1b[5m=0.5", '"x\\u007f\\u009b31m": 1'):
        assert shown in info, (shown, info)
    # a usage error naming the root is terminal-safe too
    r = runner.invoke(main, ["info", str(root), "7"])
    assert r.exit_code == 2 and not any(c in r.output for c in raw), r.output
    assert (
        "Usage:" not in r.output and "no checkpoint of step 7" in r.output and "its steps are 1" in r.output
    )


def test_a_negative_looking_step_argument_is_a_clear_usage_error(tmp_path):
    """``info ROOT -1`` used to get click's "No such option: -1"; ``mark`` takes a STEP argument too."""
    from click.testing import CliRunner

    from trainguard.cli.main import main

    make_run(tmp_path, steps=(1,))
    runner = CliRunner()
    for args in (["info", str(tmp_path), "-1"], ["mark", str(tmp_path), "-1", "--clear"]):
        r = runner.invoke(main, args)
        assert r.exit_code == 2, r.output
        assert "STEP -1 is negative: steps are integers >= 0" in r.output and "No such option" not in r.output
    # a negative-looking option value is the option's, not a STEP
    r = runner.invoke(main, ["mark", str(tmp_path), "1", "--suspect", "-5"])
    assert r.exit_code == 0 and "marked suspect (-5)" in r.output, r.output
