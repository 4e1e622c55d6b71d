"""Row-wise: rows are cut in ``torch.chunk`` blocks (ceil(rows / S) each, matching DTensor's
``Shard(0)``), one block per rank of the shard group.

Each id goes to the owner of its block, re-based to the block's first row. Pooled: every owner
returns a partial sum ``[B, D]`` over the ids it owns, and the partial sums are added. Unpooled:
each id's row comes back from its owner and is put back in its original position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_twod.core.shards import Shard, ShardingType
from lightning_twod.sparse.sharding.base import Routed, ShardingScheme, bag_of_ids


class RowWise(ShardingScheme):
    type = ShardingType.ROW_WISE
    pooled_partial_sums = True

    def route(self, shard: Shard, ids: Tensor, lengths: Tensor, weights: Tensor | None) -> Routed:
        mask = (ids >= shard.row_start) & (ids < shard.row_end)
        counts = torch.bincount(bag_of_ids(lengths)[mask], minlength=lengths.numel())
        return Routed(ids[mask] - shard.row_start, counts, None if weights is None else weights[mask], mask)

    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        out = pieces[0].new_zeros(num_ids, pieces[0].shape[1])
        for piece, route in zip(pieces, routed, strict=True):
            out = out.index_put((route.mask.nonzero().squeeze(1),), piece)
        return out
