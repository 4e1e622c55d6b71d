"""One round of the cross-group reduction over one process group.

Every replicated shard of the group contributes a segment: the rows some copy touched since the
last reduction, or the whole shard when nearly all of them were (``DENSE_SHARE``); its weights
``[u, D]`` and row-wise state ``[u]``.

``BlockingRound`` (the round the caller waits for): whole shards are reduced in place, shards that
lie end to end in memory (a kernel's tables do) as one span, with no gather and no index copy;
touched rows are gathered into one buffer. ``OverlappedRound`` (training goes on while it is in
flight): one snapshot of everything sent, so that the result can be applied later as
``w <- w + (mean - w_launch)`` where a row changed meanwhile, and as the mean itself elsewhere.

Either way the copies of an unchanged row end bit-identical. With the bf16 wire (``wire``) the
rows' changes since the last reduction are sent, and the references move to the new values.
Buffers come from a ``Workspace`` kept from round to round: fresh memory for every round would cost
more in page faults than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.replication import wire

#: A shard whose touched rows are at least this share of its rows is sent whole, reduced in place
#: (no gather, no index copy). Below it the touched rows are gathered: on the slow links where 2D
#: pays, bytes decide, and sending a whole shard of which 56 % is touched (the Criteo-like
#: workload at interval 8) costs 1.8x the bytes for the copies it saves (results/scaling.md).
DENSE_SHARE = 0.9
#: Elements a whole-shard span is converted in at a time (bf16 wire): 16 MiB of fp32 scratch.
CHUNK = 4 * 2**20


class Workspace:
    """Named buffers that grow to the largest size asked for and are reused."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.buffers = device, {}

    def get(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self.buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buffer[:numel]


@dataclass
class Segment:
    """One shard's part of a round.

    ``tensors``: the copy's live ``[R, d]`` tensors (weights ``[R, D]``; row-wise state as
    ``[R, 1]``); ``references``: the same as after the last reduction (bf16 and int8 wires), or
    None; ``rows``: the rows sent ``[u]`` (None: the whole shard); ``changed()``: ``[R]`` bool, the
    rows that changed since the round was launched; ``residuals``: what the int8 wire's rounding
    dropped from this copy's changes, shaped as ``tensors`` (``quantized.py``), or None;
    ``union``: ``[R]`` bool, the rows some copy touched, for a whole shard on the int8 wire.
    """

    tensors: list[Tensor]
    references: list[Tensor] | None
    rows: Tensor | None
    changed: Callable[[], Tensor]
    residuals: list[Tensor] | None = None
    union: Tensor | None = None

    @property
    def count(self) -> int:
        return self.tensors[0].shape[0] if self.rows is None else self.rows.numel()

    @property
    def size(self) -> int:
        return self.count * sum(t.shape[1] for t in self.tensors)

    def pick(self, tensor: Tensor, out: Tensor) -> Tensor:
        """``tensor``'s rows sent by this segment, written into ``out`` (flat) and returned ``[u, d]``."""
        view = out.view(self.count, tensor.shape[1])
        if self.rows is None:
            return view.copy_(tensor)
        return torch.index_select(tensor, 0, self.rows, out=view)

    def write(self, target: Tensor, values: Tensor) -> None:
        if self.rows is None:
            target.copy_(values)
        else:
            target.index_copy_(0, self.rows, values)

    def pieces(self) -> Iterator[tuple[Tensor, Tensor | None, slice]]:
        """``(live tensor, its reference, where its values sit in the segment's flat buffer)``."""
        start = 0
        references = self.references or [None] * len(self.tensors)
        for tensor, reference in zip(self.tensors, references, strict=True):
            n = self.count * tensor.shape[1]
            yield tensor, reference, slice(start, start + n)
            start += n

    def flat_rows(self, tensor: Tensor, scratch: Workspace, name: str) -> Tensor:
        """``tensor``'s rows of this segment as ``[u, d]``: the tensor itself for a whole shard (in
        place), else gathered into the scratch buffer ``name``."""
        if self.rows is None:
            return tensor
        return self.pick(tensor, scratch.get(name, self.count * tensor.shape[1]))


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


def _chunks(numel: int) -> Iterator[slice]:
    for start in range(0, numel, CHUNK):
        yield slice(start, min(start + CHUNK, numel))


def _all_reduce(tensor: Tensor, group: ProcessGroup):
    return dist.all_reduce(tensor, group=group, async_op=True) if tensor.numel() else None


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


class BlockingRound:
    """A round finished before training goes on: whole shards reduced in place."""

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, sync_dtype: str,
                 workspace: Workspace) -> None:
        self.copies, self.sync_dtype, self.workspace = copies, sync_dtype, workspace
        self.rows = sum(seg.count for seg in segments)
        self.sparse = [seg for seg in segments if seg.rows is not None]
        dense = [seg for seg in segments if seg.rows is None]
        self.bf16 = wire.needs_reference(sync_dtype)
        columns = range(len(dense[0].tensors)) if dense else range(0)
        live = [seg.tensors[c].reshape(-1) for c in columns for seg in dense]  # all weights, then all states
        refs = [seg.references[c].reshape(-1) for c in columns for seg in dense] if self.bf16 else []
        self.spans = flat_spans([live, refs] if self.bf16 else [live]) if live else [[], []]
        dense_numel = sum(span.numel() for span in self.spans[0])
        sparse_numel = sum(seg.size for seg in self.sparse)
        self.works = []
        if not self.bf16:  # whole shards in place; touched rows gathered into one buffer
            self.works = [_all_reduce(span, group) for span in self.spans[0]]
            self.buffer = workspace.get("rows", sparse_numel)
            for seg, flat in zip(self.sparse, self.buffer.split([seg.size for seg in self.sparse])):
                for tensor, _, where in seg.pieces():
                    seg.pick(tensor, flat[where])
        else:  # the changes, whole shards first, rounded into one buffer
            self.buffer = workspace.get("wire", dense_numel + sparse_numel, wire.WIRE_DTYPES[sync_dtype])
            start = 0
            scratch = workspace.get("scratch", CHUNK)
            for span, ref in zip(*self.spans, strict=True):
                for part in _chunks(span.numel()):
                    n = part.stop - part.start
                    torch.sub(span[part], ref[part], out=scratch[:n])
                    self.buffer[start + part.start:start + part.stop].copy_(scratch[:n])
                start += span.numel()
            for seg in self.sparse:
                flat = self.buffer[start:start + seg.size]
                live = workspace.get("rows", seg.size)
                for tensor, ref, where in seg.pieces():
                    seg.pick(tensor, live[where]).sub_(seg.flat_rows(ref, workspace, "reference rows"))
                flat.copy_(live)
                start += seg.size
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        if not self.bf16:
            self.nbytes += dense_numel * 4
        self.works.append(_all_reduce(self.buffer, group))

    @torch.no_grad()
    def finish(self) -> None:
        _wait(self.works)
        if not self.bf16:
            for span in self.spans[0]:
                span.div_(self.copies)
            self.buffer.div_(self.copies)
            for seg, flat in zip(self.sparse, self.buffer.split([seg.size for seg in self.sparse])):
                for tensor, _, where in seg.pieces():
                    seg.write(tensor, flat[where].view(seg.count, tensor.shape[1]))
            return
        start, scratch = 0, self.workspace.get("scratch", CHUNK)
        for span, ref in zip(*self.spans, strict=True):
            for part in _chunks(span.numel()):
                n = part.stop - part.start
                scratch[:n].copy_(self.buffer[start + part.start:start + part.stop]).div_(self.copies)
                ref[part].add_(scratch[:n])
                span[part].copy_(ref[part])
            start += span.numel()
        for seg in self.sparse:
            new = self.workspace.get("rows", seg.size).copy_(self.buffer[start:start + seg.size]).div_(self.copies)
            for tensor, ref, where in seg.pieces():
                rows = new[where].view(seg.count, tensor.shape[1])
                rows.add_(seg.flat_rows(ref, self.workspace, "reference rows"))
                seg.write(ref, rows)
                seg.write(tensor, rows)
            start += seg.size


