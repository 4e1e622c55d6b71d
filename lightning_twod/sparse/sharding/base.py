"""What a sharding type does at run time: which ids each shard receives, and how the shards'
outputs are put back together for one feature. How a table is cut into shards is
``lightning_twod.core.shards`` (no torch; the planner uses it too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_twod.core.shards import Shard, ShardingType


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
    """One sharding type: ``route`` (input dist); ``pooled_partial_sums`` and ``combine_sequence`` (output dist)."""

    type: ShardingType
    #: Pooled output: each shard's ``[B, dim]`` is a partial sum over its rows, added into the
    #: feature's columns (row-wise). Otherwise each shard's output fills its own columns
    #: ``[col_start, col_end)`` of the feature's ``[B, D]`` (``output_dist.PooledLayout``).
    pooled_partial_sums: bool = False

    def route(self, shard: Shard, ids: Tensor, lengths: Tensor, weights: Tensor | None) -> Routed:
        """The ids of one feature (``ids`` [N], ``lengths`` [B]) that ``shard`` must look up."""
        return Routed(ids, lengths, weights)

    @abstractmethod
    def combine_sequence(self, pieces: list[Tensor], routed: list[Routed], num_ids: int) -> Tensor:
        """Per-shard rows ``[n_k, dim_k]`` -> the feature's ``[N, D]`` in the original id order."""


def bag_of_ids(lengths: Tensor) -> Tensor:
    """``lengths`` [B] -> the bag (sample) index of every id, [sum(lengths)]."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
