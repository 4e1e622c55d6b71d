"""Uneven data across ranks: every rank runs the same batches of a loader, and they all stop together.

Under 2D sparse parallelism every batch's lookup is a collective of its shard group and DDP's gradient
all-reduce one of the world, so a rank with a batch more than the others cannot run it alone: it
would wait for them until the process group's timeout (pipelined: its next batch's ids are sent
ahead to ranks that have none), or pair its step with another rank's step of the next epoch.
``even_batches`` wraps a loader (the strategies' ``process_dataloader``, for every stage) so that:

* at set-up (one all-gather of every rank's ``len``): a loader whose length differs between ranks
  takes the smallest one on every rank, so that Lightning (progress bar, ``done``) stops every rank
  there; a loader without a length on some rank has none on every rank;
* a batch is handed out only after every rank has read one: one all-reduce per batch, of two
  integers, before the batch reaches the training loop (so before the input pipeline sends its ids
  ahead). When some rank has run out, every rank stops there (``StopIteration``) and the batches
  the others still had are skipped. It costs one small collective per batch on the world's backend,
  kept off the step: each rank reads one batch ahead and starts that batch's all-reduce as it hands
  out the one before, so the agreement travels while the step runs and is read when the next batch
  is asked for (waited for on the spot, it cost each step about 4 ms over gloo with 4 ranks on 2
  cores). A loader that keeps its place in checkpoints (``state_dict``, e.g. ``ResumableLoader``)
  is not read ahead: its saved place would count the batch read early. Riding an existing
  collective would not do: the step's first world collective (DDP's) comes after the lookups that
  must not start.

Either way rank 0 warns once, naming every rank's count of batches, or, for ``predict`` (``strict``),
every rank raises the same ``RuntimeError``: a skipped batch would be a prediction silently missing.
With one process the loader is returned as it is.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.data import sized_len
from lightning.fabric.utilities.types import _Stateful
from torch.distributed import ProcessGroup
from torch.utils.data import DataLoader

from lightning_twod.distributed.consensus import reduce_device
from lightning_twod.distributed.groups import group_size

_END = object()
FIX = ("give every rank the same number of batches (e.g. lightning_twod.datasets.sharding.EvalShardSampler, "
       "which pads a rank's share with index -1, or an IterableDataset that splits its samples evenly)")


def even_batches(loader: Any, group: ProcessGroup | None, what: str = "dataloader", strict: bool = False) -> Any:
    """``loader``, iterated in step on every rank of ``group`` (a collective: every rank calls it).

    ``what`` names the loader in messages (``"train dataloader"``); ``strict``: raise instead of
    warning. A ``DataLoader`` stays one (a copy of its class's even twin: Lightning and Fabric read its
    sampler, dataset and workers as before); another iterable is wrapped.
    """
    size = group_size(group)
    if size == 1:
        return loader
    lengths: list[int | None] = [None] * size
    dist.all_gather_object(lengths, sized_len(loader), group=group)
    agreement = _Agreement(group, what, strict, lengths)
    if not isinstance(loader, DataLoader):
        return _EvenIterable(loader, agreement)
    even = copy.copy(loader)  # the user's loader keeps working without collectives
    even.__class__ = _even_class(type(loader))
    even._even = agreement
    return even


class _Agreement:
    """The shared length of one loader (None: none) and the per-batch agreement of its iterations."""

    def __init__(self, group: ProcessGroup, what: str, strict: bool, lengths: list[int | None]) -> None:
        self.group, self.what, self.strict = group, what, strict
        sized = all(n is not None for n in lengths)
        self.length = min(lengths) if sized else None
        if sized and len(set(lengths)) > 1:
            listed = ", ".join(f"rank {rank}: {n}" for rank, n in enumerate(lengths))
            self._report(f"has a different number of batches on each rank: {listed}", lengths)

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(f"the {self.what} has no length on every rank")
        return self.length

    def iterate(self, iterator: Iterator, ahead: bool = True) -> Iterator:
        """The items of ``iterator`` while every rank has one (one all-reduce each, module doc); ``ahead``:
        read the next item as one is handed out (not for a loader whose checkpointed state counts reads)."""
        count, pending = 0, self._read(iterator)
        while True:
            item, have, flags, work = pending
            work.wait()
            every, none = flags.tolist()  # min(have), -max(have)
            if every:
                count += 1
                pending = self._read(iterator) if ahead else None  # every rank at the same point: one order
                yield item
                pending = pending or self._read(iterator)
                continue
            if none:  # some rank still had a batch
                self._ran_out(count, have)
            return

    def _read(self, iterator: Iterator) -> tuple[Any, int, torch.Tensor, Any]:
        """The next item of ``iterator`` (``_END`` if none), whether there was one, and the all-reduce that
        tells every rank whether every rank (and whether none) had one, started."""
        item = next(iterator, _END)
        have = int(item is not _END)
        flags = torch.tensor([have, -have], device=reduce_device(self.group))
        return item, have, flags, dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group, async_op=True)

    def _ran_out(self, count: int, have: int) -> None:
        """Gather every rank's ``[batches read, whether more may follow]`` and report them."""
        mine = torch.tensor([count + have, have], device=reduce_device(self.group))
        reads = [torch.empty_like(mine) for _ in range(group_size(self.group))]
        dist.all_gather(reads, mine, group=self.group)
        counts = [int(n) for n, _ in reads]
        listed = ", ".join(f"rank {rank}: {'at least ' if more else ''}{int(n)}"
                           for rank, (n, more) in enumerate(reads))
        self._report(f"ran out of batches: {listed}", counts)

    def _report(self, text: str, counts: list[int]) -> None:
        """Warn on rank 0 (raise on every rank with ``strict``) about the batches of ``counts`` past the
        smallest, which no rank runs."""
        common = min(counts)
        longer = [rank for rank, n in enumerate(counts) if n > common]
        if self.strict:
            raise RuntimeError(f"uneven data: the {self.what} {text}; the predictions of rank(s) {longer} past "
                               f"batch {common} would be missing, so no rank runs on: {FIX}")
        if dist.get_rank(self.group) == 0:
            warnings.warn(f"uneven data: the {self.what} {text}; every rank stops after {common} batch(es), and "
                          f"the rest on rank(s) {longer} are skipped: {FIX}", stacklevel=2)


@functools.cache
def _even_class(cls: type) -> type:
    """The even twin of a ``DataLoader`` class: its iterations agree, its length is the shared one (the
    loader's ``_even``). Only methods are added, so that a loader of ``cls`` can take this class."""

    def __iter__(self) -> Iterator:
        return self._even.iterate(cls.__iter__(self), ahead=not isinstance(self, _Stateful))

    def __len__(self) -> int:
        return len(self._even)

    return type(f"Even{cls.__name__}", (cls,),
                {"__module__": __name__, "__slots__": (), "__iter__": __iter__, "__len__": __len__})


class _EvenIterable:
    """An iterable other than a ``DataLoader``, made even; other attributes are the loader's."""

    def __init__(self, loader: Iterable, agreement: _Agreement) -> None:
        self.loader, self._even = loader, agreement

    def __iter__(self) -> Iterator:
        return self._even.iterate(iter(self.loader), ahead=not isinstance(self.loader, _Stateful))

    def __len__(self) -> int:
        return len(self._even)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "_even"):  # not set yet (a copy being built)
            raise AttributeError(name)
        return getattr(self.loader, name)
