"""Where the pieces of a table live: sharding types, shards and their geometry (no torch).

The planner (``planner/``) decides these and the sharded modules (``sparse/``) execute them, so
they sit below both. Every shard group holds the same shards (the groups are replicas), so a
plan names owners by their position inside a shard group (``0 .. S-1``), not by global rank.
How each type routes ids and combines outputs is ``sparse.sharding``'s.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class ShardingType(str, Enum):
    TABLE_WISE = "table_wise"  # the whole table on one rank of each shard group
    ROW_WISE = "row_wise"  # rows cut in torch.chunk blocks, one block per rank of the group
    COLUMN_WISE = "column_wise"  # embedding dim cut into blocks, each block on one rank
    DATA_PARALLEL = "data_parallel"  # the whole table on every rank; no all-to-all


@dataclass(frozen=True)
class Shard:
    """Rows ``[row_start, row_end)`` x columns ``[col_start, col_end)`` of a table, on ``owner``."""

    table: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    owner: int  # position inside the shard group; -1: every rank (data parallel)

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def dim(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class TableSharding:
    """How one table is sharded inside every shard group of its size.

    ``group_size``: the ranks of the table's own shard groups (``S_t``; its replicas ``M_t = W / S_t``),
    None: the plan's ``shard_group_size``. Owners are positions ``0 .. S_t - 1``.
    """

    table: str
    sharding_type: ShardingType
    shards: tuple[Shard, ...]
    group_size: int | None = None

    def size_in(self, default: int) -> int:
        """The table's shard group size in a plan whose ``shard_group_size`` is ``default``
        (data-parallel tables: ``default``; their copies are on every rank anyway)."""
        if self.sharding_type == ShardingType.DATA_PARALLEL or self.group_size is None:
            return default
        return self.group_size


@dataclass(frozen=True)
class Slot:
    """One feature reading one shard: one block of its owner's lookup (kernel input and output)."""

    shard: Shard
    feature: Hashable  # the feature's name (the planner, which knows only how many, numbers them)
    sharding_type: ShardingType


def assign_slots(tables: Iterable[tuple[str, Sequence[Hashable]]], plan: Mapping[str, TableSharding],
                 group_size: int) -> tuple[list[list[Slot]], list[Slot]]:
    """The slots of every owner position ``0 .. S-1``, and the data-parallel slots (on every rank).

    ``tables``: ``(table, the features reading it)`` in the collection's order. An owner's slots come
    in that order, then the table's shard order, then its feature order: the order of its kernel's
    inputs and of the blocks it returns (``sparse.sharded`` runs it, ``planner``'s estimators count it).
    """
    owned: list[list[Slot]] = [[] for _ in range(group_size)]
    local: list[Slot] = []
    for table, features in tables:
        sharding = plan[table]
        for shard in sharding.shards:
            slots = [Slot(shard, feature, sharding.sharding_type) for feature in features]
            if sharding.sharding_type == ShardingType.DATA_PARALLEL:
                local.extend(slots)
            else:
                owned[shard.owner].extend(slots)
    return owned, local


@dataclass(frozen=True)
class TableChoice:
    """What a configuration fixes for one table: its sharding type and its own shard group size
    (None: the planner chooses)."""

    sharding_type: ShardingType | None = None
    group_size: int | None = None


def parse_table_choice(value: object, table: str) -> TableChoice:
    """A ``sharding`` entry: a type (``"row_wise"``) or ``{"type": "row_wise", "shard_group_size": 8}``
    (either key may be left out). Raises ``ValueError`` naming the table and the accepted forms."""
    if isinstance(value, str | ShardingType):
        return TableChoice(parse_sharding_type(value, table))
    if not isinstance(value, Mapping) or not value or set(value) - {"type", "shard_group_size"}:
        raise ValueError(f"table {table!r}: sharding entry {value!r}; use a type ('row_wise') or a mapping "
                         "{type: row_wise, shard_group_size: 8} (either key may be left out)")
    kind = value.get("type")
    size = value.get("shard_group_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ValueError(f"table {table!r}: shard_group_size={size!r}; use a positive int that divides the world size")
    choice = TableChoice(None if kind is None else parse_sharding_type(kind, table), size)
    if choice.sharding_type == ShardingType.DATA_PARALLEL and size not in (None, 1):
        raise ValueError(f"table {table!r}: data_parallel keeps a copy on every rank (group size 1); "
                         f"drop shard_group_size={size} or choose another type")
    return choice


def parse_sharding_type(value: str | ShardingType, table: str) -> ShardingType:
    try:
        return ShardingType(value)
    except ValueError:
        allowed = [t.value for t in ShardingType]
        raise ValueError(f"table {table!r}: unknown sharding {value!r}; use one of {allowed}") from None


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` boundaries: blocks of ``ceil(size / parts)``; may give fewer than ``parts``."""
    block = -(-size // parts)
    return [(start, min(start + block, size)) for start in range(0, size, block)]


def make_shards(kind: ShardingType, table: str, rows: int, dim: int, owners: Sequence[int]) -> list[Shard]:
    """Cut a ``[rows, dim]`` table of sharding ``kind`` into shards placed on ``owners``.

    Table-wise: the whole table on ``owners[0]``. Row-wise: ``torch.chunk`` row blocks (ceil(rows /
    S) each, DTensor's ``Shard(0)``), one per owner. Column-wise: column blocks, one per owner.
    Data-parallel: one whole-table shard with owner -1 (every rank).
    """
    if kind == ShardingType.TABLE_WISE:
        return [Shard(table, 0, rows, 0, dim, owners[0])]
    if kind == ShardingType.ROW_WISE:
        return [Shard(table, lo, hi, 0, dim, owner) for (lo, hi), owner in zip(chunk_bounds(rows, len(owners)), owners)]
    if kind == ShardingType.COLUMN_WISE:
        return [Shard(table, 0, rows, lo, hi, owner) for (lo, hi), owner in zip(chunk_bounds(dim, len(owners)), owners)]
    return [Shard(table, 0, rows, 0, dim, -1)]


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
        shards = tuple(make_shards(kind, name, rows, dim, owners))
        for shard in shards:
            if shard.owner >= 0:
                load[shard.owner] += shard.rows * shard.dim
        plan[name] = TableSharding(name, kind, shards)
    return {name: plan[name] for name, _, _ in tables}
