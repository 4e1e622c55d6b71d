"""Seconds a shard costs the rank that owns it in one step, and each rank's sum: what the
partitioner balances (``partition``).

Times use a ``links.LinkModel`` (measured, read from a file, or a preset of ``hardware.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_twod.core.shards import ShardingType, TableSharding
from lightning_twod.planner.inputs import FP32_BYTES, INDEX_BYTES, TableSpec, Workload

if TYPE_CHECKING:
    from lightning_twod.planner.links import LinkModel


@dataclass(frozen=True)
class GroupLinks:
    """Seconds per byte and per call of a shard group's all-to-all, from one rank's view."""

    seconds_per_byte: float
    latency: float

    @classmethod
    def for_group(cls, links: LinkModel, group_size: int, local_peers: int) -> GroupLinks:
        """``local_peers``: members of the group on the same node (itself included)."""
        if group_size <= 1:
            return cls(0.0, 0.0)
        remote = group_size - local_peers
        share_local = (local_peers - 1) / (group_size - 1)
        share_remote = remote / (group_size - 1)
        per_byte = max(share_local / links.all_to_all_intra.bandwidth,
                       share_remote / links.all_to_all_inter.bandwidth if remote else 0.0)
        latency = links.all_to_all_intra.latency
        if remote:
            latency = max(latency, remote * links.all_to_all_inter.latency)
        return cls(per_byte, latency)


@dataclass(frozen=True)
class ShardCost:
    """Time and memory one shard costs its owner in one step."""

    lookup: float  # s: forward gather + backward fused update
    comm: float  # s: receiving its ids + returning its rows (forward) + receiving their gradients
    memory: float  # bytes: weights, optimizer state and the step buffers it adds to its owner

    @property
    def time(self) -> float:
        return self.lookup + self.comm


def lookup_bytes(spec: TableSpec, rows: tuple[int, int], dim: int, samples: float, workload: Workload) -> float:
    """Bytes of embedding rows a lookup of ``samples`` samples moves over one shard, forward and
    fused backward: gather the rows, write the pooled output; read its gradient, read and write
    the rows and their row-wise state."""
    lo, hi = rows
    ids = samples * spec.ids_per_sample * spec.access_fraction(lo, hi)
    rows_out = samples * spec.features if spec.pooled else ids
    return (ids * dim * 3 + rows_out * dim * 2 + ids * workload.state_per_row(dim, spec.name) * 2) * FP32_BYTES


def shard_cost(spec: TableSpec, rows: tuple[int, int], dim: int, group_size: int, workload: Workload,
               links: LinkModel, group_links: GroupLinks, weighted: bool = False) -> ShardCost:
    """Cost of one shard (rows ``[lo, hi)`` x ``dim`` columns of ``spec``) to the rank owning it."""
    s, b = group_size, workload.batch_size
    lo, hi = rows
    bags = s * b * spec.features
    ids = s * b * spec.ids_per_sample * spec.access_fraction(lo, hi)
    state = workload.state_per_row(dim, spec.name)
    rows_out = bags if spec.pooled else ids
    lookup = lookup_bytes(spec, rows, dim, s * b, workload) / links.lookup_bandwidth
    remote = (s - 1) / s if s > 1 else 0.0
    in_bytes = (bags + ids) * INDEX_BYTES + (ids * FP32_BYTES if weighted else 0.0)
    out_bytes = 2 * rows_out * dim * workload.comm_bytes
    comm = (in_bytes + out_bytes) * remote * group_links.seconds_per_byte
    id_bytes = INDEX_BYTES + (FP32_BYTES if weighted else 0)
    memory = ((hi - lo) * (dim + state) * FP32_BYTES
              + 2 * (bags * INDEX_BYTES + ids * id_bytes) + 2 * rows_out * dim * FP32_BYTES)
    return ShardCost(lookup, comm, memory)


@dataclass(frozen=True)
class RankLoad:
    """Predicted seconds one rank spends on its shards in one step."""

    lookup: float = 0.0
    comm: float = 0.0

    @property
    def total(self) -> float:
        return self.lookup + self.comm

    def __add__(self, other: RankLoad) -> RankLoad:
        return RankLoad(self.lookup + other.lookup, self.comm + other.comm)


def predict_load(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                 workload: Workload, links: LinkModel, group_links: GroupLinks) -> list[RankLoad]:
    """Per shard position, the predicted lookup and communication seconds of one step."""
    by_name = {spec.name: spec for spec in specs}
    weighted = any(spec.weighted for spec in specs)
    loads = [RankLoad()] * group_size
    for name, sharding in plan.items():
        spec = by_name[name]
        for shard in sharding.shards:
            if sharding.sharding_type == ShardingType.DATA_PARALLEL:
                cost = shard_cost(spec, (shard.row_start, shard.row_end), shard.dim, 1, workload, links,
                                  GroupLinks(0.0, 0.0), weighted)
                owners = range(group_size)
            else:
                cost = shard_cost(spec, (shard.row_start, shard.row_end), shard.dim, group_size, workload,
                                  links, group_links, weighted)
                owners = [shard.owner]
            for owner in owners:
                loads[owner] = loads[owner] + RankLoad(cost.lookup, cost.comm)
    return loads
