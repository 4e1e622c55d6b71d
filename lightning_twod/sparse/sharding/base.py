"""What a sharding type decides: how a table is cut into shards, which ids each shard receives,
and how the shards' outputs are put back together for one feature.

Every shard group holds the same shards (the groups are replicas), so a plan names owners by
their position inside a shard group (``0 .. S-1``), not by global rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


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
class Routed:
    """The ids of one feature that go to one shard: ``values`` [n] (shard-local rows), ``lengths`` [B].

    ``mask`` [N] marks which of the feature's N ids they are (None: all of them).
    """

    values: Tensor
    lengths: Tensor
    weights: Tensor | None
    mask: Tensor | None = None


class ShardingScheme(ABC):
    """One sharding type: ``make_shards``, ``route`` (input dist), ``combine_*`` (output dist)."""

    type: ShardingType

    @abstractmethod
    def make_shards(self, table: str, rows: int, dim: int, owners: list[int]) -> list[Shard]:
        """Cut a ``[rows, dim]`` table into shards placed on ``owners`` (positions in the group)."""

    def route(self, shard: Shard, ids: Tensor, lengths: Tensor, weights: Tensor | None) -> Routed:
        """The ids of one feature (``ids`` [N], ``lengths`` [B]) that ``shard`` must look up."""
        return Routed(ids, lengths, weights)

    @abstractmethod
    def combine_pooled(self, pieces: list[Tensor]) -> Tensor:
        """Per-shard pooled outputs ``[B, dim_k]`` (shard order) -> the feature's ``[B, D]``."""

    @abstractmethod
    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        """Per-shard rows ``[n_k, dim_k]`` -> the feature's ``[N, D]`` in the original id order."""


def whole_table(table: str, rows: int, dim: int, owner: int) -> Shard:
    return Shard(table, 0, rows, 0, dim, owner)


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` boundaries: blocks of ``ceil(size / parts)``; may give fewer than ``parts``."""
    block = -(-size // parts)
    return [(start, min(start + block, size)) for start in range(0, size, block)]


def bag_of_ids(lengths: Tensor) -> Tensor:
    """``lengths`` [B] -> the bag (sample) index of every id, [sum(lengths)]."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
