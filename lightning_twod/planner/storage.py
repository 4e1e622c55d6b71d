"""Bytes one rank holds: its shards, their optimizer state and a training step's buffers, per
collection (``sparse/``'s tensors); the dense part's; what a rank cannot give the model.

``memory`` splits these into the categories it reports. Every constant carries its unit and its
source; numbers marked ASSUMPTION were not measured in this project and are stated in
``docs/planner.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.core.shards import TableSharding
from lightning_twod.planner.inputs import FP32_BYTES, GIB, INDEX_BYTES, TableSpec, Workload
from lightning_twod.planner.slots import owner_slots, returned_elements, unique_shards

#: Bytes per dense parameter held on every rank: fp32 weight, gradient, DDP bucket copy of the
#: gradient, and two Adam moments (torch.optim.Adam keeps exp_avg and exp_avg_sq).
DENSE_BYTES_PER_PARAM = 5 * FP32_BYTES
#: Bytes of every rank's memory not available to the model: CUDA context, NCCL buffers, allocator
#: fragmentation. ASSUMPTION: 3 GiB, typical of a CUDA context plus NCCL's default buffers.
RESERVED_BYTES = 3 * GIB


@dataclass(frozen=True)
class RankStorage:
    """Bytes one rank holds for one collection (peak of a training step)."""

    weights: float  # shard weights, data-parallel copies included
    optimizer: float  # row-wise optimizer state
    received_ids: float  # ids, lengths (and weights) its kernel looks up, from the whole group
    sent_ids: float  # ids, lengths (and weights) it sends to the owners
    lookup_output: float  # its kernel's output: [S * B, D_owned] pooled, or one row per id
    returned: float  # what the output all-to-all brings back: [B, sum of owners' dims]
    output: float  # the collection's output for its B samples: [B, sum of feature dims]

    @property
    def activations(self) -> float:
        """Step buffers: forward values plus their gradients (x2) and both copies of the ids."""
        return (2 * self.received_ids + self.sent_ids
                + 2 * (self.lookup_output + self.returned + self.output))

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.activations

    def __add__(self, other: RankStorage) -> RankStorage:
        return RankStorage(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


ZERO_STORAGE = RankStorage(0, 0, 0, 0, 0, 0, 0)


def predict_storage(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                    workload: Workload) -> list[RankStorage]:
    """Per shard position, the bytes it allocates for one collection (``sparse/``'s tensors)."""
    s, b = group_size, workload.batch_size
    owned, local = owner_slots(specs, plan, s)
    weighted = any(spec.weighted for spec in specs)
    id_bytes = INDEX_BYTES + (FP32_BYTES if weighted else 0)
    local_weights = sum(sl.shard.rows * sl.shard.dim * sl.spec.row_bytes for sl in unique_shards(local))
    local_state = sum(sl.shard.rows * workload.state_per_row(sl.shard.dim, sl.spec.name)
                      for sl in unique_shards(local)) * FP32_BYTES
    local_out = returned_elements(local, b) * FP32_BYTES
    sent = sum(len(slots) * b * INDEX_BYTES + sum(b * sl.spec.pooling_factor * sl.fraction for sl in slots) * id_bytes
               for slots in owned)
    sent += sum(b * sl.spec.pooling_factor for sl in local) * id_bytes
    output = sum(spec.features * (b * spec.dim if spec.pooled else b * spec.pooling_factor * spec.dim)
                 for spec in specs) * FP32_BYTES
    returned = sum(returned_elements(slots, b) for slots in owned) * FP32_BYTES + local_out
    if s == 1 and workload.comm_bytes == FP32_BYTES and specs and specs[0].pooled:
        returned = local_out  # one rank, nothing to send or round: the kernel's output itself goes on
    result = []
    for p in range(s):
        shards = unique_shards(owned[p])
        ids = sum(s * b * sl.spec.pooling_factor * sl.fraction for sl in owned[p])
        result.append(RankStorage(
            weights=sum(sl.shard.rows * sl.shard.dim * sl.spec.row_bytes for sl in shards) + local_weights,
            optimizer=sum(sl.shard.rows * workload.state_per_row(sl.shard.dim, sl.spec.name) for sl in shards) * FP32_BYTES
            + local_state,
            received_ids=len(owned[p]) * s * b * INDEX_BYTES + ids * id_bytes,
            sent_ids=sent,
            lookup_output=returned_elements(owned[p], s * b) * FP32_BYTES + local_out,
            returned=returned,
            output=output,
        ))
    return result


def dense_memory(dense_params: float) -> float:
    """Bytes every rank spends on the dense (DDP) part: weights, gradients, bucket, Adam moments."""
    return dense_params * DENSE_BYTES_PER_PARAM
