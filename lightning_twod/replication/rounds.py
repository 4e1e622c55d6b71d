"""One round of the cross-group reduction over one process group: a coalesced buffer, in flight.

Every replicated shard of the group contributes a segment: the rows some copy touched since the
last reduction (all rows of a shard when most of them were, which saves the gather), its weights
``[u, D]`` and row-wise state ``[u]``, laid end to end in one flat fp32 buffer. The round sends it
with one all-reduce (``async_op``: training may go on meanwhile) and writes the mean back.

Written back where the row did not change since the launch: the mean itself, so copies become
bit-identical. Where it did (training went on while the round was in flight): the correction
``w <- w + (mean - w_launch)``, which keeps this copy's own updates since the launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.replication import wire

#: A shard whose touched rows are at least this share of its rows is sent whole: copying one
#: contiguous block costs less than gathering and scattering rows one by one, and the bytes that
#: leaving out the untouched rest would save are at most the remaining share.
DENSE_SHARE = 0.5


@dataclass
class Segment:
    """One shard's part of a round.

    ``tensors``: the copy's live ``[R, d]`` tensors (weights ``[R, D]``; row-wise state as
    ``[R, 1]``); ``references``: the same as after the last reduction (bf16 wire), or None;
    ``rows``: the rows sent ``[u]`` (None: the whole shard); ``changed()``: ``[R]`` bool, the rows
    that changed since the launch.
    """

    tensors: list[Tensor]
    references: list[Tensor] | None
    rows: Tensor | None
    changed: Callable[[], Tensor]

    @property
    def count(self) -> int:
        return self.tensors[0].shape[0] if self.rows is None else self.rows.numel()

    def pick(self, tensor: Tensor) -> Tensor:
        return tensor if self.rows is None else tensor.index_select(0, self.rows)

    def write(self, target: Tensor, values: Tensor) -> None:
        if self.rows is None:
            target.copy_(values)
        else:
            target.index_copy_(0, self.rows, values)


def _flat(segments: list[Segment], which: Callable[[Segment], list[Tensor]]) -> Tensor:
    parts = [seg.pick(t).reshape(-1) for seg in segments for t in which(seg)]
    return torch.cat(parts) if parts else torch.zeros(0)


class Round:
    """The reduction of ``segments`` over ``group`` (``copies`` members), launched at construction."""

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, sync_dtype: str) -> None:
        self.segments, self.copies, self.sync_dtype = segments, copies, sync_dtype
        self.launched = _flat(segments, lambda seg: seg.tensors)
        self.reference = (_flat(segments, lambda seg: seg.references) if wire.needs_reference(sync_dtype)
                          else None)
        self.buffer = wire.encode(self.launched, self.reference, sync_dtype)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True) if self.buffer.numel() else None

    @property
    def rows(self) -> int:
        return sum(seg.count for seg in self.segments)

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the sum, then write the mean (or the correction) and the new references."""
        if self.work is not None:
            self.work.wait()
        mean = wire.decode(self.buffer, self.reference, self.copies, self.sync_dtype)
        start = 0
        for seg in self.segments:
            changed = seg.pick(seg.changed()).unsqueeze(1)
            references = seg.references or [None] * len(seg.tensors)
            for target, reference in zip(seg.tensors, references, strict=True):
                n = seg.count * target.shape[1]
                new = mean[start:start + n].view(seg.count, target.shape[1])
                launched = self.launched[start:start + n].view_as(new)
                seg.write(target, torch.where(changed, seg.pick(target) + (new - launched), new))
                if reference is not None:
                    seg.write(reference, new)
                start += n
