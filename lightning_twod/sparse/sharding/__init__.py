"""How each sharding type routes ids and combines outputs at run time (``SCHEMES``).

The types, shards and their placement are ``lightning_twod.core.shards`` (shared with the planner).
"""

from __future__ import annotations

from lightning_twod.core.shards import ShardingType, TableSharding
from lightning_twod.sparse.sharding.base import ShardingScheme
from lightning_twod.sparse.sharding.column_wise import ColumnWise
from lightning_twod.sparse.sharding.data_parallel import DataParallel
from lightning_twod.sparse.sharding.row_wise import RowWise
from lightning_twod.sparse.sharding.table_wise import TableWise

SCHEMES: dict[ShardingType, ShardingScheme] = {
    scheme.type: scheme for scheme in (TableWise(), RowWise(), ColumnWise(), DataParallel())
}


def scheme_of(sharding: TableSharding) -> ShardingScheme:
    """The run-time behaviour of a table's sharding type."""
    return SCHEMES[sharding.sharding_type]


__all__ = ["SCHEMES", "ShardingScheme", "scheme_of"]
