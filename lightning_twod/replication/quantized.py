"""A round of the cross-group reduction on the int8 wire, with error feedback.

Each copy sends, for every row some copy touched, its change since the last reduction plus what
rounding dropped from its earlier changes (its residual), as int8 levels of a scale the copies
share:

1. ``c = (value - reference) + residual`` per row of every piece (weights ``[u, D]``, state
   ``[u, 1]``);
2. the row's scale is the smallest quarter power of two ``2^(k/4) >= max |c|`` over the copies:
   one int8 MAX all-reduce of the exponents ``k`` (``EMPTY`` for a row no copy touched); its step
   is ``2^(k/4) / L`` with ``L = 127 // M`` levels, so that the sum of the ``M`` copies' levels
   fits int8 (a row's largest change uses between ``0.84 L`` and ``L`` of them);
3. ``q = round(c / step)``, summed over the copies by an int8 SUM all-reduce; the copy keeps
   ``c - q * step`` as its new residual;
4. every copy applies the same ``reference + sum(q) * step / M`` (blocking), or the overlapped
   correction of ``rounds.OverlappedRound`` with it, and it becomes the reference.

The copies stay bit-identical after each reduction; rounding never enters the weights, and what it
drops is sent with a later change of the row (a row no copy touched keeps its residual until one
does). A drain ends with a flush (``sum_residuals``, ``add_residuals``): the copies' mean residual goes into the weights in
fp32 and every residual is zero again, so that nothing a checkpoint leaves out is left over. A shard
nearly all touched is worked on in place, the untouched rows sending zero levels
(``Segment.union``); the others' touched rows are gathered. The exponents are waited for at
launch: only the levels' transfer overlaps. ``emulation.MeshEmulator`` uses the functions below.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.core.reduction import CHUNK
from lightning_twod.replication.rounds import PiecewiseAllReduce, Segment, Workspace, row_chunks

#: The most copies an int8 sum holds with one level either side of zero: ``127 // M >= 1``.
MAX_COPIES = 127
#: The exponent of a row with nothing to send (no copy touched it, or its change is zero).
EMPTY = -128
#: The exponent of a row whose change is NaN or inf on this copy: the largest, so that the MAX
#: all-reduce of the exponents tells every copy, and the round applies nothing (``reducer``).
NONFINITE = 127
#: Exponent steps per power of two: a scale is ``2^(k / STEPS_PER_OCTAVE)``, k in [-127, 127].
STEPS_PER_OCTAVE = 4


def levels(copies: int) -> int:
    """Levels either side of zero of one copy's int8 values: their sum over ``copies`` fits int8."""
    if not 1 <= copies <= MAX_COPIES:
        raise ValueError(f"sync_dtype='int8' sums {copies} copies; it holds at most {MAX_COPIES} "
                         "(use sync_dtype='bf16', or fewer replica groups)")
    return 127 // copies


def change_with_residual(residual: Tensor, values: Tensor, reference: Tensor, scratch: Tensor) -> Tensor:
    """``(values - reference) + residual``, written into ``residual`` ``[u, d]`` and returned (exactly
    the residual where the value is the reference); ``scratch``: a buffer of the same shape."""
    return residual.add_(torch.sub(values, reference, out=scratch))


def exponents(change: Tensor) -> Tensor:
    """Per row of ``change`` ``[u, d]``, the smallest ``k`` with ``2^(k/4) >= max |change|`` (int8
    ``[u]``, in [-127, 126]: changes below 2^-31.75 go to the residual, above 2^31.5 are clipped;
    ``EMPTY`` where zero, ``NONFINITE`` where NaN or inf)."""
    largest = torch.linalg.vector_norm(change, ord=float("inf"), dim=1)
    k = torch.ceil(torch.log2(largest) * STEPS_PER_OCTAVE).clamp_(-127, NONFINITE - 1)
    k = torch.where(largest > 0, k, EMPTY)
    return torch.where(torch.isfinite(largest), k, NONFINITE).to(torch.int8)


