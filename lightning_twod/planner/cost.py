"""Cost model of one training step: what a rank stores, what it sends, and how long that takes.

Everything here is arithmetic on table shapes, lookup statistics and a sharding plan; nothing
needs a process group or a module, so every estimate is unit-testable. The byte counts mirror the
engine exactly (``sparse/input_dist.py``, ``sparse/output_dist.py``, ``replication/``), using the
names of ``distributed.comm.ByteCounter``:

* ``input_dist``: a header of 4 int64 per peer; then, to each owner, the bag lengths (B int64 per
  slot, a slot being one feature reading one shard) and the routed ids (int64); then, when the
  batch carries per-id weights, one float32 per routed id;
* ``output_dist`` / ``output_dist_grad``: pooled rows ``[B_peer, D_owner]`` going home, and their
  gradients coming back (``comm_bytes`` per element: 4 for fp32, 2 with a bf16 ``comm_dtype``);
* ``replica_sync`` (``sync_mode="weights"``): per round, the row mask of the replicated shards (one
  bit a row), then their touched rows and row-wise state (a whole shard when nearly all its rows
  are touched), ``sync_bytes`` per element (4 fp32, 2 bf16, 1 int8; the int8 wire adds an int8
  exponent per sent row of the weights and of the state); every all-reduce counted as a ring,
  ``2 (M - 1) / M`` of the buffer;
* ``replica_grad_sync`` (``sync_mode="gradients"``): the ids of the touched rows (int64, gathered
  over the replica group), then an all-reduce of their gradients, counted as a ring.

Bytes a rank sends to itself are not counted, as in the engine. Row access is modelled as
``id = floor(rows * u ** id_skew)`` with ``u ~ U(0, 1)`` (the synthetic data's generator):
``id_skew = 1`` is uniform access (hashed ids), larger is a power law concentrated on low ids.

Times use a ``links.LinkModel`` (measured, read from a file, or a preset of ``hardware.py``).
Every constant carries its unit and its source; numbers marked ASSUMPTION were not measured in
this project and are stated in ``docs/planner.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_twod.core.reduction import CHUNK, rows_per_chunk, sent_whole
from lightning_twod.core.shards import Shard, ShardingType, TableSharding, assign_slots

if TYPE_CHECKING:
    from lightning_twod.planner.links import LinkModel

# ----------------------------------------------------------------------------------- sizes
FP32_BYTES = 4  # bytes: weights, optimizer state, pooled outputs, per-id weights (torch.float32)
INDEX_BYTES = 8  # bytes: ids and bag lengths travel as int64 (sparse/input_dist.py)
HEADER_INT64S = 4  # input_dist header per peer: (batch size, number of ids, has weights, rejected)
GIB = float(1 << 30)  # bytes
#: Bytes per element of the weights reduction's payload, by ``sync_dtype`` (``replication/wire.py``).
SYNC_BYTES = {"fp32": FP32_BYTES, "bf16": 2, "int8": 1}

# --------------------------------------------------------------------- dense part
#: FLOPs per sample per dense parameter for forward + backward (2 forward, 4 backward): the usual
#: 6 N rule for dense layers (Kaplan et al. 2020, "Scaling Laws for Neural Language Models").
DENSE_FLOPS_PER_PARAM = 6.0
#: Bytes per dense parameter held on every rank: fp32 weight, gradient, DDP bucket copy of the
#: gradient, and two Adam moments (torch.optim.Adam keeps exp_avg and exp_avg_sq).
DENSE_BYTES_PER_PARAM = 5 * FP32_BYTES
#: Bytes of every rank's memory not available to the model: CUDA context, NCCL buffers, allocator
#: fragmentation. ASSUMPTION: 3 GiB, typical of a CUDA context plus NCCL's default buffers.
RESERVED_BYTES = 3 * GIB


# ------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class TableSpec:
    """One table as the planner sees it: its shape and how it is looked up."""

    name: str
    rows: int
    dim: int
    features: int = 1  # features reading this table (a shared table has several)
    pooling_factor: float = 1.0  # mean ids per sample, per feature
    pooled: bool = True  # EmbeddingBagCollection (True) or EmbeddingCollection (False)
    weighted: bool = False  # the batch carries per-id weights
    id_skew: float = 1.0  # popularity: id = floor(rows * u ** id_skew); 1 = uniform
    hashed: bool = False  # popular rows scattered over the table (hashed ids), not the lowest ids

    def __post_init__(self) -> None:
        if self.rows < 1 or self.dim < 1 or self.features < 1:
            raise ValueError(f"table {self.name!r}: rows, dim and features must be >= 1, got "
                             f"{self.rows}, {self.dim}, {self.features}")
        if self.pooling_factor < 0 or self.id_skew <= 0:
            raise ValueError(f"table {self.name!r}: pooling_factor must be >= 0 and id_skew > 0")

    @classmethod
    def from_config(cls, config, pooling_factor: float = 1.0, weighted: bool = False,
                    id_skew: float = 1.0) -> TableSpec:
        """From an ``EmbeddingTableConfig`` (or anything with its fields)."""
        return cls(config.name, config.num_embeddings, config.embedding_dim, len(config.feature_names),
                   pooling_factor, config.pooling != "none", weighted, id_skew)

    @property
    def ids_per_sample(self) -> float:
        """Ids of all this table's features in one sample."""
        return self.pooling_factor * self.features

    def access_fraction(self, lo: int, hi: int) -> float:
        """Share of the table's lookups that fall on rows ``[lo, hi)``."""
        if self.id_skew == 1.0 or self.hashed:
            return (hi - lo) / self.rows
        a = 1.0 / self.id_skew
        return (hi / self.rows) ** a - (lo / self.rows) ** a

    def expected_unique(self, lo: int, hi: int, draws: float) -> float:
        """Expected number of distinct rows of ``[lo, hi)`` hit by ``draws`` lookups of the table."""
        if draws <= 0 or hi <= lo:
            return 0.0
        if self.hashed and self.id_skew != 1.0:  # any block is a fair sample of the whole table
            return (hi - lo) / self.rows * _power_law_unique(self.rows, self.id_skew, 0, self.rows, draws)
        if self.id_skew == 1.0:
            return (hi - lo) * -math.expm1(draws * math.log1p(-1.0 / self.rows)) if self.rows > 1 else 1.0
        return _power_law_unique(self.rows, self.id_skew, lo, hi, draws)


