"""What one rank holds at the peak of a training step, by category, for a plan.

The sparse categories come from ``storage.predict_storage`` (checked against the tensors real runs
allocate: ``tests/system/test_planner_distributed.py``, ``tests/system/test_planner_memory.py``); the dense
ones from the dense parameter count; the reduction's buffers from ``replication/``: the
touched rows gathered for a round (fp32 blocking), the reference copy of every replicated shard
(bf16 and int8 wires), the residual copy (int8 wire), what a round in flight sent, kept to correct
the rows with (overlap: the rows, or their bf16 changes), and on the fp32 wire with overlap and an interval above one, the touched rows a
drain's blocking round gathers (a drain reduces the steps since the last launch). On the bf16 wire with overlap,
a drain's blocking round sends every row the overlapped rounds sent since the last round that waited (each copy
kept its own rounding residual there): up to every row of the replicated shards, through the wire buffer the
overlapped rounds use, which grows to ``core.reduction.GROWTH`` times that (category ``drain``).

An fp16 table (``TableSpec.row_bytes``) holds 2 bytes an element of its rows and fp32 state; its rows go in a
round of their own, as they are, whatever the wire (``replication/wire.py``): the buffers of an fp32 round of
2-byte elements, and no reference or residual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from lightning_twod.core.reduction import CHUNK, DENSE_SHARE, GROWTH
from lightning_twod.core.shards import ShardingType
from lightning_twod.planner.inputs import FP32_BYTES, TableSpec, Workload
from lightning_twod.planner.reduction import HALF_BYTES, ReductionRound, reduction_rounds
from lightning_twod.planner.storage import DENSE_BYTES_PER_PARAM, RankStorage, predict_storage


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one rank holds, by category (see the module docstring)."""

    table_shards: float = 0.0  # shard weights (data-parallel copies included)
    optimizer_state: float = 0.0  # sparse optimizer state (row-wise accumulators, the Adam family's moments)
    ids_received: float = 0.0  # the ids its kernel looks up, as received and in kernel order
    ids_sent: float = 0.0  # the ids it sends to the owners
    kernel_output: float = 0.0  # its kernel's output [S B, D_owned]
    returned: float = 0.0  # what the output all-to-all brings back [B, sum of owners' dims]
    output: float = 0.0  # the collection's output [B, sum of feature dims]
    gradients: float = 0.0  # of the kernel output, of what was returned, of the output
    dense_parameters: float = 0.0  # fp32 dense weights
    dense_optimizer: float = 0.0  # their gradient, DDP's bucket copy, Adam's two moments
    reduction: float = 0.0  # the cross-group reduction's buffers for its rounds
    drain: float = 0.0  # what a drain's round adds to them (bf16 wire with overlap: every row sent since the last wait)

    LABELS = {"table_shards": "table shards", "optimizer_state": "row-wise state", "ids_received": "ids received",
              "ids_sent": "ids sent", "kernel_output": "kernel output", "returned": "a2a returns",
              "output": "collection output", "gradients": "their gradients", "dense_parameters": "dense params",
              "dense_optimizer": "dense grad+Adam", "reduction": "reduction buffers",
              "drain": "drain wire"}

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))

    @classmethod
    def categories(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def from_storage(storage: RankStorage, dense_params: float = 0.0, reduction: float = 0.0,
                 drain: float = 0.0) -> MemoryBreakdown:
    """The categories of one rank's ``RankStorage`` (its ``activations`` split up), plus the dense
    part and the reduction's buffers (``drain``: what a drain adds to them)."""
    return MemoryBreakdown(
        table_shards=storage.weights, optimizer_state=storage.optimizer, ids_received=2 * storage.received_ids,
        ids_sent=storage.sent_ids, kernel_output=storage.lookup_output, returned=storage.returned,
        output=storage.output, gradients=storage.lookup_output + storage.returned + storage.output,
        dense_parameters=dense_params * FP32_BYTES,
        dense_optimizer=dense_params * (DENSE_BYTES_PER_PARAM - FP32_BYTES), reduction=reduction, drain=drain)


def reduction_buffers(specs: Sequence[TableSpec], shardings: Mapping, group_size: int, num_replicas: int,
                      workload: Workload) -> list[float]:
    """Per shard position, bytes of the reduction's buffers (``replication/rounds.py``, ``reducer.py``), a
    drain's included."""
    rounds, drains = reduction_parts(specs, shardings, group_size, num_replicas, workload)
    return [a + b for a, b in zip(rounds, drains, strict=True)]


def reduction_parts(specs: Sequence[TableSpec], shardings: Mapping, group_size: int, num_replicas: int,
                    workload: Workload) -> tuple[list[float], list[float]]:
    """Per shard position, bytes of the buffers its rounds hold, and what a drain's round adds to them."""
    drains = [0.0] * group_size
    if num_replicas <= 1 or workload.sync_mode != "weights":
        return [0.0] * group_size, drains
    rounds, _ = reduction_rounds(specs, shardings, group_size, num_replicas, workload)
    replicated = [0.0] * group_size
    for spec in specs:
        sharding = shardings[spec.name]
        if sharding.sharding_type == ShardingType.DATA_PARALLEL:
            continue
        for shard in sharding.shards:
            wired = ((0 if spec.half else shard.dim) + workload.state_per_row(shard.dim, spec.name)
                     - workload.exact_state_per_row(shard.dim, spec.name))
            replicated[shard.owner] += shard.rows * wired * FP32_BYTES  # the exact states, fp16 rows keep no reference
    bf16, int8 = workload.sync_dtype == "bf16", workload.sync_dtype == "int8"
    kept = replicated if bf16 else [2 * r for r in replicated] if int8 else [0.0] * group_size
    out = []
    for p, both in enumerate(rounds):
        rnd, half = _without_half(both), _half_round(both, workload)
        if rnd.elements == 0:
            out.append(kept[p] + half)
            continue
        chunk = rnd.largest_chunk  # a chunk of touched rows at a time passes through scratch buffers
        # the round's buffer: the wire's elements, and those of the exact states' fp32 round
        payload = (rnd.elements - rnd.exact) * workload.sync_bytes + rnd.exact * FP32_BYTES
        if int8:  # the wire, the exponents, the snapshot (overlap), the gathered rows' changes, a chunk
            # of scratch, and a chunk of touched rows and of their reference rows
            nbytes = (payload + rnd.elements * workload.sync_overlap * FP32_BYTES + rnd.scales
                      + (rnd.gathered + CHUNK + 2 * chunk) * FP32_BYTES)
        elif workload.sync_overlap:  # what was sent kept (the rows, or their bf16 changes), the wire, a
            # chunk of scratch, and a chunk of rows, whole shards' too (and of their reference rows and of the
            # changes sent)
            chunk = max(chunk, rnd.largest_whole_chunk)
            nbytes = 2 * payload + (CHUNK + (3 if bf16 else 1) * chunk) * FP32_BYTES
            if bf16:
                drains[p] = _drain_wire(replicated[p], (rnd.elements - rnd.exact) * workload.sync_bytes)
            elif workload.sync_interval > 1:
                nbytes += _drain_rows(rnd)
        elif bf16:  # the changes on the wire, a conversion chunk, a chunk of touched rows and reference rows
            nbytes = payload + (CHUNK + 2 * chunk) * FP32_BYTES
        else:  # the touched rows gathered; whole shards are reduced in place
            nbytes = rnd.gathered * FP32_BYTES
        if rnd.exact and workload.sync_dtype != "fp32" and workload.sync_overlap:
            nbytes += (CHUNK + rnd.largest_chunk) * FP32_BYTES  # the exact states' round: its own scratch
        out.append(nbytes + kept[p] + half)
    return out, drains


def _without_half(rnd: ReductionRound) -> ReductionRound:
    """``rnd`` without the rows of fp16 tables (``ReductionRound.half``), which go in a round of their own."""
    return replace(rnd, gathered=rnd.gathered - rnd.half_gathered, whole=rnd.whole - (rnd.half - rnd.half_gathered),
                   half=0.0, half_gathered=0.0)


def _half_round(rnd: ReductionRound, workload: Workload) -> float:
    """Bytes of the buffers of the round of fp16 rows in ``rnd`` (``replication/rounds.py`` on the fp32 wire's
    path, 2-byte elements): the touched rows gathered (blocking); or what was sent kept, the wire, a chunk of
    fp32 scratch and a chunk of rows (overlapped), and with an interval above one the rows a drain gathers."""
    if not rnd.half:
        return 0.0
    if not workload.sync_overlap:
        return rnd.half_gathered * HALF_BYTES
    chunk = max(rnd.largest_chunk, rnd.largest_whole_chunk)
    drain = (rnd.half_gathered + DENSE_SHARE * (rnd.half - rnd.half_gathered)) * HALF_BYTES
    return (2 * rnd.half + chunk) * HALF_BYTES + CHUNK * FP32_BYTES + (drain if workload.sync_interval > 1 else 0.0)


def _drain_wire(replicated: float, wire: float) -> float:
    """Bytes a drain's blocking bf16 round adds to the ``wire`` bytes of the overlapped rounds' wire buffer,
    which it shares: it sends every row those rounds sent since the last round that waited (the copies differ
    there by their rounding residuals), up to every row of the replicated shards (``replicated`` fp32 bytes,
    half as many in bf16, sent whole once ``DENSE_SHARE`` of a shard is), so the buffer grows to ``GROWTH``
    times that."""
    drained = replicated * 2 / FP32_BYTES
    return GROWTH * drained - wire if drained > wire else 0.0


def _drain_rows(rnd: ReductionRound) -> float:
    """Bytes of the buffer a drain's blocking fp32 round (before a checkpoint, at the end of fit) gathers
    the rows touched since the last launch into, which the workspace keeps beside the overlapped round's:
    at most the rows a round gathers, and under ``DENSE_SHARE`` of each shard a round sends whole."""
    return (rnd.gathered + DENSE_SHARE * rnd.whole) * FP32_BYTES


def plan_memory(specs_by_module: Mapping[str, Sequence[TableSpec]], modules: Mapping[str, Mapping], group_size: int,
                num_replicas: int, workload: Workload, dense_params: float = 0.0) -> list[MemoryBreakdown]:
    """Per shard position, the breakdown of a plan (every collection of the model)."""
    totals = [MemoryBreakdown()] * group_size
    for module, specs in specs_by_module.items():
        storage = predict_storage(specs, modules[module], group_size, workload)
        buffers, drains = reduction_parts(specs, modules[module], group_size, num_replicas, workload)
        for p in range(group_size):
            part = from_storage(storage[p], reduction=buffers[p], drain=drains[p])
            totals[p] = MemoryBreakdown(*(getattr(totals[p], f) + getattr(part, f) for f in MemoryBreakdown.categories()))
    dense = from_storage(RankStorage(0, 0, 0, 0, 0, 0, 0), dense_params)
    return [MemoryBreakdown(*(getattr(t, f) + getattr(dense, f) for f in MemoryBreakdown.categories())) for t in totals]


def busiest(breakdowns: Sequence[MemoryBreakdown]) -> MemoryBreakdown:
    return max(breakdowns, key=lambda b: b.total)
