"""One row update per optimizer step for a kernel whose optimizer runs inside its backward (FBGEMM's TBE).

The step's update must come from the gradient summed over every lookup and every backward of the
step. A fused backward applies its own gradient at once, which is right only when it is the one
backward of the step through the kernel. So each training lookup's output goes behind a gate
(``behind_gate``): at the backward, ``UpdateGate.fuse_or_hold`` lets the TBE's own backward run
(fused) when the step has one lookup, nothing held and no accumulation going on; otherwise it turns
the output's gradient into row gradients, coalesced per shard at once, and holds them for the
kernel's ``step()``, which applies them with the reference update of ``sparse.optimizers`` (equal to
the fused one within float rounding). A backward that would be held after a fused one of the same
step raises ``UpdateOnceError``: the first update cannot be taken back.

The gate also marks, without a host sync, whether the gradients a shard received are finite
(``marks``, with ``check_gradients``), and lists the rows whose gradients wait for the step
(``pending_rows``), which a reduction in the middle of the step must not forget.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_twod.sparse.optimizers import coalesce_rows


class UpdateOnceError(RuntimeError):
    """A second backward through fused kernels in one optimizer step, after the first one had
    already updated the rows: the step cannot apply one update from the summed gradient."""


class LookupPart:
    """What one TBE call of a training lookup read, to turn its output's gradient into row gradients.

    ``slots``: the kernel's slot indices of the call, in its order; ``values`` [N] the ids, slot-major;
    ``lengths`` [F * B] the bag lengths of its F slots; ``weights`` [N] | None per-id weights the TBE
    applied itself (pooled). The ids are checked unchanged when they are read, at the backward.
    """

    def __init__(self, slots: Sequence[int], values: Tensor, lengths: Tensor, weights: Tensor | None) -> None:
        self.slots = list(slots)
        self.tensors = (values, lengths, weights)
        self.versions = [t._version if t is not None else None for t in self.tensors]

    def per_slot(self) -> list[tuple[Tensor, Tensor, Tensor | None]]:
        """``(ids [n_f], lengths [B], weights [n_f] | None)`` per slot (a host sync for the counts)."""
        if [t._version if t is not None else None for t in self.tensors] != self.versions:
            raise RuntimeError("the ids of an embedding lookup were modified in place between the lookup and its "
                               "backward; clone the batch before editing it")
        values, lengths, weights = self.tensors
        per_slot = lengths.view(len(self.slots), -1)
        counts = per_slot.sum(dim=1).tolist()
        wts = torch.split(weights, counts) if weights is not None else [None] * len(counts)
        return list(zip(torch.split(values, counts), per_slot, wts, strict=True))


class UpdateGate:
    """The once-per-step bookkeeping of one kernel with ``num_shards`` shards and slots ``slot_shards``
    (the shard each slot reads) of widths ``slot_dims``; ``pooled``: outputs ``[B, sum of its slots'
    dims]`` per call, else ``[n, dim]`` rows.

    ``accumulating``: set while gradients are accumulated over several backwards (Lightning's
    ``block_backward_sync``, Fabric's ``no_backward_sync``); ``defer``: never fuse (manual
    optimization); ``check_gradients``: keep ``marks`` of the fused backwards too.
    """

    def __init__(self, pooled: bool, slot_shards: Sequence[int], slot_dims: Sequence[int], num_shards: int,
                 device: torch.device, check_gradients: bool = False) -> None:
        self.pooled, self.slot_shards, self.slot_dims = pooled, list(slot_shards), list(slot_dims)
        self.accumulating = self.defer = False
        self.check_gradients = check_gradients
        self._slot_shard = torch.tensor(self.slot_shards, dtype=torch.int64, device=device)
        self._marks = torch.zeros(num_shards, device=device)
        self.reset()

    def reset(self) -> None:
        """Forget the step: lookups, the fused flag, held gradients and marks (after ``step()``, a load, or
        a step that raised)."""
        self.lookups = 0  # training lookups since the last step
        self.fused = False  # a backward of this step let the TBE update its rows
        self.held: dict[int, list[tuple[Tensor, Tensor]]] = {}  # shard -> coalesced (rows [u], grads [u, dim])
        self._marks.zero_()

    def fuse_or_hold(self, part: LookupPart, grad: Tensor, again: bool) -> bool:
        """At a backward through ``part``, whose output got ``grad``: True to let the TBE update its rows now,
        or False after holding the rows' gradients for ``step()``. ``again``: this output's backward ran
        before (``retain_graph``)."""
        if not (self.accumulating or self.defer or self.held or self.lookups > 1 or again):
            self.fused = True
            if self.check_gradients:
                self._mark(part, grad.detach())
            return True
        if self.fused:
            raise UpdateOnceError(
                "a second backward through the embedding tables before the optimizer step, after the "
                "first one had updated their rows (FBGEMM updates rows inside backward): accumulate "
                "gradients with Trainer(accumulate_grad_batches=N) or under fabric.no_backward_sync(model) "
                "(then every backward of the step is summed first), call optimizer.step() after each "
                "backward (the kernel's step() where a loop drives the sharded collection itself), or set "
                "kernel_backend='torch'"
            )
        by_shard: dict[int, list[tuple[Tensor, Tensor]]] = {}
        for ids, grads, k in self._row_gradients(part, grad.detach()):
            by_shard.setdefault(k, []).append((ids, grads))
        for k, pieces in by_shard.items():  # coalesced now: the ids are copied, the memory is per row
            rows, grads = coalesce_rows(torch.cat([r for r, _ in pieces]), torch.cat([g for _, g in pieces]))
            self.held.setdefault(k, []).append((rows, grads))
        return False

    def _row_gradients(self, part: LookupPart, grad: Tensor) -> list[tuple[Tensor, Tensor, int]]:
        """``(ids [n], grads [n, dim], shard)`` per slot of ``part``: the gradient of each id it read."""
        slots = part.per_slot()
        if not self.pooled:
            pieces = torch.split(grad, [len(ids) for ids, _, _ in slots])
            return [(ids, g, self.slot_shards[f]) for (ids, _, _), g, f in zip(slots, pieces, part.slots, strict=True)]
        out, column = [], 0
        for (ids, lens, wts), f in zip(slots, part.slots, strict=True):
            dim = self.slot_dims[f]
            bags = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
            rows = grad[bags, column:column + dim]
            out.append((ids, rows if wts is None else rows * wts.unsqueeze(1).to(rows.dtype), self.slot_shards[f]))
            column += dim
        return out

    def _mark(self, part: LookupPart, grad: Tensor) -> None:
        """Add NaN to a shard's mark where ``grad`` sends it a non-finite value: one pass, no host sync."""
        slots = torch.tensor(part.slots, dtype=torch.int64, device=grad.device)
        if self.pooled:  # [B, sum dims]: columns by slot
            sums = grad.sum(dim=0, dtype=torch.float32)
            dims = torch.tensor([self.slot_dims[f] for f in part.slots], device=grad.device)
            owner = torch.repeat_interleave(slots, dims, output_size=sums.numel())
        else:  # [n, dim]: rows by slot
            sums = grad.sum(dim=1, dtype=torch.float32)
            counts = part.tensors[1].view(len(part.slots), -1).sum(dim=1)
            owner = torch.repeat_interleave(slots, counts, output_size=sums.numel())
        self._marks.index_add_(0, self._slot_shard[owner], sums.mul(0))

    def marks(self) -> Tensor:
        """``[num_shards]`` fp32: NaN where a gradient held, or fused with ``check_gradients``, was not finite."""
        marks = self._marks.clone()
        for k, pieces in self.held.items():
            for _, grads in pieces:
                marks[k] += grads.sum(dtype=torch.float32).mul(0)
        return marks

    def pending_rows(self) -> dict[int, Tensor]:
        """Shard -> the rows ``[u]`` whose held gradients wait for the step."""
        return {k: torch.cat([rows for rows, _ in pieces]) for k, pieces in self.held.items()}

    def summed(self) -> dict[int, tuple[Tensor, Tensor]]:
        """Shard -> ``(rows [u], grads [u, dim])``: the held gradients summed per row (kept held)."""
        return {k: coalesce_rows(torch.cat([r for r, _ in pieces]), torch.cat([g for _, g in pieces]))
                if len(pieces) > 1 else pieces[0] for k, pieces in self.held.items()}

    def take(self) -> dict[int, tuple[Tensor, Tensor]]:
        """``summed()``, and the step starts afresh."""
        held = self.summed()
        self.reset()
        return held


class _Gate(torch.autograd.Function):
    """A TBE output (``[B, sum dims]`` pooled, ``[n, dim]`` rows) as an autograd node whose backward asks
    the gate whether the TBE's own backward runs now (from here: the fused update) or the gradient is
    held. Its only input is an empty token, so autograd reaches the TBE through this node alone."""

    @staticmethod
    def forward(ctx, token: Tensor, gate: UpdateGate, part: LookupPart, source: list[Tensor]):
        ctx.gate, ctx.part, ctx.source = gate, part, source
        return source[0].detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        again, ctx.ran = getattr(ctx, "ran", False), True
        if ctx.gate.fuse_or_hold(ctx.part, grad, again):
            torch.autograd.backward(ctx.source[0], grad, retain_graph=True)
        return None, None, None, None


def behind_gate(out: Tensor, gate: UpdateGate, part: LookupPart) -> Tensor:
    """``out`` (a TBE output of ``part``) behind a ``_Gate`` node."""
    token = torch.empty(0, device=out.device, requires_grad=True)
    return _Gate.apply(token, gate, part, [out])