def row_steps(exponent: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Per row, the value of one level ``2^(k/4) / L`` and its inverse (0 for ``EMPTY``)."""
    scale = torch.exp2(exponent.float() / STEPS_PER_OCTAVE)
    used = exponent > EMPTY
    return torch.where(used, scale / levels, 0.0), torch.where(used, levels / scale, 0.0)


def quantize(change: Tensor, inverse: Tensor, levels: int, out: Tensor) -> Tensor:
    """``change`` ``[u, d]`` in levels of each row's step: float32 integers in ``[-L, L]``, in ``out``."""
    return torch.mul(change, inverse.unsqueeze(1), out=out).round_().clamp_(-levels, levels)


def keep_residual(change: Tensor, sent: Tensor, steps: Tensor) -> Tensor:
    """What rounding dropped: ``change - sent * step``, in ``change``; ``sent`` is overwritten."""
    return change.sub_(sent.mul_(steps.unsqueeze(1)))


def mean_change(summed: Tensor, steps: Tensor, copies: int) -> Tensor:
    """The copies' mean change from their summed levels (float32 ``[u, d]``, in place)."""
    return summed.mul_((steps / copies).unsqueeze(1))


@torch.no_grad()
def sum_residuals(shards: list[tuple[list[Tensor], list[Tensor], list[Tensor]]], group: ProcessGroup
                  ) -> tuple[list[int], int]:
    """Sum the copies' residuals over ``group``, in place, where some copy holds one; returns the
    indices of the shards summed and the bytes sent. A collective of the copies.

    ``shards``: per shard ``(live, references, residuals)``, each a list of ``[R, d]`` tensors
    (weights ``[R, D]``, state ``[R, 1]``). One int8 MAX all-reduce says which shards some copy holds
    a residual of; those are summed whole. Every copy then holds the same sums, so every copy finds
    the same non-finite ones (``nonfinite_sums``) before ``add_residuals`` applies them.
    """
    held = torch.stack([torch.stack([r.ne(0).any() for r in residuals]).any() for _, _, residuals in shards]
                       ).to(torch.int8) if shards else torch.zeros(0, dtype=torch.int8)
    if held.numel():
        dist.all_reduce(held, op=dist.ReduceOp.MAX, group=group)
    summed = [index for index, some in enumerate(held.tolist()) if some]
    works = [dist.all_reduce(r, group=group, async_op=True) for index in summed for r in shards[index][2]]
    for work in works:
        work.wait()
    return summed, held.numel() + sum(r.numel() * r.element_size() for i in summed for r in shards[i][2])


def nonfinite_sums(shards: list[tuple[list[Tensor], list[Tensor], list[Tensor]]], summed: list[int]) -> list[int]:
    """The indices among ``summed`` whose summed residuals hold NaN or inf (a residual left by a
    round that stopped on non-finite values)."""
    return [index for index in summed if not all(bool(torch.isfinite(r).all()) for r in shards[index][2])]


def add_residuals(shards: list[tuple[list[Tensor], list[Tensor], list[Tensor]]], summed: list[int],
                  copies: int) -> None:
    """Add the mean of the ``summed`` residuals to the live tensors and references, exactly (fp32),
    and zero the residuals: the copies stay identical."""
    for live, references, residuals in (shards[index] for index in summed):
        for tensor, reference, residual in zip(live, references, residuals, strict=True):
            mean = residual.div_(copies)
            tensor.add_(mean)
            reference.add_(mean)
            residual.zero_()


class QuantizedRound:
    """One int8 round over ``group``: blocking, or in flight while training goes on (``overlapped``).

    Every segment carries ``residuals``, this copy's residual tensors ``[R, d]`` beside
    ``references``; a whole shard (``rows`` None) also its ``union`` of touched rows. Each piece is
    worked on in chunks of rows that stay in the cache (``core.reduction.CHUNK``): one pass for the change
    and its exponents, one after the exponents' all-reduce for the levels and the residual, and
    the levels' all-reduce starts piece by piece (``rounds.PiecewiseAllReduce``).
    """

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, workspace: Workspace,
                 overlapped: bool) -> None:
        self.segments, self.copies, self.workspace, self.overlapped = segments, copies, workspace, overlapped
        self.levels = levels(copies)
        self.rows = sum(seg.count for seg in segments)
        numel = sum(seg.size for seg in segments)
        # the copy's values when the round started, for the correction of an overlapped round
        self.launched = workspace.get("launched", numel) if overlapped else None
        self.exponents = workspace.get("exponents", sum(seg.count * len(seg.tensors) for seg in segments), torch.int8)
        # a whole shard's change is worked out in its residual tensor; touched rows' in one buffer
        gathered = workspace.get("changes", sum(seg.size for seg in segments if seg.rows is not None))
        scratch = workspace.get("scratch", CHUNK)
        changes, offset = [], 0
        for seg, (tensor, reference, residual), where, rows in self._pieces():
            exponent = self.exponents[rows]
            snapshot = self.launched[where].view(seg.count, tensor.shape[1]) if overlapped else None
            change = residual if seg.rows is None else gathered[offset:offset + seg.count * tensor.shape[1]].view(
                seg.count, tensor.shape[1])
            for part in row_chunks(*change.shape):
                if seg.rows is None:  # a whole shard, in place
                    now, base = tensor[part], reference[part]
                    if snapshot is not None:
                        now = snapshot[part].copy_(now)
                else:  # touched rows, gathered a chunk at a time (into the snapshot, when there is one)
                    n = (part.stop - part.start) * tensor.shape[1]
                    now = seg.gather(tensor, part, workspace.get("rows chunk", n) if snapshot is None
                                     else snapshot[part].view(-1))
                    seg.gather(residual, part, change[part].view(-1))
                    base = seg.gather(reference, part, workspace.get("reference chunk", n))
                rounded = change_with_residual(change[part], now, base, scratch[:now.numel()].view_as(now))
                exponent[part].copy_(exponents(rounded))
            if seg.union is not None:  # a whole shard: its untouched rows send nothing
                exponent.masked_fill_(~seg.union, EMPTY)
            offset += 0 if seg.rows is None else change.numel()
            changes.append(change)
        if self.exponents.numel():
            dist.all_reduce(self.exponents, op=dist.ReduceOp.MAX, group=group)
        # some copy's change is NaN or inf: read at finish (no host sync here); the levels then sent are
        # never applied
        self.spoiled = (self.exponents == NONFINITE).any()
        self.changes = changes
        self.steps, inverse = row_steps(self.exponents, self.levels)
        self.buffer = workspace.get("wire", numel, torch.int8)
        self.wire = PiecewiseAllReduce(self.buffer, group)
        for (seg, (_, _, residual), where, rows), change in zip(self._pieces(), changes, strict=True):
            sent_flat, steps, inverses = self.buffer[where].view_as(change), self.steps[rows], inverse[rows]
            for part in row_chunks(*change.shape):
                sent = quantize(change[part], inverses[part], self.levels, scratch[:change[part].numel()].view_as(change[part]))
                sent_flat[part].copy_(sent)
                keep_residual(change[part], sent, steps[part])
                self.wire.filled(where.start + part.stop * change.shape[1])
            if seg.rows is not None:  # a whole shard's change is its residual tensor already
                seg.scatter(residual, slice(0, seg.count), change)
        self.wire.filled(numel, last=True)
        self.nbytes = self.buffer.numel() + self.exponents.numel()

    def _pieces(self) -> Iterator[tuple[Segment, tuple[Tensor, Tensor, Tensor], slice, slice]]:
        """Per piece of every segment: ``(segment, (live, reference, residual), where its values
        sit in the flat buffers, where its rows' exponents sit)``."""
        start, row = 0, 0
        for seg in self.segments:
            for tensor, reference, residual in zip(seg.tensors, seg.references, seg.residuals, strict=True):
                n = seg.count * tensor.shape[1]
                yield seg, (tensor, reference, residual), slice(start, start + n), slice(row, row + seg.count)
                start, row = start + n, row + seg.count

    def finite(self) -> bool:
        """Wait for the levels; whether every copy's changes were finite (the same on every copy)."""
        self.wire.wait(self.buffer.numel())
        return not bool(self.spoiled)

    def nonfinite_segments(self) -> list[Segment]:
        """The segments in which this copy's changes held NaN or inf (after ``finite()`` said False;
        ``changes`` then hold the new residuals, non-finite in the same rows)."""
        bad = []
        for (seg, *_), change in zip(self._pieces(), self.changes, strict=True):
            sent = change if seg.union is None else change[seg.union]
            if not any(seg is b for b in bad) and not torch.isfinite(sent).all():
                bad.append(seg)
        return bad

    @torch.no_grad()
    def finish(self) -> None:
        """Apply the sum (after ``finite()``): the mean (or the correction) and the new references."""
        scratch = self.workspace.get("scratch", CHUNK)
        for seg, (tensor, reference, _), where, rows in self._pieces():
            d = tensor.shape[1]
            summed, steps = self.buffer[where].view(seg.count, d), self.steps[rows]
            launched = self.launched[where].view(seg.count, d) if self.overlapped else None
            for part in row_chunks(seg.count, d):
                if seg.rows is None:  # a whole shard, in place
                    now, new = tensor[part], reference[part]
                else:  # touched rows, gathered a chunk at a time and written back
                    n = (part.stop - part.start) * d
                    now = seg.gather(tensor, part, self.workspace.get("rows chunk", n))
                    new = seg.gather(reference, part, self.workspace.get("reference chunk", n))
                self.wire.wait(where.start + part.stop * d)
                mean = mean_change(scratch[:now.numel()].view_as(now).copy_(summed[part]), steps[part], self.copies)
                new.add_(mean)
                if launched is None:
                    now.copy_(new)
                else:  # this copy's change since the launch, on the mean
                    now.sub_(launched[part]).add_(new)
                if seg.rows is not None:
                    seg.scatter(reference, part, new)
                    seg.scatter(tensor, part, now)
