"""Column-wise: the embedding dimension is cut into blocks, each looked up on its own rank.

Every block's owner receives all ids of the table's features and returns ``[B, dim_k]``; the
blocks are concatenated in column order. Row-wise AdaGrad then keeps one accumulator per row of
each block (the mean of g**2 over the block's columns), as TorchRec does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_twod.core.shards import ShardingType
from lightning_twod.sparse.sharding.base import Routed, ShardingScheme


class ColumnWise(ShardingScheme):
    type = ShardingType.COLUMN_WISE

    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        return torch.cat(pieces, dim=1)
