"""Resumable data order for a plain ``torch.utils.data.DataLoader``.

The rule: the position saved is the number of samples of the current epoch *delivered to the training loop*
(not what worker processes prefetched), and each epoch's order is a pure function of ``(seed, epoch)``. So a
resumed run continues the epoch exactly where the loop left it, and later epochs are shuffled exactly as in an
uninterrupted run, however many times it resumes and whatever ``num_workers`` is.

torchdata's ``StatefulDataLoader`` is also supported as ordinary state (it has state_dict/load_state_dict); note
the upstream behaviour documented in the README: with ``shuffle=True`` and a ``generator``, resuming mid-epoch
continues that epoch correctly but shuffles the *following* epochs differently from an uninterrupted run.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..errors import ConfigError, ResumeNotExactWarning


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The sample order of ``epoch``: a permutation of ``range(n)`` (int64, shape [n]) from numpy's
    SeedSequence of ``(seed, epoch)``, or ``arange(n)`` without shuffle."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch)]).permutation(n).astype(np.int64)


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the ``DataLoader`` generator for ``epoch`` (int in ``[0, 2**63)``): the base seed of its
    worker processes is drawn from it, never from the global torch RNG."""
    return (int(seed) * 1_000_003 + int(epoch)) & 0x7FFF_FFFF_FFFF_FFFF


_LOADER_KWARGS_SET = ("sampler", "batch_sampler", "shuffle", "generator")


class EpochSeededDataLoader(DataLoader):  # type: ignore[type-arg]
    """A ``DataLoader`` over a :class:`ResumableSampler` whose generator is reseeded from the sampler's
    ``(seed, epoch)`` at every ``iter()``: the loader never draws from the global torch RNG, and its workers get
    the base seed an uninterrupted run gives them in the same epoch. Built by
    :meth:`ResumableSampler.dataloader`."""

    def __iter__(self) -> Any:
        s = self.sampler
        assert isinstance(s, ResumableSampler) and self.generator is not None
        self.generator.manual_seed(epoch_seed(s.seed, s.epoch))
        return super().__iter__()


