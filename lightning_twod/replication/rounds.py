"""One round of the cross-group reduction over one process group.

Every replicated shard of the group contributes a segment: the rows some copy touched since the
last reduction, or the whole shard when nearly all of them were (``core.reduction.sent_whole``); its weights
``[u, D]`` and optimizer states (``[u, D]``, or ``[u]`` for a row-wise one).

``BlockingRound`` (the round the caller waits for): whole shards are reduced in place, shards that
lie end to end in memory (a kernel's tables do) as one span, with no gather and no index copy;
touched rows are gathered into one buffer. ``OverlappedRound`` (training goes on while it is in
flight) keeps what it sent, so that the result can be applied later as a correction: this copy's
change since the launch on top of the mean (fp32 wire: ``w <- (w - w_launch) + mean``, exactly
the mean where the row did not change meanwhile; bf16 wire: ``w <- w + (mean change - sent
change)``, which reads each row once and leaves each copy its bf16 rounding residual, sent by the
next round that waits).

A round's tensors share one dtype: fp32, or fp16 where the reducer sends an fp16 table's rows in a round
of their own (``wire.rows_dtype``: as they are, on the fp32 wire's path).

The copies of an unchanged row end bit-identical after every round that waits. Rows are worked
on in chunks of about ``CHUNK`` elements (``row_chunks``), every operation of
a chunk following the last while it is in the core's cache, so that each element is read from
memory and written back about once. With the bf16 wire (``wire``) the
rows' changes since the last reduction are sent, and the references move to the new values.
Buffers come from a ``Workspace`` kept from round to round: fresh memory for every round would cost
more in page faults than the arithmetic.

Nothing is applied before ``finite()`` said that every copy sent finite values (``reducer``): the
sum over the copies is NaN or inf wherever one copy's value is, so one reduction over the summed
buffer tells every copy the same. Whole shards on the fp32 wire are summed in place, which would
lose this copy's values, so each copy first adds NaN to the touched rows' buffer (one more element)
if one of its whole shards is not finite, and the whole shards are sent only once the verdict is in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.core.reduction import CHUNK, GROWTH, rows_per_chunk
from lightning_twod.replication import wire
from lightning_twod.sparse.kernels import nonfinite_mark

#: Wire elements in one all-reduce of a round at most (8 MiB of bf16, ``PiecewiseAllReduce``).
PIECE = 2**22



class Workspace:
    """Named buffers that grow (by ``GROWTH``) to the largest size asked for and are reused."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.buffers = device, {}

    def get(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        old = self.buffers.get(name)
        if old is None or old.numel() < numel or old.dtype != dtype:
            grow = old is not None and old.dtype == dtype
            self.buffers.pop(name, None)
            old = None  # the last reference: the old buffer is freed before the larger one is made
            size = int(numel * GROWTH) if grow else numel
            self.buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
        return self.buffers[name][:numel]


@dataclass
class Segment:
    """One shard's part of a round.

    ``tensors``: the copy's live ``[R, d]`` tensors (weights ``[R, D]``; each state ``[R, D]``, a row-wise one
    as ``[R, 1]``); ``references``: the same as after the last reduction (bf16 and int8 wires), or
    None; ``rows``: the rows sent ``[u]`` (None: the whole shard); ``residuals``: what the int8
    wire's rounding dropped from this copy's changes, shaped as ``tensors`` (``quantized.py``), or None;
    ``union``: ``[R]`` bool, the rows some copy touched, for a whole shard on the int8 wire.
    ``name``: what errors call the shard. ``owed``: records that the rows sent differ between the
    copies by what an overlapped bf16 round left of each copy's change (the next round that waits
    sends them), or None.
    """

    tensors: list[Tensor]
    references: list[Tensor] | None
    rows: Tensor | None
    residuals: list[Tensor] | None = None
    union: Tensor | None = None
    name: str = "a shard"  # what errors call it: the table, the shard's rows and columns
    owed: Callable[[Tensor | None], None] | None = None

    @property
    def count(self) -> int:
        return self.tensors[0].shape[0] if self.rows is None else self.rows.numel()

    @property
    def size(self) -> int:
        return self.count * sum(t.shape[1] for t in self.tensors)

    def gather(self, tensor: Tensor, part: slice, out: Tensor) -> Tensor:
        """Rows ``part`` of the touched rows of ``tensor`` ``[R, d]``, written into ``out`` (flat, at
        least ``m d`` elements) and returned ``[m, d]``."""
        m, d = part.stop - part.start, tensor.shape[1]
        return torch.index_select(tensor, 0, self.rows[part], out=out[:m * d].view(m, d))

    def scatter(self, target: Tensor, part: slice, values: Tensor) -> None:
        """Write ``values`` ``[m, d]`` to rows ``part`` of the touched rows of ``target``."""
        target.index_copy_(0, self.rows[part], values)

    def owe(self) -> None:
        """Record the rows sent as owed to the next round that waits (``owed``)."""
        if self.owed is not None:
            self.owed(self.rows)

    def pieces(self) -> Iterator[tuple[Tensor, Tensor | None, slice]]:
        """``(live tensor, its reference, where its values sit in the segment's flat buffer)``."""
        start = 0
        references = self.references or [None] * len(self.tensors)
        for tensor, reference in zip(self.tensors, references, strict=True):
            n = self.count * tensor.shape[1]
            yield tensor, reference, slice(start, start + n)
            start += n


def _adjacent(before: Tensor, after: Tensor) -> bool:
    return (before.is_contiguous() and after.is_contiguous() and before.dtype == after.dtype
            and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
            and before.data_ptr() + before.numel() * before.element_size() == after.data_ptr())


def flat_spans(columns: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Merge tensors that lie end to end in one storage into 1-D views.

    ``columns``: parallel lists of tensors (live, and optionally reference); entry ``i`` of every
    column is merged with entry ``i - 1`` only when it follows it in every column. Returns the
    merged spans as parallel lists of 1-D views.
    """
    starts = [i for i in range(len(columns[0]))
              if i == 0 or not all(_adjacent(col[i - 1], col[i]) for col in columns)]
    spans: list[list[Tensor]] = [[] for _ in columns]
    for begin, end in zip(starts, [*starts[1:], len(columns[0])]):
        for span, col in zip(spans, columns, strict=True):
            numel = sum(t.numel() for t in col[begin:end])
            span.append(torch.as_strided(col[begin], (numel,), (1,), col[begin].storage_offset()))
    return spans


def _chunks(numel: int, size: int = CHUNK) -> Iterator[slice]:
    for start in range(0, numel, size):
        yield slice(start, min(start + size, numel))


def row_chunks(rows: int, dim: int) -> Iterator[slice]:
    """Rows of a ``[rows, dim]`` piece, ``CHUNK`` elements at a time (at least one row)."""
    step = rows_per_chunk(dim)
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def segment_chunks(segments: Sequence[Segment], start: int = 0
                   ) -> Iterator[tuple[Segment, Tensor, Tensor | None, slice, slice]]:
    """``(segment, live tensor, its reference, part, where the part sits in the flat buffer)`` for every
    chunk of every piece of ``segments``, laid out one after the other from ``start``; ``part`` is a
    range of the segment's rows (the shard's rows when it is sent whole, else its touched rows)."""
    for seg in segments:
        for tensor, ref, where in seg.pieces():
            d = tensor.shape[1]
            for part in row_chunks(seg.count, d):
                yield seg, tensor, ref, part, slice(start + where.start + part.start * d,
                                                    start + where.start + part.stop * d)
        start += seg.size


def all_finite(values: Tensor) -> bool:
    """Whether every element of the 1-D ``values`` is finite (a host sync)."""
    return not values.numel() or bool(torch.isfinite(nonfinite_mark(values)))


def nonfinite(segments: Sequence[Segment], kept: Tensor | None = None, sent_changes: bool = False) -> list[Segment]:
    """The segments whose values this copy sent held NaN or inf: its rows less the references, if any
    (``kept``: what an overlapped round kept of what it sent, laid out as its buffer: the rows, or
    with ``sent_changes`` their changes; else the live tensors). For the error of a failed round
    only: it reads the rows again."""
    bad, start = [], 0
    for seg in segments:
        for tensor, reference, where in seg.pieces():
            rows = slice(None) if seg.rows is None else seg.rows
            values = tensor[rows] if kept is None else kept[start + where.start:start + where.stop]
            if reference is not None and not sent_changes:
                values = values.reshape(-1) - reference[rows].reshape(-1)
            if not all_finite(values.reshape(-1)):
                bad.append(seg)
                break
        start += seg.size
    return bad


def mean_(summed: Tensor, copies: int) -> Tensor:
    """``summed / copies`` in place: a multiply by ``1 / copies`` where that is exact (a power of two
    copies: both round the same real number), a quarter of a division's cost on CPU."""
    return summed.mul_(1.0 / copies) if copies & (copies - 1) == 0 else summed.div_(copies)


def settle(summed: Tensor, copies: int, scratch: Tensor, out: Tensor, reference: Tensor | None = None,
           launched: Tensor | None = None) -> None:
    """Write a round's result into ``out``, chunk by chunk; every argument is 1-D, as long as ``out``.

    ``mean = summed / copies`` is the rows' mean (fp32 wire) or, with ``reference``, their mean
    change, and ``reference`` moves to ``new = reference + mean``. ``out <- new``; or, given this
    copy's values at the launch (an overlapped round), ``out <- (out - launched) + new``.
    ``scratch``: an fp32 buffer of at least ``CHUNK`` elements.
    """
    for part in _chunks(out.numel()):
        new = mean_(scratch[:part.stop - part.start].copy_(summed[part]), copies)
        if reference is not None:
            new = reference[part].add_(new)
        if launched is None:
            out[part].copy_(new)
        else:
            out[part].sub_(launched[part]).add_(new)


class PiecewiseAllReduce:
    """The all-reduce of a flat buffer, started piece by piece as the caller fills it and waited for
    piece by piece as the caller applies it: the next piece is prepared, and the last one applied,
    while others are on the wire. Every copy fills the buffer in the same order, so every copy
    starts the same pieces."""

    def __init__(self, buffer: Tensor, group: ProcessGroup) -> None:
        self.buffer, self.group = buffer, group
        self.started = self.summed = 0
        self.works: list[tuple[int, object]] = []  # (end, its work) in the order started

    def filled(self, end: int, last: bool = False) -> None:
        """``buffer[:end]`` is ready: start it once it makes a ``PIECE``, or it is the ``last``."""
        if end - self.started >= PIECE or (last and end > self.started):
            work = dist.all_reduce(self.buffer[self.started:end], group=self.group, async_op=True)
            self.works.append((end, work))
            self.started = end

    def wait(self, end: int) -> None:
        """Return once ``buffer[:end]`` holds the sum over the group."""
        while self.summed < end:
            self.summed, work = self.works.pop(0)
            work.wait()


def _all_reduce(tensor: Tensor, group: ProcessGroup):
    return dist.all_reduce(tensor, group=group, async_op=True) if tensor.numel() else None


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


class BlockingRound:
    """A round finished before training goes on: whole shards reduced in place, touched rows
    gathered into the wire buffer and applied a chunk of rows at a time."""

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, sync_dtype: str,
                 workspace: Workspace) -> None:
        self.copies, self.sync_dtype, self.workspace = copies, sync_dtype, workspace
        self.rows = sum(seg.count for seg in segments)
        self.sparse = [seg for seg in segments if seg.rows is not None]
        dense = [seg for seg in segments if seg.rows is None]
        self.bf16 = wire.needs_reference(sync_dtype)
        columns = [(seg, c) for c in range(max((len(seg.tensors) for seg in dense), default=0))
                   for seg in dense if c < len(seg.tensors)]  # all weights, then all states (by position)
        live = [seg.tensors[c].reshape(-1) for seg, c in columns]
        refs = [seg.references[c].reshape(-1) for seg, c in columns] if self.bf16 else []
        self.spans = flat_spans([live, refs] if self.bf16 else [live]) if live else [[], []]
        dense_numel = sum(span.numel() for span in self.spans[0])
        sparse_numel = sum(seg.size for seg in self.sparse)
        self.group, self.segments = group, segments
        if not self.bf16:  # touched rows gathered into one buffer; whole shards in place, once found finite
            verdict = 1 if self.spans[0] else 0  # NaN: one of this copy's whole shards is not finite
            self.buffer = workspace.get("rows", sparse_numel + verdict, _dtype(segments, sync_dtype))
            for seg, flat in zip(self.sparse, self.buffer[:sparse_numel].split([seg.size for seg in self.sparse])):
                for tensor, _, where in seg.pieces():
                    seg.gather(tensor, slice(0, seg.count), flat[where])
            if verdict:
                self.buffer[sparse_numel:].copy_(torch.stack([nonfinite_mark(span) for span in self.spans[0]]).sum())
        else:  # the changes, whole shards first, rounded into one buffer
            self.buffer = workspace.get("wire", dense_numel + sparse_numel, wire.WIRE_DTYPES[sync_dtype])
            self.wire = PiecewiseAllReduce(self.buffer, group)
            start, scratch = 0, workspace.get("scratch", CHUNK)
            for span, ref in zip(*self.spans, strict=True):
                for part in _chunks(span.numel()):  # fp32 first: a mixed-type out is several times slower
                    n = part.stop - part.start
                    changes = torch.sub(span[part], ref[part], out=scratch[:n])
                    self.buffer[start + part.start:start + part.stop].copy_(changes)
                    self.wire.filled(start + part.stop)
                start += span.numel()
            for seg, tensor, ref, part, flat in segment_chunks(self.sparse, start):
                n = flat.stop - flat.start
                changes = seg.gather(tensor, part, workspace.get("rows chunk", n))
                changes.sub_(seg.gather(ref, part, workspace.get("reference chunk", n)))
                self.buffer[flat].copy_(changes.view(-1))
                self.wire.filled(flat.stop)
            self.wire.filled(self.buffer.numel(), last=True)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        if not self.bf16:
            self.nbytes += dense_numel * self.buffer.element_size()
            self.works = [_all_reduce(self.buffer, group)]

    def finite(self) -> bool:
        """Wait for the buffer's sum; whether every copy sent finite values (the same on every copy)."""
        if self.bf16:
            self.wire.wait(self.buffer.numel())
        else:
            _wait(self.works)
        return all_finite(self.buffer)

    def nonfinite_segments(self) -> list[Segment]:
        """The segments in which this copy sent NaN or inf (after ``finite()`` said False)."""
        return nonfinite(self.segments)

    @torch.no_grad()
    def finish(self) -> None:
        """Apply the round (after ``finite()``): whole shards on the fp32 wire are summed now."""
        if not self.bf16:
            _wait([_all_reduce(span, self.group) for span in self.spans[0]])
            for span in self.spans[0]:
                mean_(span, self.copies)
            for seg, tensor, _, part, flat in segment_chunks(self.sparse):
                seg.scatter(tensor, part, mean_(self.buffer[flat].view(-1, tensor.shape[1]), self.copies))
            return
        start, scratch = 0, self.workspace.get("scratch", CHUNK)
        for span, ref in zip(*self.spans, strict=True):
            for piece in _chunks(span.numel(), PIECE):  # as the pieces arrive
                self.wire.wait(start + piece.stop)
                summed = self.buffer[start + piece.start:start + piece.stop]
                settle(summed, self.copies, scratch, span[piece], reference=ref[piece])
            start += span.numel()
        for seg, tensor, ref, part, flat in segment_chunks(self.sparse, start):
            new = seg.gather(ref, part, self.workspace.get("reference chunk", flat.stop - flat.start))
            self.wire.wait(flat.stop)
            new.view(-1).add_(mean_(scratch[:new.numel()].copy_(self.buffer[flat]), self.copies))
            seg.scatter(ref, part, new)
            seg.scatter(tensor, part, new)


