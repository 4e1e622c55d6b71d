"""Bytes of the cross-group reduction that keeps the copies of a replicated shard equal
(``replication/``), by ``distributed.comm.ByteCounter`` name:

* ``replica_sync`` (``sync_mode="weights"``): per round, the row mask of the replicated shards (one
  bit a row), then their touched rows and optimizer state (a whole shard when nearly all its rows
  are touched), ``sync_bytes`` per element (4 fp32, 2 bf16, 1 int8; the int8 wire adds an int8
  exponent per sent row of the weights and of the state on the wire), the states that stay exact
  (``Workload.exact_state_per_row``) 4 bytes whatever the wire, after a second row mask, and the rows of
  fp16 tables (``TableSpec.half``) 2 bytes whatever the wire, after a row mask of their own; every
  all-reduce counted as a ring, ``2 (M - 1) / M`` of the buffer;
* ``replica_grad_sync`` (``sync_mode="gradients"``): the ids of the touched rows (int64, gathered
  over the replica group), then an all-reduce of their gradients, counted as a ring.

The rules it models (which rows are sent, when a shard goes whole, the chunks) are
``core.reduction``'s, which ``replication/`` runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.core.reduction import CHUNK, rows_per_chunk, sent_whole
from lightning_twod.core.shards import TableSharding
from lightning_twod.planner.inputs import FP32_BYTES, INDEX_BYTES, ROW_BYTES, TableSpec, Workload
from lightning_twod.planner.slots import Slot, owner_slots, unique_shards

HALF_BYTES = ROW_BYTES["fp16"]


@dataclass(frozen=True)
class ReductionRound:
    """What one rank moves in one round of the weights reduction (``replication/``).

    ``gathered``: elements of touched rows (weights and row-wise state) gathered into the buffer;
    ``whole``: elements of shards sent whole (``core.reduction.sent_whole``), reduced in place;
    ``mask_bytes``: the packed row mask (one bit a row of every shard); ``rows``: rows of the shards;
    ``largest_chunk``: elements of the largest chunk of touched rows a round gathers at a time
    (``CHUNK`` elements of a piece, at least one row; the rounds' scratch buffers are sized by it);
    ``scales``: the int8 wire's scales, an int8 exponent per sent row of the weights and of the state;
    ``largest_whole_chunk``: the same for the shards sent whole, which an overlapped round also passes
    through its scratch buffers a chunk of rows at a time; ``exact``: of the elements, those sent in fp32
    whatever the wire (the Adam family's second moment and step count, in a round of their own with its
    own row mask, counted in ``mask_bytes``); ``half``: of the elements, the rows of fp16 tables, sent as
    they are (2 bytes) whatever the wire, in a round of their own with its own row mask; ``half_gathered``:
    of those, the ones gathered.
    """

    gathered: float = 0.0
    whole: float = 0.0
    mask_bytes: float = 0.0
    rows: float = 0.0
    largest_chunk: float = 0.0
    scales: float = 0.0
    largest_whole_chunk: float = 0.0
    exact: float = 0.0
    half: float = 0.0
    half_gathered: float = 0.0

    @property
    def elements(self) -> float:
        return self.gathered + self.whole

    def payload_bytes(self, workload: Workload) -> float:
        """Bytes of the round's buffers (mask, payload, scales) before the ring's ``2 (M - 1) / M``."""
        wired = self.elements - self.exact - self.half
        return (self.mask_bytes + wired * workload.sync_bytes + self.exact * FP32_BYTES + self.half * HALF_BYTES
                + self.scales)

    def __add__(self, other: ReductionRound) -> ReductionRound:
        return ReductionRound(self.gathered + other.gathered, self.whole + other.whole,
                              self.mask_bytes + other.mask_bytes, self.rows + other.rows,
                              max(self.largest_chunk, other.largest_chunk), self.scales + other.scales,
                              max(self.largest_whole_chunk, other.largest_whole_chunk), self.exact + other.exact,
                              self.half + other.half, self.half_gathered + other.half_gathered)


def reduction_round(shards: Sequence[Slot], world_samples: float, workload: Workload) -> ReductionRound:
    """One round over ``shards`` after ``workload.sync_interval`` steps of ``world_samples`` samples
    (the rows touched on any copy are sent; a shard nearly all touched is sent whole)."""
    if not shards:
        return ReductionRound()
    gathered = whole = chunk = whole_chunk = scales = exact = half = half_gathered = 0.0
    main = False  # a round of fp32 rows or of states (an fp16 table trained by SGD has neither)
    quantized = workload.sync_dtype == "int8"
    for sl in shards:
        spec, lo, hi = sl.spec, sl.shard.row_start, sl.shard.row_end
        union = spec.expected_unique(lo, hi, world_samples * workload.sync_interval * spec.ids_per_sample)
        state = workload.state_per_row(sl.shard.dim, spec.name)
        exact_state = workload.exact_state_per_row(sl.shard.dim, spec.name)
        width = sl.shard.dim + state
        sent = sl.shard.rows if sent_whole(union, sl.shard.rows) else union
        if workload.sync_dtype != "fp32":
            exact += sent * exact_state
        if quantized:  # an exponent a row of each piece on the wire: fp32 weights, and a state if any
            scales += sent * ((not spec.half) + (state > exact_state))
        main |= not spec.half or state > 0
        if spec.half:
            half += sent * sl.shard.dim
            half_gathered += 0.0 if sent == sl.shard.rows else sent * sl.shard.dim
        # the widest piece of the round (an fp16 table's rows go in their own: its states, element-wise or one a row)
        piece = sl.shard.dim if not spec.half or state > exact_state + 1 else 1
        largest = max(min(sent, rows_per_chunk(piece)) * piece, min(sent, CHUNK))
        if sent == sl.shard.rows:
            whole += sent * width
            whole_chunk = max(whole_chunk, largest)
        else:
            gathered += sent * width
            chunk = max(chunk, largest)
    rows = sum(sl.shard.rows for sl in shards)
    masks = main + bool(exact) + bool(half)  # the exact states' round and the fp16 rows' agree on their rows too
    return ReductionRound(gathered, whole, masks * math.ceil(rows / 8), rows, chunk, scales, whole_chunk, exact,
                          half, half_gathered)


def reduction_rounds(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                     num_replicas: int, workload: Workload) -> tuple[list[ReductionRound], ReductionRound]:
    """Per shard position, its round over the replica group; and the data-parallel tables' round
    over the whole world (the same on every rank)."""
    s, m, b = group_size, num_replicas, workload.batch_size
    owned, local = owner_slots(specs, plan, s)
    world = s * m * b
    return ([reduction_round(unique_shards(slots), world, workload) for slots in owned],
            reduction_round(unique_shards(local), world, workload))


def reduction_bytes(shards: Sequence[Slot], local_samples: float, world_samples: float, group: int,
                     workload: Workload) -> float:
    """Bytes one rank sends in one reduction of ``shards`` over ``group`` copies (``replication/``)."""
    if group <= 1 or not shards:
        return 0.0
    if workload.sync_mode == "gradients":
        local_rows = elements = 0.0
        for sl in shards:
            spec, lo, hi = sl.spec, sl.shard.row_start, sl.shard.row_end
            local_rows += spec.expected_unique(lo, hi, local_samples * spec.ids_per_sample)
            elements += spec.expected_unique(lo, hi, world_samples * spec.ids_per_sample) * sl.shard.dim
        gather = (group - 1) * (len(shards) + local_rows) * INDEX_BYTES
        return gather + (group - 1) * 2 * elements * FP32_BYTES / group
    round_ = reduction_round(shards, world_samples, workload)
    return (group - 1) * 2 * round_.payload_bytes(workload) / group
