"""ResumableSampler inside a DataLoader you build (tester report 5, finding 1): a DataLoader without its own
generator draws its base seed from the global torch RNG at every iter(); a resumed run calls iter() once more
than the run it continues, so dropout masks shift. ResumableSampler.dataloader() is bit-exact, and the plain
construction warns at the resume."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import trainguard as tg

N, BATCH = 200, 16


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 8, generator=g)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def train(root, steps: int, *, stop_at: int | None = None, plain: bool = False) -> dict[str, torch.Tensor]:
    """The tester's shape: MLP with dropout, AdamW, a ResumableSampler DataLoader, RNGState; fresh objects."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = tg.ResumableSampler(N, seed=7)
    ds = dataset()
    dl = (
        DataLoader(ds, batch_size=BATCH, sampler=sampler)
        if plain
        else sampler.dataloader(ds, batch_size=BATCH)
    )
    state = {"model": model, "optim": optim, "sampler": sampler, "rng": tg.RNGState()}
    with tg.CheckpointManager(root, save_policy=tg.EveryNSteps(10), trajectory_steps=0, keep=None) as mgr:
        step = mgr.restore_latest(state) or 0
        while step < steps:
            for x, y in dl:
                step += 1
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
                optim.zero_grad()
                loss.backward()
                optim.step()
                sampler.start += BATCH
                mgr.maybe_save(step, state)
                if step in (steps, stop_at):
                    return {k: v.detach().clone() for k, v in model.state_dict().items()}
            sampler.epoch, sampler.start = sampler.epoch + 1, 0
    raise AssertionError("unreachable")


def test_a_resume_through_sampler_dataloader_is_bit_exact(tmp_path):
    straight = train(tmp_path / "a", 40)
    train(tmp_path / "b", 40, stop_at=20)  # 20 = epoch 1, batch 8 of 13: a mid-epoch resume
    with warnings.catch_warnings():
        warnings.simplefilter("error", tg.ResumeNotExactWarning)
        resumed = train(tmp_path / "b", 40)
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_a_plain_dataloader_resumed_mid_epoch_warns_and_is_not_exact(tmp_path):
    """The construction the README used to show: the warning names the fix; the divergence is real."""
    straight = train(tmp_path / "a", 40, plain=True)
    train(tmp_path / "b", 40, stop_at=20, plain=True)
    with pytest.warns(
        tg.ResumeNotExactWarning, match=r"resumed mid-epoch \(epoch 1, start 112\).*dataloader"
    ):
        resumed = train(tmp_path / "b", 40, plain=True)
    assert any(not torch.equal(straight[k], resumed[k]) for k in straight)


def test_the_epoch_seeded_loader_never_draws_from_the_global_rng_and_seeds_workers_per_epoch():
    sampler = tg.ResumableSampler(N, seed=7)
    dl = sampler.dataloader(dataset(), batch_size=BATCH)
    before = torch.get_rng_state()
    seeds = []
    for epoch in (0, 0, 1):
        sampler.epoch = epoch
        it = iter(dl)
        seeds.append(it._base_seed)  # what the workers' seeds derive from
    assert torch.equal(torch.get_rng_state(), before)
    assert seeds[0] == seeds[1] != seeds[2]  # a function of (seed, epoch), not of how often iter() ran


def test_sampler_dataloader_refuses_what_it_sets_and_a_wrong_dataset():
    sampler = tg.ResumableSampler(N, seed=7)
    with pytest.raises(tg.ConfigError, match="sets 'generator' itself"):
        sampler.dataloader(dataset(), generator=torch.Generator())
    with pytest.raises(tg.ConfigError, match="has 5 samples but this ResumableSampler was built for 200"):
        sampler.dataloader(TensorDataset(torch.arange(5)))
