"""The training loop a user writes: the final save at a normal end, a step-based loop over a ResumableLoader,
retention that keeps the best checkpoints by a metric, and errors that say what to store instead."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import trainguard as tg
from trainguard.retention import AnyOfRetention, KeepBest, KeepLatest, RetentionPolicy


def valid_steps(mgr: tg.CheckpointManager) -> list[int]:
    return [i.step for i in mgr.checkpoints() if i.status == "valid"]


def run_loop(root, total_steps: int, *, every: int = 10, async_save: bool = True) -> list[list[int]]:
    """The README loop: restore, endless batches, maybe_save with force on the last step. Returns batches."""
    state = {
        "w": torch.zeros(3),
        "loader": tg.ResumableLoader(TensorDataset(torch.arange(10)), batch_size=4, seed=1),
    }
    seen = []
    with tg.CheckpointManager(root, save_policy=tg.EveryNSteps(every), async_save=async_save) as mgr:
        start = mgr.restore_latest(state)
        batches = state["loader"].forever()
        for step in range((start or 0) + 1, total_steps + 1):
            (x,) = next(batches)
            seen.append(x.tolist())
            state["w"] += 1
            mgr.maybe_save(step, state, metrics={"loss": 1.0 / step}, force=step == total_steps)
    return seen


@pytest.mark.parametrize("async_save", [True, False])
def test_force_saves_the_final_step_when_the_run_length_is_not_a_multiple_of_the_interval(
    tmp_path, async_save
):
    run_loop(tmp_path, 25, async_save=async_save)
    with tg.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert valid_steps(mgr) == [10, 20, 25]
        state = {
            "w": torch.zeros(3),
            "loader": tg.ResumableLoader(TensorDataset(torch.arange(10)), batch_size=4),
        }
        assert mgr.restore_latest(state) == 25
        assert state["w"].tolist() == [25.0] * 3  # the last 5 steps were not lost


def test_force_on_a_step_the_policy_already_saved_makes_no_second_save(tmp_path):
    run_loop(tmp_path, 20)
    with tg.CheckpointManager(tmp_path, read_only=True) as mgr:
        assert valid_steps(mgr) == [10, 20]
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(10), async_save=False) as mgr:
        state = {"w": torch.zeros(3)}
        assert mgr.maybe_save(20, state, force=True) is None  # already committed: no overwrite, no error
        assert mgr.maybe_save(21, state, force=True) is not None


def test_a_step_based_loop_over_forever_resumes_to_the_uninterrupted_batch_sequence(tmp_path):
    reference = run_loop(tmp_path / "ref", 23)
    # killed (the manager is left without its final save) after step 17, then resumed from step 10
    first = []
    state = {
        "w": torch.zeros(3),
        "loader": tg.ResumableLoader(TensorDataset(torch.arange(10)), batch_size=4, seed=1),
    }
    mgr = tg.CheckpointManager(tmp_path / "run", save_policy=tg.EveryNSteps(10), async_save=False)
    batches = state["loader"].forever()
    for step in range(1, 18):
        first.append(next(batches)[0].tolist())
        mgr.maybe_save(step, state)
    mgr.close()
    resumed = run_loop(tmp_path / "run", 23)
    assert first == reference[:17]
    assert resumed == reference[10:]  # steps 11..23 see exactly the batches of the uninterrupted run
    assert len(reference) == 23  # 3 batches per epoch: the loop ran through 8 epoch ends without stopping


def test_forever_refuses_an_epoch_that_yields_no_batch_instead_of_spinning():
    ld = tg.ResumableLoader(TensorDataset(torch.arange(3)), batch_size=4, drop_last=True)
    with pytest.raises(tg.ConfigError, match="drop_last"):
        next(ld.forever())


def test_keep_best_keeps_the_n_best_by_metric_and_never_the_newest_valid_one_away(tmp_path):
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.2, 5: math.nan, 6: 0.8, 7: 0.7}
    with tg.CheckpointManager(tmp_path, keep=tg.KeepBest("loss", 2), async_save=False) as mgr:
        for step, loss in losses.items():
            mgr.save(step, {"w": torch.full((4,), float(step))}, metrics={"loss": loss})
        mgr.save(8, {"w": torch.zeros(4)})  # no metric recorded: not ranked, but the newest: kept
        assert valid_steps(mgr) == [2, 4, 8]


def test_keep_best_in_max_mode_combines_with_keep_latest(tmp_path):
    acc = {10: 0.5, 20: 0.9, 30: 0.7, 40: 0.6, 50: 0.4}
    policy = tg.AnyOfRetention(tg.KeepLatest(2), tg.KeepBest("acc", 1, mode="max"))
    with tg.CheckpointManager(tmp_path, keep=policy, async_save=False) as mgr:
        for step, a in acc.items():
            mgr.save(step, {"w": torch.full((4,), float(step))}, metrics={"acc": a})
        assert valid_steps(mgr) == [20, 40, 50]
    with tg.CheckpointManager(
        tmp_path, keep=policy, async_save=False
    ) as mgr:  # a new process: metrics re-read
        mgr.save(60, {"w": torch.ones(4)}, metrics={"acc": 0.95})
        assert valid_steps(mgr) == [50, 60]


def test_keep_best_satisfies_the_retention_protocol_and_rejects_bad_settings():
    assert isinstance(KeepBest("loss", 3), RetentionPolicy)
    assert isinstance(AnyOfRetention(KeepLatest(1), KeepBest("loss")), RetentionPolicy)
    for bad in (
        lambda: KeepBest(""),
        lambda: KeepBest("loss", 0),
        lambda: KeepBest("loss", 2, mode="lowest"),
    ):
        with pytest.raises(tg.ConfigError):
            bad()


@pytest.mark.parametrize(
    ("value", "advice"),
    [
        (DataLoader(TensorDataset(torch.arange(8.0))), "tg.ResumableLoader"),
        (
            {"train": {"it": DataLoader(TensorDataset(torch.arange(8.0)))}},
            "'loader' at ['train']['it'] holds a value",
        ),
        (iter(DataLoader(TensorDataset(torch.arange(8.0)))), "tg.ResumableLoader"),
        (RandomSampler(range(8)), "tg.ResumableSampler"),
        (torch.Generator(), "tg.RNGState()"),
        (lambda x: x, "not the callable"),
        ({"nested": [1, object()]}, "state_dict()/load_state_dict()"),
    ],
)
def test_an_unsupported_value_is_refused_with_what_to_use_instead_and_no_terminal_escapes(
    tmp_path, value, advice
):
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(tg.ConfigError) as err:
            mgr.save(1, {"w": torch.ones(2), "loader": value})
        message = str(err.value)
        assert "'loader'" in message and advice in message
        assert "\x1b" not in message and not re.search(r"\[\d+m", message)
        assert "weights_only=False" not in message and "add_safe_globals" not in message
        assert isinstance(err.value, tg.TrainguardError) and not mgr.checkpoints()


def test_config_error_is_exported_with_the_other_errors(tmp_path):
    assert tg.ConfigError.__module__ == "trainguard.errors" and "ConfigError" in tg.__all__
    with pytest.raises(tg.ConfigError):
        tg.CheckpointManager(tmp_path, when_busy="sometimes")
    assert issubclass(tg.ConfigError, ValueError)
