"""Run identity: every manifest records the run that wrote it and the run it resumed from; a fresh run never
interleaves silently with another run's checkpoints on the same root; retention and restore_latest follow a
run's own lineage.

The sequence of the issue: run A saves every 10 steps to 100 with keep=3 and exits; a fresh run B (another
seed) opens the same root.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import trainguard as tg
from trainguard.catalog import read_manifest
from trainguard.cli.main import main as cli_main
from trainguard.recovery.events import read_events


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, generator=g)}, "seed": seed}


def run_a(root) -> str:
    """Run A: saves 10..100 every 10 steps with keep=3, exits. Returns its run id."""
    with tg.CheckpointManager(root, keep=3, async_save=False) as mgr:
        for step in range(10, 101, 10):
            mgr.save(step, state(1))
        return mgr.run.run_id


def valid_steps(root) -> list[int]:
    return [i.step for i in tg.CheckpointManager(root, read_only=True).checkpoints() if i.status == "valid"]


def test_a_fresh_run_on_an_old_root_refuses_its_first_save_and_deletes_nothing(tmp_path):
    a = run_a(tmp_path)
    assert valid_steps(tmp_path) == [80, 90, 100]
    before = {s: (tmp_path / f"step-{s:09d}" / "manifest.json").read_bytes() for s in (80, 90, 100)}
    mgr = tg.CheckpointManager(tmp_path, keep=3, async_save=False)
    with pytest.raises(tg.RunConflictError) as err:
        mgr.save(10, state(2))
    msg = str(err.value)
    assert a in msg and "80..100" in msg and mgr.run.run_id in msg
    assert "restore_latest" in msg and "new run root" in msg and "new_run=True" in msg
    with pytest.raises(tg.RunConflictError):  # every save refuses, not only the first try
        mgr.save(20, state(2))
    mgr.close()
    assert valid_steps(tmp_path) == [80, 90, 100]
    for s, data in before.items():
        assert (tmp_path / f"step-{s:09d}" / "manifest.json").read_bytes() == data
    # B "crashes and restarts": it still cannot resume from a mixture; A's step 100 is A's, untouched
    st = {"model": {}, "seed": None}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(st) == 100 and st["seed"] == 1


def test_resuming_records_the_lineage_in_every_manifest_and_the_event_log(tmp_path):
    a = run_a(tmp_path)
    st = state(2)
    with tg.CheckpointManager(tmp_path, keep=3, async_save=False) as mgr:
        assert mgr.restore_latest(st) == 100 and st["seed"] == 1
        b = mgr.run.run_id
        assert b != a and mgr.run.resumed_from == (a, 100)
        mgr.save(110, st)
    m100, m110 = read_manifest(tmp_path, 100), read_manifest(tmp_path, 110)
    assert m100.run is not None and m100.run.run_id == a and m100.run.lineage == ()
    assert m110.run is not None and m110.run.run_id == b and m110.run.lineage == ((a, 100),)
    # the resumed run's retention orders A's steps (its ancestors) with its own
    assert valid_steps(tmp_path) == [90, 100, 110]
    resume = [e for e in read_events(tmp_path, event="resume")]
    assert [(e["checkpoint_run_id"], e["resumed_from"]) for e in resume] == [(b, {"run_id": a, "step": 100})]
    assert resume[0]["lineage"] == [[a, 100]]
    saves = {e["step"]: e["checkpoint_run_id"] for e in read_events(tmp_path, event="save")}
    assert saves[100] == a and saves[110] == b
    out = CliRunner().invoke(cli_main, ["info", str(tmp_path), "110", "--json"])
    assert out.exit_code == 0, out.output
    run = json.loads(out.output)["run"]
    assert run == {"id": b, "resumed_from": {"run_id": a, "step": 100}, "lineage": [[a, 100]]}


def test_a_lineage_survives_its_ancestors_checkpoints_being_deleted(tmp_path):
    a = run_a(tmp_path)
    with tg.CheckpointManager(tmp_path, keep=1, async_save=False) as mgr:
        mgr.restore_latest(state(0))
        b = mgr.run.run_id
        mgr.save(110, state(2))
    assert valid_steps(tmp_path) == [110]  # A's are gone ...
    with tg.CheckpointManager(tmp_path, keep=1, async_save=False) as mgr:
        assert mgr.restore_latest(state(0)) == 110
        mgr.save(120, state(3))
        c = mgr.run.run_id
    m = read_manifest(tmp_path, 120)  # ... but the chain is in the newest manifest
    assert m.run is not None and m.run.run_id == c and m.run.lineage == ((b, 110), (a, 100))


def test_new_run_keeps_the_old_runs_checkpoints_apart_from_its_retention_and_its_restarts(tmp_path):
    a = run_a(tmp_path)
    with tg.CheckpointManager(tmp_path, keep=3, async_save=False, new_run=True) as mgr:
        b = mgr.run.run_id
        for step in range(10, 71, 10):
            mgr.save(step, state(2))
        # A's 80/90/100 do not count as newer: B keeps its own newest three, A keeps all of its
        assert valid_steps(tmp_path) == [50, 60, 70, 80, 90, 100]
        with pytest.raises(tg.CheckpointExistsError) as err:  # one checkpoint per step and root
            mgr.save(80, state(2))
        assert a in str(err.value) and "new run root" in str(err.value)
    assert read_manifest(tmp_path, 80).run.run_id == a  # type: ignore[union-attr]
    # B crashes and restarts (same script: new_run=True, then restore_latest): it resumes B's 70, not A's 100
    st = {"model": {}, "seed": None}
    with tg.CheckpointManager(tmp_path, keep=3, async_save=False, new_run=True) as mgr:
        assert mgr.restore_latest(st) == 70 and st["seed"] == 2
        assert mgr.run.resumed_from == (b, 70)
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"model": {}, "seed": None}) == 70


def test_a_run_resumed_from_an_older_step_does_not_order_the_abandoned_branch_against_itself(tmp_path):
    a = run_a(tmp_path)  # 80, 90, 100 of run A
    st = state(0)
    with tg.CheckpointManager(tmp_path, keep=2, async_save=False) as mgr:
        assert mgr.restore(80, st) == 80
        assert mgr.run.resumed_from == (a, 80)
        mgr.save(85, st)
        mgr.save(87, st)
    # keep=2 over the lineage (A <= 80, then B): 85 and 87 stay, A's 80 goes; A's 90/100 (a branch B
    # abandoned) are not B's to order or delete
    assert valid_steps(tmp_path) == [85, 87, 90, 100]


def test_checkpoints_written_before_run_ids_resume_as_before(tmp_path):
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(5, state(1))
    p = tmp_path / "step-000000005" / "manifest.json"
    m = read_manifest(tmp_path, 5)
    m.run = None  # a manifest of an older trainguard: no "run" key
    from trainguard.format import manifest_to_json

    p.write_bytes(manifest_to_json(m))
    assert "run" not in json.loads(p.read_bytes())
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.restore_latest(state(0)) == 5
        mgr.save(6, state(1))
    assert read_manifest(tmp_path, 6).run.lineage == (("", 5),)  # type: ignore[union-attr]


def test_a_malformed_run_record_is_a_corrupt_manifest(tmp_path):
    import crc32c

    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state(1))
    p = tmp_path / "step-000000001" / "manifest.json"
    body = json.loads(p.read_bytes())
    body.pop("crc32c")
    body["run"] = {"id": "../../etc", "lineage": [["x", -1]]}
    body["crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    p.write_text(json.dumps(body))
    with pytest.raises(tg.CorruptCheckpointError, match="run id"):
        read_manifest(tmp_path, 1)


def test_a_manager_that_saves_on_after_the_newest_checkpoint_continues_that_run(tmp_path):
    a = run_a(tmp_path)  # 80, 90, 100
    with tg.CheckpointManager(tmp_path, keep=3, async_save=False) as mgr:
        mgr.save(110, state(1))  # no restore, but nothing of run A is at or after 110: no interleaving
        assert mgr.run.resumed_from == (a, 100)
    assert valid_steps(tmp_path) == [90, 100, 110]
    assert read_manifest(tmp_path, 110).run.lineage == ((a, 100),)  # type: ignore[union-attr]
    assert [e.get("implicit") for e in read_events(tmp_path, event="resume")] == [True]
