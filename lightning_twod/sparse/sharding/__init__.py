"""Sharding types and the default placement of tables inside a shard group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.sparse.sharding.base import Shard, ShardingScheme, ShardingType
from lightning_twod.sparse.sharding.column_wise import ColumnWise
from lightning_twod.sparse.sharding.data_parallel import DataParallel
from lightning_twod.sparse.sharding.row_wise import RowWise
from lightning_twod.sparse.sharding.table_wise import TableWise

SCHEMES: dict[ShardingType, ShardingScheme] = {
    scheme.type: scheme for scheme in (TableWise(), RowWise(), ColumnWise(), DataParallel())
}


@dataclass(frozen=True)
class TableSharding:
    """How one table is sharded inside every shard group."""

    table: str
    sharding_type: ShardingType
    shards: tuple[Shard, ...]

    @property
    def scheme(self) -> ShardingScheme:
        return SCHEMES[self.sharding_type]


def parse_sharding_type(value: str | ShardingType, table: str) -> ShardingType:
    try:
        return ShardingType(value)
    except ValueError:
        allowed = [t.value for t in ShardingType]
        raise ValueError(f"table {table!r}: unknown sharding {value!r}; use one of {allowed}") from None


def place_tables(
    tables: Sequence[tuple[str, int, int]],
    group_size: int,
    constraints: Mapping[str, str | ShardingType] | None = None,
) -> dict[str, TableSharding]:
    """Greedy size-balanced placement: ``tables`` are ``(name, rows, dim)``.

    Tables are table-wise unless ``constraints`` says otherwise; the largest tables are placed
    first, each shard on the rank holding the fewest parameters so far (ties: lowest rank).
    Row-wise uses every rank; column-wise cuts the dim into ``min(group_size, dim)`` blocks.
    """
    constraints = dict(constraints or {})
    unknown = sorted(set(constraints) - {name for name, _, _ in tables})
    if unknown:
        raise ValueError(f"sharding constraints name unknown tables {unknown}; tables: {[t[0] for t in tables]}")
    load = [0] * group_size
    plan: dict[str, TableSharding] = {}
    for name, rows, dim in sorted(tables, key=lambda t: (-t[1] * t[2], t[0])):
        kind = parse_sharding_type(constraints.get(name, ShardingType.TABLE_WISE), name)
        if kind == ShardingType.ROW_WISE:
            owners = list(range(group_size))
        else:
            count = min(group_size, dim) if kind == ShardingType.COLUMN_WISE else 1
            owners = sorted(range(group_size), key=lambda r: (load[r], r))[:count]
            owners.sort()
        shards = tuple(SCHEMES[kind].make_shards(name, rows, dim, owners))
        for shard in shards:
            if shard.owner >= 0:
                load[shard.owner] += shard.rows * shard.dim
        plan[name] = TableSharding(name, kind, shards)
    return {name: plan[name] for name, _, _ in tables}


__all__ = ["SCHEMES", "Shard", "ShardingScheme", "ShardingType", "TableSharding", "place_tables"]
