"""Table-wise: each table lives whole on one rank of the shard group."""

from __future__ import annotations

from torch import Tensor

from lightning_twod.sparse.sharding.base import Routed, Shard, ShardingScheme, ShardingType, whole_table


class TableWise(ShardingScheme):
    type = ShardingType.TABLE_WISE

    def make_shards(self, table: str, rows: int, dim: int, owners: list[int]) -> list[Shard]:
        return [whole_table(table, rows, dim, owners[0])]

    def combine_pooled(self, pieces: list[Tensor]) -> Tensor:
        return pieces[0]

    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        return pieces[0]
