"""Which rows of a kernel's shards a copy touched since the last reduction: one bit per row.

A row mask has the size of the shards, whatever the number of steps or lookups since the last
reduction (a list of looked-up ids would grow with both and need a ``unique`` to read). Recording
is one scatter per lookup, with no host synchronization.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_twod.sparse.kernels import LookupKernel


class TouchedRows:
    """Row mask over a kernel's shards, laid end to end (shard 0's rows first).

    Registered as a lookup observer of ``kernel``: every training lookup marks the rows it reads.
    """

    def __init__(self, kernel: LookupKernel) -> None:
        rows = [shape.rows for shape in kernel.shapes]
        self.shard_rows = rows
        device = kernel.device()
        starts = torch.tensor([0, *rows[:-1]], dtype=torch.int64, device=device).cumsum(0)
        self._slot_starts = starts[torch.tensor(kernel.slot_shards, dtype=torch.int64, device=device)]
        self._num_slots = len(kernel.slot_shards)
        self.mask = torch.zeros(sum(rows), dtype=torch.bool, device=device)
        self.owed = torch.zeros_like(self.mask)  # rows the next round that waits must send (``owe``)
        kernel.lookup_observers.append(self)

    def __call__(self, values: Tensor, lengths: Tensor) -> None:
        """Mark the rows of one slot-major lookup: ``values`` [N] shard-local rows, ``lengths`` [F * B]."""
        if values.numel() == 0:
            return
        per_slot = lengths.view(self._num_slots, -1).sum(dim=1)
        offsets = torch.repeat_interleave(self._slot_starts, per_slot, output_size=values.numel())
        self.mask[values + offsets] = True

    def owe(self, k: int, rows: Tensor | None) -> None:
        """Rows ``rows`` ``[u]`` of shard ``k`` (None: all of them) differ between the copies by what an
        overlapped bf16 round left of each copy's change: the next ``take(settle=True)`` returns them."""
        start = sum(self.shard_rows[:k])
        owed = self.owed[start:start + self.shard_rows[k]]
        if rows is None:
            owed.fill_(True)
        else:
            owed[rows] = True

    def take(self, settle: bool = False) -> Tensor:
        """The mask ``[sum of rows]`` since the last call, with the owed rows if ``settle`` (a round that
        waits, which leaves every copy identical); recording starts afresh."""
        mask, self.mask = self.mask, torch.zeros_like(self.mask)
        if settle:
            mask |= self.owed
            self.owed.zero_()
        return mask