@functools.lru_cache(maxsize=4096)
def _power_law_unique(rows: int, id_skew: float, lo: int, hi: int, draws: float) -> float:
    """Expected distinct rows of ``[lo, hi)`` under ``id = floor(rows * u ** id_skew)``: rows in
    geometric buckets, uniform probability inside each bucket."""
    a = 1.0 / id_skew
    total, start = 0.0, lo
    while start < hi:
        end = min(hi, max(start + 1, int(start * 1.05) + 1))
        p = ((end / rows) ** a - (start / rows) ** a) / (end - start)
        total += (end - start) * (-math.expm1(draws * math.log1p(-p)) if p < 1 else 1.0)
        start = end
    return total


@dataclass(frozen=True)
class Workload:
    """How the tables are trained: batch, optimizer, wire type and replica reduction."""

    batch_size: int = 512  # samples per rank per step
    optimizer: str = "rowwise_adagrad"  # "sgd" keeps no row state
    comm_bytes: int = FP32_BYTES  # bytes per pooled element on the wire (2 with a bf16 comm_dtype)
    sync_mode: str = "weights"  # "weights": average touched rows; "gradients": every step
    sync_interval: int = 1  # steps between reductions (sync_mode="weights")
    sync_bytes: int = FP32_BYTES  # bytes per element of the weights reduction (SYNC_BYTES of its sync_dtype)
    sync_overlap: bool = False  # the reduction runs in the background, applied sync_interval steps later
    # Column-wise cuts give each column block its own row-wise AdaGrad accumulator, which changes
    # the optimizer's arithmetic; the planner then uses them only where asked (or under SGD).
    allow_column_wise: bool = False

    @property
    def sync_dtype(self) -> str:
        """The reduction's wire type of ``sync_bytes``: ``"fp32"``, ``"bf16"`` or ``"int8"``."""
        return {n: name for name, n in SYNC_BYTES.items()}[self.sync_bytes]

    @property
    def column_wise_exact(self) -> bool:
        """Whether a column-wise cut keeps this optimizer's arithmetic (no row state: SGD)."""
        return self.optimizer == "sgd"

    @property
    def state_per_row(self) -> int:
        """Row-wise optimizer state: one float32 per row (row-wise AdaGrad), none for SGD."""
        return 0 if self.optimizer == "sgd" else 1


# ------------------------------------------------------------------------------ slots
@dataclass(frozen=True)
class _Slot:
    spec: TableSpec
    shard: Shard

    @property
    def fraction(self) -> float:
        return self.spec.access_fraction(self.shard.row_start, self.shard.row_end)


