"""A healthy job with a noisy per-batch loss (random data, batch 8) resumed bit-exact must never be condemned by
the loss-trajectory check (tester finding: the band built from 5 losses tripped at step 27 and marked every
checkpoint suspect)."""

from __future__ import annotations

import torch

import trainguard as tg
from trainguard.recovery.events import read_events


def noisy_launch(root, upto, *, save_last=True):
    """The tester's train.py in-process: a small MLP on random data, batch 8, EveryNSteps(5), keep=3, probe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, 10)
    ds = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    loader = tg.ResumableLoader(ds, batch_size=8, shuffle=True, seed=1)
    probe_x = torch.randn(4, 16)

    def probe():
        with torch.no_grad():
            return model(probe_x)

    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
    losses = {}
    with tg.CheckpointManager(
        root, save_policy=tg.EveryNSteps(5), keep=3, probe=probe, async_save=False
    ) as mgr:
        start = mgr.restore_latest(state) or 0
        batches = loader.forever()
        for step in range(start + 1, upto + 1):
            x, y = next(batches)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            sched.step()
            losses[step] = loss.item()
            mgr.maybe_save(
                step, state, metrics={"loss": loss}, force=save_last and step == upto
            )  # a tensor that requires grad
    return start, losses


def test_a_bit_exact_resume_of_a_noisy_job_is_confirmed_and_never_condemned(tmp_path):
    with _no_grad_warning():
        _, first = noisy_launch(tmp_path, 8, save_last=False)  # "dies" after step 8; checkpoint 5
        start, second = noisy_launch(tmp_path, 30)
    assert start == 5
    assert all(second[s] == first[s] for s in (6, 7, 8))  # bit-exact: the overlap matches
    assert not list(read_events(tmp_path, event="resume_diverged"))
    [confirmed] = read_events(tmp_path, event="resume_confirmed")
    assert confirmed["restored_step"] == 5 and confirmed["steps"] == [6, 7, 8]
    st = {i.step: i.status for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()}
    assert set(st.values()) == {"valid"} and max(st) == 30


class _no_grad_warning:
    """No "Converting a tensor with requires_grad=True to a scalar" UserWarning from the loss log."""

    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.caught = self._cm.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._cm.__exit__(*exc)
        bad = [w for w in self.caught if "requires_grad" in str(w.message)]
        assert not bad, bad
        return False
