"""A round of the cross-group reduction on the int8 wire, with error feedback.

Each copy sends, for every touched row, its change since the last reduction plus what rounding
dropped from its earlier changes (its residual), as int8 values on a scale the copies share:

1. ``c = value - reference + residual`` per row of every piece (weights ``[u, D]``, state ``[u, 1]``);
2. the row's scale is the largest ``|c|`` over the copies (one MAX all-reduce of a float32 per
   row and piece) and its step ``scale / L`` with ``L = 127 // M`` levels, so that the sum of the
   ``M`` copies' values stays within int8;
3. ``q = round(c / step)`` in ``[-L, L]``, summed over the copies by an int8 SUM all-reduce; the
   copy keeps ``c - q * step`` as its new residual;
4. every copy applies the same ``reference + sum(q) * step / M`` (blocking), or the overlapped
   correction of ``rounds.OverlappedRound`` with it, and it becomes the reference.

The copies stay bit-identical after each reduction; rounding never enters the weights, and what it
drops is sent with a later change of the row (a row untouched since keeps its residual until it is
touched again). The scale exchange is waited for at launch: only the int8 transfer overlaps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.replication.rounds import Segment, Workspace

#: The most copies an int8 sum holds with one level either side of zero: ``127 // M >= 1``.
MAX_COPIES = 127


def levels(copies: int) -> int:
    """Levels either side of zero of one copy's int8 values: their sum over ``copies`` fits int8."""
    if not 1 <= copies <= MAX_COPIES:
        raise ValueError(f"sync_dtype='int8' sums {copies} copies; it holds at most {MAX_COPIES} "
                         "(use sync_dtype='bf16', or fewer replica groups)")
    return 127 // copies


def row_steps(scales: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Per row, the value of one level ``scale / L`` and its inverse (0 where the row is all zero)."""
    steps = scales / levels
    inverse = torch.where(steps > 0, 1.0 / steps, torch.zeros_like(steps))
    return steps, inverse


def quantize(change: Tensor, inverse: Tensor, levels: int) -> Tensor:
    """``change`` ``[u, d]`` in levels (float32 holding integers in ``[-L, L]``) of each row's step."""
    return (change * inverse.unsqueeze(1)).round_().clamp_(-levels, levels)


class QuantizedRound:
    """One int8 round over ``group``: blocking, or in flight while training goes on (``overlapped``).

    Every segment sends exactly its touched rows (``Segment.rows``) and carries ``residuals``:
    this copy's residual tensors ``[R, d]``, beside ``references``.
    """

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, workspace: Workspace,
                 overlapped: bool) -> None:
        self.segments, self.copies, self.workspace, self.overlapped = segments, copies, workspace, overlapped
        self.levels = levels(copies)
        self.rows = sum(seg.count for seg in segments)
        numel = sum(seg.size for seg in segments)
        self.launched = workspace.get("launched", numel)  # the copy's values when the round started
        changes = workspace.get("changes", numel)
        self.scales = workspace.get("scales", sum(seg.count * len(seg.tensors) for seg in segments))
        for seg, (tensor, reference, residual), where, rows in self._pieces():
            values = seg.pick(tensor, self.launched[where])
            change = changes[where].view_as(values)
            torch.sub(values, seg.flat_rows(reference, workspace, "reference rows"), out=change)
            change.add_(seg.flat_rows(residual, workspace, "residual rows"))
            torch.amax(change.abs(), dim=1, out=self.scales[rows])
        if self.scales.numel():
            dist.all_reduce(self.scales, op=dist.ReduceOp.MAX, group=group)
        self.steps, inverse = row_steps(self.scales, self.levels)
        self.buffer = workspace.get("wire", numel, torch.int8)
        for seg, (_, _, residual), where, rows in self._pieces():
            change = changes[where].view(seg.count, -1)
            sent = quantize(change, inverse[rows], self.levels)
            self.buffer[where].copy_(sent.view(-1))
            seg.write(residual, change.sub_(sent.mul_(self.steps[rows].unsqueeze(1))))
        self.nbytes = self.buffer.numel() + self.scales.numel() * self.scales.element_size()
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True) if numel else None

    def _pieces(self) -> Iterator[tuple[Segment, tuple[Tensor, Tensor, Tensor], slice, slice]]:
        """Per piece of every segment: ``(segment, (live, reference, residual), where its values
        sit in the flat buffers, where its rows' scales sit)``."""
        start, row = 0, 0
        for seg in self.segments:
            for tensor, reference, residual in zip(seg.tensors, seg.references, seg.residuals, strict=True):
                n = seg.count * tensor.shape[1]
                yield seg, (tensor, reference, residual), slice(start, start + n), slice(row, row + seg.count)
                start, row = start + n, row + seg.count

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the sum, then write the mean (or the correction) and the new references."""
        if self.work is not None:
            self.work.wait()
        for seg, (tensor, reference, _), where, rows in self._pieces():
            new = self.workspace.get("mean", where.stop - where.start).copy_(self.buffer[where])
            new = new.view(seg.count, -1).mul_((self.steps[rows] / self.copies).unsqueeze(1))
            new.add_(seg.flat_rows(reference, self.workspace, "reference rows"))
            seg.write(reference, new)
            if self.overlapped:  # this copy's change since the launch, on the mean, where it changed the row
                now = seg.flat_rows(tensor, self.workspace, "rows")
                now.sub_(self.launched[where].view_as(now)).add_(new)
                changed = seg.changed().index_select(0, seg.rows)
                new = torch.where(changed.unsqueeze(1), now, new, out=now)
            seg.write(tensor, new)