class ResumableSampler(Sampler[int]):
    """Yields the indices of epoch ``epoch`` from position ``start`` on.

    Args:
        num_samples: dataset length (> 0).
        shuffle: shuffle each epoch (order from ``seed`` and the epoch number).
        seed: the shuffle seed.
        rank: this rank; the sampler yields only its share of every epoch (samples
            ``start + rank, start + rank + world_size, ...`` of the global order), as DistributedSampler does
            without padding.
        world_size: the number of ranks sharing every epoch (1: one process takes all samples).

    State (``state_dict``): ``epoch`` and ``start`` (global samples of the epoch already consumed).

    Build the ``DataLoader`` with :meth:`dataloader`, not ``DataLoader(dataset, sampler=sampler)``: a
    ``DataLoader`` without its own ``generator`` draws its base seed from the global torch RNG at every
    ``iter()``, and a resumed run calls ``iter()`` once more (at the restore, mid-epoch) than the run it
    continues, so every later random draw (dropout masks) differs although ``RNGState`` is in the state. A
    sampler restored mid-epoch warns (:class:`~trainguard.errors.ResumeNotExactWarning`) when its first
    ``iter()`` is not from :meth:`dataloader` or :class:`ResumableLoader`.
    """

    def __init__(
        self, num_samples: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1
    ) -> None:
        if num_samples <= 0:
            raise ConfigError(f"num_samples must be > 0, got {num_samples}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank={rank} world_size={world_size}")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0
        self._seeded_loader = False
        self._resumed_mid_epoch = False

    def dataloader(self, dataset: Dataset[Any], **loader_kwargs: Any) -> DataLoader[Any]:
        """A ``DataLoader`` over ``dataset`` with this sampler whose resume is bit-exact.

        Its generator is reseeded from ``(seed, epoch)`` at every ``iter()`` (as :class:`ResumableLoader`
        does), so iterating it never draws from the global torch RNG, and worker processes
        (``num_workers > 0``) get the same base seed as in an uninterrupted run of that epoch. Random draws in
        workers are then exact from the epoch after a mid-epoch resume on; within the resumed epoch a worker
        starts fresh, so per-sample randomness there is exact only when derived from the sample index. Set
        ``sampler.epoch`` before each epoch's ``iter()`` and advance ``sampler.start`` per batch, as for any
        use of this sampler. ``persistent_workers=True`` keeps the seeds of the epoch its workers started in.

        Args:
            dataset: a map-style dataset of ``num_samples`` samples.
            **loader_kwargs: passed to ``DataLoader`` (batch_size, num_workers, collate_fn, drop_last, ...).

        Returns:
            A ``DataLoader`` (an :class:`EpochSeededDataLoader`).

        Raises:
            ConfigError: ``sampler``, ``batch_sampler``, ``shuffle`` or ``generator`` is given (set here), or
                ``len(dataset)`` is not ``num_samples``.
        """
        for bad in _LOADER_KWARGS_SET:
            if bad in loader_kwargs:
                raise ConfigError(
                    f"ResumableSampler.dataloader sets {bad!r} itself; remove it from the arguments"
                )
        n = len(dataset)  # type: ignore[arg-type]
        if n != self.num_samples:
            raise ConfigError(
                f"the dataset has {n} samples but this ResumableSampler was built for {self.num_samples}; "
                "build the sampler with ResumableSampler(len(dataset), ...)"
            )
        self._seeded_loader = True
        return EpochSeededDataLoader(dataset, sampler=self, generator=torch.Generator(), **loader_kwargs)

    def __iter__(self) -> Iterator[int]:
        if self._resumed_mid_epoch:
            self._resumed_mid_epoch = False
            if not self._seeded_loader:
                warnings.warn(
                    f"trainguard: ResumableSampler resumed mid-epoch (epoch {self.epoch}, start {self.start}) "
                    "outside ResumableSampler.dataloader() and ResumableLoader: a DataLoader without its own "
                    "generator draws its seed from the global torch RNG at every iter(), so this resume is not "
                    "bit-exact (dropout and every later random draw shift). Build the loader with "
                    "sampler.dataloader(dataset, batch_size=..., ...) or use tg.ResumableLoader",
                    ResumeNotExactWarning,
                    stacklevel=2,
                )
        perm = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
        return iter(perm[self.start + self.rank :: self.world_size][: len(self)].tolist())

    def __len__(self) -> int:
        # The same share on every rank: ranks that train in lockstep must run the same number of batches, or
        # their collectives pair up across an epoch boundary. The last (remaining % world_size) samples of the
        # epoch are left out (DistributedSampler(drop_last=True) does the same); one process keeps them all.
        return max(0, (self.num_samples - self.start) // self.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if int(sd["num_samples"]) != self.num_samples:
            raise ConfigError(
                f"sampler state is for {sd['num_samples']} samples, this dataset has {self.num_samples}"
            )
        self.epoch, self.start, self.seed = int(sd["epoch"]), int(sd["start"]), int(sd["seed"])
        self._resumed_mid_epoch = self.start > 0


class ResumableLoader:
    """A ``DataLoader`` whose position (epoch, samples consumed) is saved and restored exactly.

    Iterating yields the rest of the current epoch; when an epoch is exhausted the next iteration starts the
    next epoch. ``state_dict()`` counts only batches the loop received, so worker prefetching never shifts it.

    Args:
        dataset: a map-style dataset.
        batch_size: samples per batch (per rank).
        shuffle: shuffle every epoch; the order is a function of ``(seed, epoch)`` (see
            :func:`epoch_permutation`).
        seed: the shuffle seed.
        drop_last: drop the last incomplete batch of each epoch.
        rank: this rank when every epoch is sharded across ranks (the global position is shared; resuming at
            another world size continues the same global order, so no sample of the epoch is repeated or
            skipped).
        world_size: the number of ranks sharing every epoch.
        **loader_kwargs: passed to DataLoader (num_workers, collate_fn, pin_memory, ...). Workers get a base seed
            derived from ``(seed, epoch)`` so the global torch RNG is never drawn from by the loader.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        for bad in _LOADER_KWARGS_SET:
            if bad in loader_kwargs:
                raise ConfigError(f"ResumableLoader sets {bad!r} itself; remove it from the arguments")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        n = len(dataset)  # type: ignore[arg-type]
        self.sampler = ResumableSampler(n, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        self.sampler._seeded_loader = True
        self._gen = torch.Generator()
        self.loader_kwargs = loader_kwargs

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        if len(s) == 0 or (self.drop_last and len(s) < self.batch_size):
            s.epoch, s.start = s.epoch + 1, 0
        self._gen.manual_seed(epoch_seed(s.seed, s.epoch))
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=s,
            drop_last=self.drop_last,
            generator=self._gen,
            **self.loader_kwargs,
        )
        for batch in loader:
            s.start = min(s.start + self.batch_size * s.world_size, s.num_samples)
            yield batch
        s.epoch, s.start = s.epoch + 1, 0

    def forever(self) -> Iterator[Any]:
        """Batches without end, epoch after epoch, for a loop counted in steps rather than epochs.

        ``for step in range(start + 1, total + 1): x, y = next(batches)`` with ``batches = loader.forever()``
        never stops at an epoch end; the position saved with the loader stays exact (the epoch number and
        the samples delivered in it). Create the iterator *after* ``restore_latest``, so it starts from the
        restored position.

        Yields:
            The batches the ``DataLoader`` would yield (``batch_size`` samples, collated), without end.

        Raises:
            ConfigError: an epoch yields no batch (``drop_last=True`` with fewer samples than ``batch_size``
                on this rank), so the iterator would spin forever.
        """
        while True:
            delivered = False
            for batch in self:
                delivered = True
                yield batch
            if not delivered:
                raise ConfigError(
                    f"ResumableLoader.forever(): an epoch of {len(self.sampler)} samples on this rank yields no "
                    f"batch of {self.batch_size} with drop_last=True; lower batch_size or set drop_last=False"
                )

    def _epoch_done(self) -> bool:
        """True once the last batch of the current epoch was delivered (nothing of it is left to yield)."""
        n = len(self.sampler)
        return n == 0 or (self.drop_last and n < self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "start", "seed", "num_samples"}``. Right after the last batch of an epoch (before the loop
        asks for the next one) the position is already the next epoch's start: ``(epoch + 1, 0)``."""
        sd = self.sampler.state_dict()
        if self._epoch_done():
            sd["epoch"], sd["start"] = sd["epoch"] + 1, 0
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the position; an epoch with nothing left (as older versions saved it after the last batch)
        becomes the start of the next, so ``epoch`` counts completed epochs as the uninterrupted run does."""
        self.sampler.load_state_dict(sd)
        if self._epoch_done():
            self.sampler.epoch, self.sampler.start = self.sampler.epoch + 1, 0
