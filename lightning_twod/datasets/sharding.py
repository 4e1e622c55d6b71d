"""Which samples a rank evaluates: every sample exactly once, every rank the same number of batches.

Lightning's ``DistributedSampler`` repeats samples to even out the ranks (test metrics then count
them twice), and for ``predict`` it gives the ranks uneven shares, so one rank can run a batch more
than another: under ``TwoDSparseStrategy`` each batch's lookup is a collective of the shard
group, and an extra batch on one rank hangs the others. :class:`EvalShardSampler` avoids both:
rank ``r`` of ``W`` gets the samples ``r, r + W, r + 2W, ...`` (no repeats), and a rank whose
share ends one batch early gets one padding sample, index ``-1``, so that every rank runs
``ceil(ceil(N / W) / batch_size)`` batches. The data sets mark padding with ``index = -1`` in the
batch; the DLRM's loss, metrics and predictions leave it out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import lightning.pytorch as pl
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_twod.distributed.groups import has_process_group

PADDING = -1
"""The ``index`` of a padding sample (a batch key ``"index"``: ``[B]`` int64)."""


def rank_and_world(trainer: pl.Trainer | None) -> tuple[int, int]:
    """This process's data-parallel rank and the number of ranks: the Trainer's, else the default
    process group's, else ``(0, 1)``."""
    if trainer is not None:
        return trainer.global_rank, trainer.world_size
    if has_process_group():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def batches_per_rank(num_samples: int, world_size: int, batch_size: int) -> int:
    """Batches every rank runs for ``num_samples`` samples strided over ``world_size`` ranks."""
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


class EvalShardSampler(DistributedSampler):
    """Sample indices of rank ``rank`` of ``num_replicas``: ``rank, rank + W, ...`` and, where that share
    ends a batch early, one ``PADDING`` index (module doc). A ``DistributedSampler``, so Lightning
    uses it as it is instead of injecting its own.

    The data set's ``__getitem__`` must pass ``PADDING`` through (ours return the index itself) and
    its ``collate`` must turn it into a padding sample with ``index = -1``.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int, batch_size: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        self.batch_size = batch_size
        total = len(dataset)
        self.indices = list(range(rank, total, num_replicas))
        if math.ceil(len(self.indices) / batch_size) < batches_per_rank(total, num_replicas, batch_size):
            self.indices.append(PADDING)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def eval_loader(dataset, batch_size: int, trainer: pl.Trainer | None, num_workers: int = 0) -> DataLoader:
    """A test / predict ``DataLoader`` over ``dataset`` (with a ``collate(indices)``) for this rank."""
    rank, world = rank_and_world(trainer)
    return DataLoader(dataset, batch_size=batch_size, sampler=EvalShardSampler(dataset, world, rank, batch_size),
                      collate_fn=dataset.collate, num_workers=num_workers)