class OverlappedRound:
    """A round in flight while training goes on; ``finish`` applies it as a correction.

    ``launched`` keeps what was sent (fp32); the wire buffer holds the rows, or their bf16 changes.
    Whole shards are read and corrected in place; only touched rows pass through scratch buffers.
    """

    def __init__(self, segments: list[Segment], group: ProcessGroup, copies: int, sync_dtype: str,
                 workspace: Workspace) -> None:
        self.segments, self.copies, self.workspace = segments, copies, workspace
        self.rows = sum(seg.count for seg in segments)
        numel = sum(seg.size for seg in segments)
        self.launched = workspace.get("launched", numel)
        self.buffer = workspace.get("wire", numel, wire.WIRE_DTYPES[sync_dtype])
        self.bf16 = wire.needs_reference(sync_dtype)
        for seg, launched, sent in self._flats():
            for tensor, ref, where in seg.pieces():
                values = seg.pick(tensor, launched[where]).reshape(-1)
                if self.bf16:
                    change = workspace.get("change", values.numel())
                    torch.sub(values, seg.flat_rows(ref, workspace, "reference rows").reshape(-1), out=change)
                    sent[where].copy_(change)
                else:
                    sent[where].copy_(values)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.work = _all_reduce(self.buffer, group)

    def _flats(self) -> Iterator[tuple[Segment, Tensor, Tensor]]:
        """Per segment, its slices of the snapshot and of the wire buffer."""
        sizes = [seg.size for seg in self.segments]
        return zip(self.segments, self.launched.split(sizes), self.buffer.split(sizes))

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the sum, then write the mean (or the correction) and the new references."""
        _wait([self.work])
        for seg, launched, summed in self._flats():
            changed = seg.changed() if seg.rows is None else seg.changed().index_select(0, seg.rows)
            for tensor, ref, where in seg.pieces():
                shape = (seg.count, tensor.shape[1])
                new = self.workspace.get("mean", where.stop - where.start).copy_(summed[where]).div_(self.copies)
                new = new.view(shape)
                if ref is not None:
                    new.add_(seg.flat_rows(ref, self.workspace, "reference rows"))
                    seg.write(ref, new)
                now = seg.flat_rows(tensor, self.workspace, "rows")
                now.sub_(launched[where].view(shape)).add_(new)  # this copy's change since the launch, on the mean
                torch.where(changed.unsqueeze(1), now, new, out=now)
                if seg.rows is not None:
                    seg.write(tensor, now)
