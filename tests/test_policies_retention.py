"""Save policies decide when; retention policies decide what stays, never the newest valid checkpoint."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.policies import SavePolicy
from trainguard.retention import KeepAll, RetentionPolicy


def test_every_policy_satisfies_its_protocol():
    for p in (tg.EveryNSteps(3), tg.EveryTSeconds(1.0), tg.AnyOf(tg.EveryNSteps(2))):
        assert isinstance(p, SavePolicy)
    for r in (tg.KeepLatest(2), tg.KeepEvery(10), tg.AnyOfRetention(tg.KeepLatest(1)), KeepAll()):
        assert isinstance(r, RetentionPolicy)


def test_every_n_steps_saves_on_multiples_only():
    p = tg.EveryNSteps(5)
    assert [s for s in range(0, 21) if p.should_save(s, now_s=0.0)] == [5, 10, 15, 20]


def test_every_t_seconds_counts_from_the_last_save():
    p = tg.EveryTSeconds(10.0)
    assert not p.should_save(1, now_s=100.0)
    assert not p.should_save(2, now_s=109.0)
    assert p.should_save(3, now_s=110.0)
    p.record_save(3, now_s=110.0, block_s=0.1, persist_s=None)
    assert not p.should_save(4, now_s=115.0)
    assert p.should_save(5, now_s=121.0)


def test_any_of_saves_when_one_policy_says_so():
    p = tg.AnyOf(tg.EveryNSteps(7), tg.EveryNSteps(5))
    assert [s for s in range(1, 16) if p.should_save(s, now_s=0)] == [5, 7, 10, 14, 15]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: tg.EveryNSteps(0),
        lambda: tg.EveryNSteps(2.5),  # would save at 5, 10, 15
        lambda: tg.EveryNSteps(True),
        lambda: tg.EveryTSeconds(-1),
        lambda: tg.KeepLatest(0),
        lambda: tg.KeepEvery(0),
    ],
)
def test_bad_policy_arguments_are_config_errors(bad):
    with pytest.raises(tg.TrainguardError):
        bad()


def saved_steps(mgr) -> list[int]:
    return [i.step for i in mgr.checkpoints() if i.status == "valid"]


def test_keep_latest_keeps_the_newest_by_step_number_not_by_name(tmp_path):
    with tg.CheckpointManager(tmp_path, keep=2) as mgr:
        for s in (9, 10, 100, 99):  # as text "99" > "100"; by number 100 is newest
            mgr.save(s, {"w": {"t": torch.full((4,), float(s))}})
        assert saved_steps(mgr) == [99, 100]


def test_retention_frees_chunks_no_checkpoint_references_and_keeps_shared_ones(tmp_path):
    frozen = torch.randn(1 << 19)
    with tg.CheckpointManager(tmp_path, keep=1) as mgr:
        for s in range(1, 4):
            mgr.save(s, {"m": {"frozen": frozen, "live": torch.full((1 << 19,), float(s))}})
        mgr.wait()  # retention runs in the background persist, after each commit
        chunk_files = [p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]
        assert len(chunk_files) == 2, "one shared frozen chunk plus the newest live chunk"
        out: dict = {"m": {}}
        mgr.restore(3, out)
        assert torch.equal(out["m"]["frozen"], frozen)


def test_keep_every_and_any_of_combine(tmp_path):
    with tg.CheckpointManager(tmp_path, keep=tg.AnyOfRetention(tg.KeepLatest(1), tg.KeepEvery(20))) as mgr:
        for s in range(5, 65, 5):
            mgr.save(s, {"w": {"t": torch.full((3,), float(s))}})
        assert saved_steps(mgr) == [20, 40, 60]


def test_retention_never_deletes_the_newest_valid_checkpoint(tmp_path):
    class KeepNothing:
        def keep(self, steps):
            return set()

    with tg.CheckpointManager(tmp_path, keep=KeepNothing()) as mgr:
        mgr.save(1, {"w": {"t": torch.ones(2)}})
        mgr.save(2, {"w": {"t": torch.zeros(2)}})
        assert saved_steps(mgr) == [2]


def test_maybe_save_follows_the_policy_and_records_first_step(tmp_path):
    from trainguard.recovery.events import read_events

    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(3)) as mgr:
        results = [mgr.maybe_save(s, {"w": {"t": torch.tensor([float(s)])}}) for s in range(1, 8)]
        assert [r.step for r in results if r is not None] == [3, 6]
    assert [e["step"] for e in read_events(tmp_path, event="first_step")] == [1]
    assert [e["step"] for e in read_events(tmp_path, event="save")] == [3, 6]


def test_saving_an_existing_step_raises_unless_overwrite(tmp_path):
    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"w": {"t": torch.ones(2)}})
        with pytest.raises(tg.CheckpointExistsError, match="overwrite=True"):
            mgr.save(5, {"w": {"t": torch.zeros(2)}})
        mgr.save(5, {"w": {"t": torch.zeros(2)}}, overwrite=True)
        out: dict = {"w": {}}
        mgr.restore(5, out)
        assert torch.equal(out["w"]["t"], torch.zeros(2))


def test_metrics_and_metadata_land_in_the_manifest(tmp_path):
    from trainguard.catalog import read_manifest

    with tg.CheckpointManager(tmp_path) as mgr:
        mgr.save(
            1,
            {"w": {"t": torch.ones(1)}},
            metrics={"loss": torch.tensor(0.5), "nan": float("nan")},
            metadata={"git": "abc"},
        )
    m = read_manifest(tmp_path, 1)
    assert m.metrics == {"loss": 0.5, "nan": "nan"} and m.metadata == {"git": "abc"}
