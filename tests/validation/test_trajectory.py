"""The loss-trajectory check after a resume (issue 11): a data change after resume raises ResumeDivergedError
within trajectory_steps, marks the checkpoints suspect, and the next launch resumes from an older one; a
bit-exact resume never trips it."""

from __future__ import annotations

import json

import pytest
import torch

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.validation.trajectory import (
    EXACT_REL,
    TRAJECTORY_DIR,
    TrajectoryCheck,
    confirmed_steps,
    history,
)


def launch(root, upto, *, scale_from=None, scale=10.0, trajectory_steps=50):
    """One launch of a small regression job: resumes, trains to ``upto``, saves every 5 steps.

    From step ``scale_from`` on, the targets are multiplied by ``scale`` (the data changed). Returns the
    restored step and the losses of this launch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optim": optim}
    w_true = torch.arange(6, dtype=torch.float32).reshape(6, 1) / 6
    losses = {}
    with tg.CheckpointManager(
        root, save_policy=tg.EveryNSteps(5), trajectory_steps=trajectory_steps, keep=None
    ) as mgr:
        start = mgr.restore_latest(state) or 0
        for step in range(start + 1, upto + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 6, generator=g)
            y = x @ w_true
            if scale_from is not None and step >= scale_from:
                y = y * scale
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses[step] = loss.item()
            mgr.maybe_save(step, state, metrics={"loss": losses[step]})
    return start, losses


def statuses(root):
    return {i.step: i.status for i in tg.CheckpointManager(root, read_only=True).checkpoints()}


def test_bit_exact_resume_never_trips_and_matches_the_log(tmp_path):
    _, first = launch(tmp_path, 18)  # "dies" after step 18; checkpoints 5, 10, 15
    start, second = launch(tmp_path, 40)
    assert start == 15
    assert all(second[s] == first[s] for s in (16, 17, 18))  # the reference the check compared with
    assert not list(read_events(tmp_path, event="resume_diverged"))
    assert set(statuses(tmp_path).values()) == {"valid"}
    assert len(list((tmp_path / TRAJECTORY_DIR).iterdir())) == 2
    assert history(tmp_path)[18] == first[18]


def test_data_change_after_resume_raises_and_next_launch_resumes_older(tmp_path):
    launch(tmp_path, 18)
    with pytest.raises(tg.ResumeDivergedError) as ei:
        launch(tmp_path, 40, scale_from=16)
    err = ei.value
    assert err.restored_step == 15
    assert err.steps == [16]  # the first step after the resume: within trajectory_steps
    assert err.suspect_steps == [15]
    assert "step 16" in str(err)
    st = statuses(tmp_path)
    assert st[15] == "suspect" and st[10] == "valid"
    ev = list(read_events(tmp_path, event="resume_diverged"))
    assert [e["restored_step"] for e in ev] == [15]
    # the next launch (same data as the first) skips the suspect checkpoint, resumes from 10 and does not
    # compare with the diverged launch's losses
    start, third = launch(tmp_path, 30)
    assert start == 10
    st = statuses(tmp_path)
    assert st[15] == "valid"  # saved anew by the third launch: the suspect one was replaced
    assert {20, 25, 30} <= set(st)


def test_a_confirmed_resume_is_not_judged_past_the_failure_point(tmp_path):
    """Steps 16-18 match the launch that died: the restore is confirmed and the check ends there; what the loss
    does past the failure point (new territory) never condemns the checkpoints."""
    launch(tmp_path, 18)
    start, _ = launch(
        tmp_path, 40, scale_from=22, scale=30.0
    )  # fine until 22, past the last logged step (18)
    assert start == 15
    assert not list(read_events(tmp_path, event="resume_diverged"))
    [ev] = read_events(tmp_path, event="resume_confirmed")
    assert ev["restored_step"] == 15 and ev["steps"] == [16, 17, 18]
    assert confirmed_steps(tmp_path) == {15}
    assert set(statuses(tmp_path).values()) == {"valid"}


def _as_world_size_2(root):
    """Rewrites every trajectory log as logged at world size 2 (the launch that died ran at another size)."""
    for p in (root / TRAJECTORY_DIR).iterdir():
        lines = p.read_text().splitlines()
        assert json.loads(lines[0]) == {"world_size": 1}
        p.write_text("\n".join([json.dumps({"world_size": 2}), *lines[1:]]) + "\n")


def test_without_same_step_references_the_band_marks_the_launchs_own_checkpoints(tmp_path):
    launch(tmp_path, 28)  # checkpoints 5-25, 28 losses
    _as_world_size_2(tmp_path)  # no same-step reference at world size 1: only the band (25 losses) judges
    with pytest.raises(tg.ResumeDivergedError) as ei:
        launch(tmp_path, 60, scale_from=32, scale=30.0)
    err = ei.value
    # the band judges the median of the last 5 losses: 3 of them above it (32-34)
    assert err.restored_step == 25 and err.steps == [34]
    assert err.suspect_steps == [25, 30]  # the restored checkpoint and the one this launch saved
    st = statuses(tmp_path)
    assert st[25] == "suspect" and st[30] == "suspect" and st[20] == "valid"
    start, _ = launch(tmp_path, 20)
    assert start == 20


def test_a_trip_never_condemns_a_confirmed_checkpoint(tmp_path):
    launch(tmp_path, 28)  # checkpoints 5-25
    start, _ = launch(tmp_path, 29)  # resumes from 25; steps 26-28 match: 25 is confirmed (no save at 30)
    assert start == 25 and confirmed_steps(tmp_path) == {25}
    with pytest.raises(tg.ResumeDivergedError) as ei:
        launch(tmp_path, 60, scale_from=27)  # resumes from 25 again; the data changed at 27
    err = ei.value
    assert err.restored_step == 25 and err.steps == [27] and err.suspect_steps == []
    assert "step 25 is kept: an earlier resume from it was confirmed" in str(err)
    assert statuses(tmp_path)[25] == "valid"
    # without same-step references (another world size) a confirmed step gets no band either
    _as_world_size_2(tmp_path)
    assert TrajectoryCheck.arm(tmp_path, 25, 50, world_size=1).median is None
    assert TrajectoryCheck.arm(tmp_path, 20, 50, world_size=1).median is not None


def test_never_loops_when_every_candidate_is_suspect(tmp_path):
    launch(tmp_path, 12)  # checkpoints 5, 10
    for expected in (10, 5):  # each diverging launch condemns the checkpoint it resumed from
        with pytest.raises(tg.ResumeDivergedError) as ei:
            launch(tmp_path, 40, scale_from=1)
        assert ei.value.restored_step == expected
    with pytest.raises(tg.NoValidCheckpointError, match="Suspect checkpoints"):
        launch(tmp_path, 40)


def test_a_same_step_loss_within_the_trip_tolerance_but_not_reproduced_is_not_confirmed():
    """11 % off (tester report 5): not a divergence (6 MAD of noisy losses), but never "confirmed"."""
    chk = TrajectoryCheck(restored_step=25, window=6, reference={26: 0.168, 27: 0.227}, median=None, mad=0.1)
    assert chk.check(26, 0.18696) is None and chk.inexact == {26: (0.18696, 0.168)}
    assert chk.check(27, 0.227) is None and not chk.confirmed  # one step not reproduced: not confirmed
    assert chk.check(28, 1e9) is None  # past the references, no band: nothing judged
    assert chk.check(27, 0.227 * (1 + 2 * EXACT_REL)) is None and not chk.confirmed


def test_an_inexact_resume_is_reported_not_confirmed(tmp_path):
    """A resume whose data moved by 1 % trains like the failed launch but not the same: a warning and a
    resume_not_reproduced event, no resume_confirmed (before: confirmed, and so never condemned later)."""
    launch(tmp_path, 18)
    with pytest.warns(RuntimeWarning, match="resume not reproduced exactly: after the restore of step 15"):
        start, _ = launch(tmp_path, 22, scale_from=16, scale=1.01)
    assert start == 15
    [ev] = read_events(tmp_path, event="resume_not_reproduced")
    assert ev["restored_step"] == 15 and ev["step"] == 16 and ev["rel_diff"] > EXACT_REL
    assert ev["tolerance"] == EXACT_REL
    assert not list(read_events(tmp_path, event="resume_confirmed"))
    assert not list(read_events(tmp_path, event="resume_diverged"))
    assert confirmed_steps(tmp_path) == set()


def test_check_same_step_confirmation_and_band(tmp_path):
    chk = TrajectoryCheck(restored_step=10, window=6, reference={11: 1.0, 12: 1.0}, median=None, mad=0.1)
    assert chk.check(11, 1.0) is None  # bit-exact
    assert (
        chk.check(12, 1.7) is not None and not chk.confirmed
    )  # beyond 6 MAD of the losses before the checkpoint
    chk = TrajectoryCheck(restored_step=10, window=6, reference={11: 1.0, 12: 1.1}, median=None, mad=0.1)
    assert chk.check(11, 1.00005) is None and not chk.confirmed  # within EXACT_REL; step 12 not seen yet
    assert chk.check(12, 1.1) is None and chk.confirmed and chk.max_rel == pytest.approx(5e-5)
    assert chk.check(13, 100.0) is None  # confirmed: past the failure point nothing is judged
    band = TrajectoryCheck(restored_step=10, window=6, reference={}, median=2.0, mad=0.1)
    assert band.check(12, 3.0) is None  # band: 2.0 + 10 * 0.1 + 10 % of 2.0 = 3.2
    assert band.check(13, 9.0) is None  # one noisy batch above the band is not a divergence
    assert band.check(14, 3.3) is not None  # the median of 3.0, 9.0, 3.3 is above it
    assert band.check(15, float("nan")) is not None
    assert band.check(17, 100.0) is None  # past the window
    assert band.done(17) and not band.done(16)
    with pytest.raises(tg.ConfigError, match="trajectory_steps"):
        tg.CheckpointManager(tmp_path / "root", trajectory_steps=-1)


class _DeviceLoss:
    """Stands in for a loss tensor on an accelerator: reading it is what a GPU sync would be."""

    class device:  # noqa: N801 - mirrors torch.Tensor.device
        type = "cuda"

    def __init__(self, x: float) -> None:
        self.x = x
        self.reads = 0

    def detach(self):
        return self

    def __float__(self) -> float:
        self.reads += 1
        return self.x


def test_a_loss_on_an_accelerator_is_read_one_step_later(tmp_path):
    from trainguard.validation.trajectory import Recorder

    rec = Recorder(tmp_path, "run", 50, coordinator=True)
    a, b = _DeviceLoss(1.0), _DeviceLoss(2.0)
    rec.record(1, {"loss": a})
    assert a.reads == 0  # not waited for in the step that queued it
    rec.record(2, {"loss": b})
    assert a.reads == 1 and b.reads == 0
    rec.record(3, {"loss": torch.tensor(0.5)})  # a CPU tensor is read at once
    rec.close()  # the last deferred loss is logged at close
    assert history(tmp_path) == {1: 1.0, 2: 2.0, 3: 0.5}


def test_same_step_losses_are_references_only_at_the_same_world_size(tmp_path):
    """After a resize (torchrun elastic) a step trains on other samples per rank: the loss logged at world size
    2 is not a reference at world size 1 (only the band applies), but still is at world size 2."""
    from trainguard.validation.trajectory import TrajectoryLog

    log = TrajectoryLog(tmp_path, "run-a", world_size=2)
    for step in range(1, 41):
        log.append(step, 3.70 + 0.01 * (step % 3))  # the launch that died, at world size 2 (MAD 0.01)
    log.close()
    other = TrajectoryCheck.arm(tmp_path, 30, 50, world_size=1)
    assert other.reference == {} and other.median is not None  # 30 losses before step 30: a band
    assert other.check(31, 3.75) is None  # off step 31's loss at world size 2 by 4 MAD: inside the band
    assert other.check(32, 9.0) is None and other.check(33, 9.0) is not None  # a sustained rise: caught
    assert TrajectoryCheck.arm(tmp_path, 10, 50, world_size=1).median is None  # 10 losses: too few for a band
    same = TrajectoryCheck.arm(tmp_path, 30, 50, world_size=2)
    assert same.reference[31] == pytest.approx(3.71) and same.median is None  # references: no band
    assert same.check(31, 3.75) is None and same.check(32, 3.95) is not None  # 23 MAD off step 32's loss
