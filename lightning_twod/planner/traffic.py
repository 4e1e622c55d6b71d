"""Bytes each rank sends in one training step, by ``distributed.comm.ByteCounter`` name.

Arithmetic on table shapes, lookup statistics and a sharding plan; the counts mirror the engine
exactly (``sparse/input_dist.py``, ``sparse/output_dist.py``, ``replication/``):

* ``input_dist``: a header of 4 int64 per peer; then, to each owner, the bag lengths (B int64 per
  slot, a slot being one feature reading one shard) and the routed ids (int64); then, when the
  batch carries per-id weights, one float32 per routed id;
* ``output_dist`` / ``output_dist_grad``: pooled rows ``[B_peer, D_owner]`` (or one row per id) going
  home, and their gradients coming back (``comm_bytes`` per element: 4 for fp32, 2 with a bf16
  ``comm_dtype``); the rows of unpooled fp16 tables go home as fp16 (2 bytes) when the batch carries
  no per-id weights (``sparse.output_dist.sequence_wire_dtype``), their gradients at ``comm_bytes``;
* ``replica_sync`` / ``replica_grad_sync``: the cross-group reduction, counted by ``reduction``.

Bytes a rank sends to itself are not counted, as in the engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.core.shards import TableSharding
from lightning_twod.planner.inputs import FP32_BYTES, INDEX_BYTES, TableSpec, Workload
from lightning_twod.planner.reduction import reduction_bytes
from lightning_twod.planner.slots import owner_slots, returned_elements, unique_shards

HEADER_INT64S = 4  # input_dist header per peer: (batch size, number of ids, has weights, rejected)


@dataclass(frozen=True)
class AllToAllVolumes:
    """Bytes one shard position sends and receives in each all-to-all of one step."""

    input_sent: float
    input_received: float
    output_sent: float  # pooled rows (or rows per id) going home, at ``comm_bytes`` an element
    output_received: float  # the backward all-to-all sends and receives the same bytes swapped


def peer_volumes(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                 workload: Workload, forward: bool = False) -> tuple[list[float], list[float]]:
    """Per shard position ``o``: the input-dist bytes every peer sends to ``o`` (header included),
    and the output-dist bytes ``o`` returns to each peer, in one step: at ``comm_bytes`` an element
    (the gradients' width), or with ``forward`` the forward's (2 for unpooled fp16 tables' rows of an
    unweighted batch)."""
    b = workload.batch_size
    owned, _ = owner_slots(specs, plan, group_size)
    weighted = any(spec.weighted for spec in specs)
    to_owner = [HEADER_INT64S * INDEX_BYTES + len(slots) * b * INDEX_BYTES
                + sum(b * sl.spec.pooling_factor * sl.fraction for sl in slots)
                * (INDEX_BYTES + (FP32_BYTES if weighted else 0))
                for slots in owned]

    def width(spec: TableSpec) -> int:
        return spec.row_bytes if forward and spec.half and not spec.pooled and not weighted else workload.comm_bytes

    back = [sum(returned_elements([sl], b) * width(sl.spec) for sl in slots) for slots in owned]
    return to_owner, back


def all_to_all_volumes(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                       workload: Workload) -> list[AllToAllVolumes]:
    """Per shard position, the bytes of the input and output all-to-alls of one step."""
    s = group_size
    to_owner, back = peer_volumes(specs, plan, group_size, workload)
    total_to, total_back = sum(to_owner), sum(back)
    return [AllToAllVolumes(total_to - to_owner[p], (s - 1) * to_owner[p], (s - 1) * back[p], total_back - back[p])
            for p in range(s)]


def predict_traffic(
    specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int, num_replicas: int,
    workload: Workload, steps: int = 1, training: bool = True,
) -> list[dict[str, float]]:
    """Bytes each shard position sends to other ranks in ``steps`` steps, by ``ByteCounter`` name.

    Every shard group is the same, so position ``p`` stands for every rank with that shard rank.
    ``training`` adds the backward all-to-all and the replica reduction.
    """
    s, m, b = group_size, num_replicas, workload.batch_size
    owned, local = owner_slots(specs, plan, s)
    syncs = steps // workload.sync_interval if workload.sync_mode == "weights" else steps
    name = "replica_sync" if workload.sync_mode == "weights" else "replica_grad_sync"
    local_sync = reduction_bytes(unique_shards(local), b, s * m * b, s * m, workload)
    result = []
    _, forward = peer_volumes(specs, plan, s, workload, forward=True)
    for p, volumes in enumerate(all_to_all_volumes(specs, plan, s, workload)):
        traffic = {"input_dist": steps * volumes.input_sent, "output_dist": steps * (s - 1) * forward[p]}
        if training:
            traffic["output_dist_grad"] = steps * volumes.output_received
            per_sync = reduction_bytes(unique_shards(owned[p]), s * b, s * m * b, m, workload) + local_sync
            traffic[name] = syncs * per_sync
        result.append(traffic)
    return result
