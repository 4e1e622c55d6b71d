"""Table-wise: each table lives whole on one rank of the shard group."""

from __future__ import annotations

from torch import Tensor

from lightning_twod.core.shards import ShardingType
from lightning_twod.sparse.sharding.base import Routed, ShardingScheme


class TableWise(ShardingScheme):
    type = ShardingType.TABLE_WISE

    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        return pieces[0]