class OverlappedRound:
    """A round in flight while training goes on; ``finish`` applies it as a correction.

    fp32 wire: ``kept`` is a snapshot of what was sent, and ``finish`` writes ``(w - w_launch) + mean``:
    exactly the mean where the row did not change since the launch. bf16 wire: ``kept`` holds this
    copy's changes as it sent them (half the snapshot's bytes), and ``finish`` adds ``mean change -
    sent change`` to the rows and ``mean change`` to the references (in place, or one ``index_add_``
    each for touched rows): each row keeps its change since the launch and what rounding kept of its
    change off the wire, which a later round sends. The copies of a row then differ by those
    residuals until the next round that waits (a drain) sends them (``Segment.owe``).
    """

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, sync_dtype: str,
                 workspace: Workspace) -> None:
        self.segments, self.copies, self.workspace = segments, copies, workspace
        self.rows = sum(seg.count for seg in segments)
        numel = sum(seg.size for seg in segments)
        dtype = _dtype(segments, sync_dtype)
        self.bf16 = wire.needs_reference(sync_dtype)
        self.kept = workspace.get("kept", numel, dtype)
        self.buffer = workspace.get("wire", numel, dtype)
        self.wire = PiecewiseAllReduce(self.buffer, group)
        scratch = workspace.get("scratch", CHUNK)
        rows = segments[0].tensors[0].dtype if segments else torch.float32
        for seg, tensor, ref, part, flat in segment_chunks(self.segments):
            live = _rows(seg, tensor, part, workspace.get("rows chunk", flat.stop - flat.start, rows)).view(-1)
            if self.bf16:  # fp32 first: a mixed-type out is several times slower
                reference = _rows(seg, ref, part, workspace.get("reference chunk", live.numel())).view(-1)
                live = torch.sub(live, reference, out=scratch[:live.numel()])
            self.buffer[flat].copy_(live)
            self.kept[flat].copy_(self.buffer[flat])  # the same wire values: a copy, not a second rounding
            self.wire.filled(flat.stop)
        self.wire.filled(numel, last=True)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()

    def finite(self) -> bool:
        """Wait for the whole sum; whether every copy sent finite values (the same on every copy)."""
        self.wire.wait(self.buffer.numel())
        return all_finite(self.buffer)

    def nonfinite_segments(self) -> list[Segment]:
        """The segments in which this copy sent NaN or inf (after ``finite()`` said False)."""
        return nonfinite(self.segments, self.kept, sent_changes=self.bf16)

    @torch.no_grad()
    def finish(self) -> None:
        """Apply the sum (after ``finite()``): the mean (or the correction) and the new references."""
        scratch, ws = self.workspace.get("scratch", CHUNK), self.workspace
        for seg, tensor, ref, part, flat in segment_chunks(self.segments):
            d, n = tensor.shape[1], flat.stop - flat.start
            if not self.bf16:
                now = _rows(seg, tensor, part, ws.get("rows chunk", n, tensor.dtype))
                settle(self.buffer[flat], self.copies, scratch, now.view(-1), launched=self.kept[flat])
                if seg.rows is not None:
                    seg.scatter(tensor, part, now)
                continue
            change = mean_(scratch[:n].copy_(self.buffer[flat]), self.copies)
            sent = ws.get("sent chunk", n).copy_(self.kept[flat])
            correction = torch.sub(change, sent, out=sent)
            if seg.rows is None:
                tensor[part].view(-1).add_(correction)
                ref[part].view(-1).add_(change)
            else:
                rows = seg.rows[part]
                tensor.index_add_(0, rows, correction.view(-1, d))
                ref.index_add_(0, rows, change.view(-1, d))
        if self.bf16:
            for seg in self.segments:
                seg.owe()


def _dtype(segments: Sequence[Segment], sync_dtype: str) -> torch.dtype:
    """The wire's dtype for ``segments``, whose tensors share one dtype (``wire.rows_dtype``)."""
    return wire.rows_dtype(sync_dtype, segments[0].tensors[0].dtype if segments else torch.float32)


def _rows(seg: Segment, tensor: Tensor, part: slice, out: Tensor) -> Tensor:
    """Rows ``part`` of the segment's rows of ``tensor`` ``[R, d]``, as ``[m, d]``: a view of a shard sent
    whole, else gathered into ``out``."""
    return tensor[part] if seg.rows is None else seg.gather(tensor, part, out)