def _slots(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int
           ) -> tuple[list[list[_Slot]], list[_Slot]]:
    """Per owner position its slots (``core.shards.assign_slots``: what ``sparse.sharded`` runs), with
    their tables' specs; plus the data-parallel slots."""
    by_name = {spec.name: spec for spec in specs}
    owned, local = assign_slots([(spec.name, range(spec.features)) for spec in specs], plan, group_size)
    return ([[_Slot(by_name[s.shard.table], s.shard) for s in slots] for slots in owned],
            [_Slot(by_name[s.shard.table], s.shard) for s in local])


def _unique_shards(slots: Sequence[_Slot]) -> list[_Slot]:
    return list({(s.spec.name, s.shard): s for s in slots}.values())


# ------------------------------------------------------------------------------ traffic
@dataclass(frozen=True)
class AllToAllVolumes:
    """Bytes one shard position sends and receives in each all-to-all of one step."""

    input_sent: float
    input_received: float
    output_sent: float  # forward: pooled rows (or rows per id) going home
    output_received: float  # the backward all-to-all sends and receives the same bytes swapped


def peer_volumes(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                 workload: Workload) -> tuple[list[float], list[float]]:
    """Per shard position ``o``: the input-dist bytes every peer sends to ``o`` (header included),
    and the output-dist bytes ``o`` returns to each peer, in one step (forward)."""
    b = workload.batch_size
    owned, _ = _slots(specs, plan, group_size)
    weighted = any(spec.weighted for spec in specs)
    to_owner = [HEADER_INT64S * INDEX_BYTES + len(slots) * b * INDEX_BYTES
                + sum(b * sl.spec.pooling_factor * sl.fraction for sl in slots)
                * (INDEX_BYTES + (FP32_BYTES if weighted else 0))
                for slots in owned]
    back = [_returned_elements(slots, b) * workload.comm_bytes for slots in owned]
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
    owned, local = _slots(specs, plan, s)
    syncs = steps // workload.sync_interval if workload.sync_mode == "weights" else steps
    name = "replica_sync" if workload.sync_mode == "weights" else "replica_grad_sync"
    local_sync = _reduction_bytes(_unique_shards(local), b, s * m * b, s * m, workload)
    result = []
    for p, volumes in enumerate(all_to_all_volumes(specs, plan, s, workload)):
        traffic = {"input_dist": steps * volumes.input_sent, "output_dist": steps * volumes.output_sent}
        if training:
            traffic["output_dist_grad"] = steps * volumes.output_received
            per_sync = _reduction_bytes(_unique_shards(owned[p]), s * b, s * m * b, m, workload) + local_sync
            traffic[name] = syncs * per_sync
        result.append(traffic)
    return result


def _returned_elements(slots: Sequence[_Slot], batch: int) -> float:
    """Elements an owner returns to one peer with ``batch`` samples: pooled rows or one row per id."""
    if not slots:
        return 0.0
    if slots[0].spec.pooled:
        return batch * sum(sl.shard.dim for sl in slots)
    return sum(batch * sl.spec.pooling_factor * sl.fraction * sl.shard.dim for sl in slots)


@dataclass(frozen=True)
class ReductionRound:
    """What one rank moves in one round of the weights reduction (``replication/``).

    ``gathered``: elements of touched rows (weights and row-wise state) gathered into the buffer;
    ``whole``: elements of shards sent whole (``core.reduction.sent_whole``), reduced in place;
    ``mask_bytes``: the packed row mask (one bit a row of every shard); ``rows``: rows of the shards;
    ``largest_chunk``: elements of the largest chunk of touched rows a round gathers at a time
    (``CHUNK`` elements of a piece, at least one row; the rounds' scratch buffers are sized by it);
    ``scales``: the int8 wire's scales, an int8 exponent per sent row of the weights and of the state.
    """

    gathered: float = 0.0
    whole: float = 0.0
    mask_bytes: float = 0.0
    rows: float = 0.0
    largest_chunk: float = 0.0
    scales: float = 0.0

    @property
    def elements(self) -> float:
        return self.gathered + self.whole

    def payload_bytes(self, workload: Workload) -> float:
        """Bytes of the round's buffers (mask, payload, scales) before the ring's ``2 (M - 1) / M``."""
        return self.mask_bytes + self.elements * workload.sync_bytes + self.scales

    def __add__(self, other: ReductionRound) -> ReductionRound:
        return ReductionRound(self.gathered + other.gathered, self.whole + other.whole,
                              self.mask_bytes + other.mask_bytes, self.rows + other.rows,
                              max(self.largest_chunk, other.largest_chunk), self.scales + other.scales)


def reduction_round(shards: Sequence[_Slot], world_samples: float, workload: Workload) -> ReductionRound:
    """One round over ``shards`` after ``workload.sync_interval`` steps of ``world_samples`` samples
    (the rows touched on any copy are sent; a shard nearly all touched is sent whole)."""
    if not shards:
        return ReductionRound()
    gathered = whole = chunk = scales = 0.0
    quantized = workload.sync_dtype == "int8"
    for sl in shards:
        spec, lo, hi = sl.spec, sl.shard.row_start, sl.shard.row_end
        union = spec.expected_unique(lo, hi, world_samples * workload.sync_interval * spec.ids_per_sample)
        width = sl.shard.dim + workload.state_per_row
        sent = sl.shard.rows if sent_whole(union, sl.shard.rows) else union
        if quantized:
            scales += sent * (1 + workload.state_per_row)
        if sent == sl.shard.rows:
            whole += sent * width
        else:
            gathered += sent * width
            chunk = max(chunk, min(sent, rows_per_chunk(sl.shard.dim)) * sl.shard.dim, min(sent, CHUNK))
    rows = sum(sl.shard.rows for sl in shards)
    return ReductionRound(gathered, whole, math.ceil(rows / 8), rows, chunk, scales)


def reduction_rounds(specs: Sequence[TableSpec], plan: Mapping[str, TableSharding], group_size: int,
                     num_replicas: int, workload: Workload) -> tuple[list[ReductionRound], ReductionRound]:
    """Per shard position, its round over the replica group; and the data-parallel tables' round
    over the whole world (the same on every rank)."""
    s, m, b = group_size, num_replicas, workload.batch_size
    owned, local = _slots(specs, plan, s)
    world = s * m * b
    return ([reduction_round(_unique_shards(slots), world, workload) for slots in owned],
            reduction_round(_unique_shards(local), world, workload))


def _reduction_bytes(shards: Sequence[_Slot], local_samples: float, world_samples: float, group: int,
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


# ------------------------------------------------------------------------------ storage
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
    owned, local = _slots(specs, plan, s)
    weighted = any(spec.weighted for spec in specs)
    id_bytes = INDEX_BYTES + (FP32_BYTES if weighted else 0)
    local_weights = sum(sl.shard.rows * sl.shard.dim for sl in _unique_shards(local)) * FP32_BYTES
    local_state = sum(sl.shard.rows for sl in _unique_shards(local)) * workload.state_per_row * FP32_BYTES
    local_out = _returned_elements(local, b) * FP32_BYTES
    sent = sum(len(slots) * b * INDEX_BYTES + sum(b * sl.spec.pooling_factor * sl.fraction for sl in slots) * id_bytes
               for slots in owned)
    sent += sum(b * sl.spec.pooling_factor for sl in local) * id_bytes
    output = sum(spec.features * (b * spec.dim if spec.pooled else b * spec.pooling_factor * spec.dim)
                 for spec in specs) * FP32_BYTES
    returned = sum(_returned_elements(slots, b) for slots in owned) * FP32_BYTES + local_out
    if s == 1 and workload.comm_bytes == FP32_BYTES and specs and specs[0].pooled:
        returned = local_out  # one rank, nothing to send or round: the kernel's output itself goes on
    result = []
    for p in range(s):
        shards = _unique_shards(owned[p])
        ids = sum(s * b * sl.spec.pooling_factor * sl.fraction for sl in owned[p])
        result.append(RankStorage(
            weights=sum(sl.shard.rows * sl.shard.dim for sl in shards) * FP32_BYTES + local_weights,
            optimizer=sum(sl.shard.rows for sl in shards) * workload.state_per_row * FP32_BYTES + local_state,
            received_ids=len(owned[p]) * s * b * INDEX_BYTES + ids * id_bytes,
            sent_ids=sent,
            lookup_output=_returned_elements(owned[p], s * b) * FP32_BYTES + local_out,
            returned=returned,
            output=output,
        ))
    return result


# ------------------------------------------------------------------------------ time
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
    return (ids * dim * 3 + rows_out * dim * 2 + ids * workload.state_per_row * 2) * FP32_BYTES


def shard_cost(spec: TableSpec, rows: tuple[int, int], dim: int, group_size: int, workload: Workload,
               links: LinkModel, group_links: GroupLinks, weighted: bool = False) -> ShardCost:
    """Cost of one shard (rows ``[lo, hi)`` x ``dim`` columns of ``spec``) to the rank owning it."""
    s, b = group_size, workload.batch_size
    lo, hi = rows
    bags = s * b * spec.features
    ids = s * b * spec.ids_per_sample * spec.access_fraction(lo, hi)
    state = workload.state_per_row
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


def dense_memory(dense_params: float) -> float:
    """Bytes every rank spends on the dense (DDP) part: weights, gradients, bucket, Adam moments."""
    return dense_params * DENSE_BYTES_PER_PARAM
