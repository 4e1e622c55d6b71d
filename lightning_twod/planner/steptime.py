"""Predicted seconds of one training step of a layout, by phase, on a ``links.LinkModel``.

The planner's choice (``layout.choose_layout``), the at-scale simulator and the calibration
against the testbed (``benchmarks/calibration.py``) all use this one model. For a plan of ``M``
replica groups x ``S`` ranks and the busiest shard position of a group (every collective waits
for its slowest member), per step:

* ``lookup``: embedding rows the kernels read and write (``load.lookup_bytes``) at the rank's
  lookup bandwidth;
* ``input_all_to_all``: the header and the ids (and per-id weights) to the owners inside the
  shard group; ``output_all_to_all``: pooled rows home and their gradients back (two calls);
* ``reduction``: the cross-group reduction, its exposed seconds per step. A round is a blocking
  all-reduce of the row mask, then the payload all-reduce (touched rows, a shard whole when
  nearly all touched; ``sync_bytes`` per element; the int8 wire first all-reduces its per-row
  exponents), plus the memory traffic of gathering, converting and applying the rows
  (``ROUND_TRAFFIC``; on CPU ranks at the shares of the probe's rates that rounds measured,
  ``ROUND_PASS_EFFICIENCY``). Blocking, it costs all of that every ``sync_interval`` steps; with
  ``sync_overlap`` the payload's transfer runs beside ``sync_interval`` steps of the rest of the
  step (``overlapped``): exposed = launch and apply traffic + scales + the share of the transfer
  the compute beside it still pays + what the rest cannot hide under what the step leaves the
  link;
* ``dense_all_reduce``: DDP's gradient all-reduce over the world, the part backward (2/3 of the
  dense compute) does not hide (``overlapped``); a measured local step already holds it, on the
  links it was measured on;
* ``dense_wait``: what that all-reduce adds waiting for its link (``dense_wait``): behind the
  output all-to-all's backward when the shard group crosses nodes too, where only the lookups'
  backward is left to hide it;
* ``dense_compute``: FLOPs of the dense layers at the rank's dense throughput.

An all-to-all costs its latency plus the larger of the bytes a rank sends inside its node at the
intra-node bandwidth, and the bytes its whole node sends to other nodes at the node's link
capacity. A ring all-reduce crosses each node boundary once per group, so a node sends
``groups with members there x 2 (g - 1) / g x buffer`` to other nodes; its latency is
``2 log2(g)`` rounds. Bandwidths are what a rank gets while every rank runs the collective
(``links.py``), which is how every layout runs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from lightning_twod.core.mesh import GroupShape, group_shapes
from lightning_twod.core.shards import ShardingType
from lightning_twod.planner.inputs import FP32_BYTES, INDEX_BYTES, TableSpec, Workload
from lightning_twod.planner.links import LinkModel
from lightning_twod.planner.load import lookup_bytes
from lightning_twod.planner.reduction import ReductionRound, reduction_rounds
from lightning_twod.planner.traffic import HEADER_INT64S, all_to_all_volumes, predict_traffic

#: Memory traffic of one reduction round per payload element, in bytes (random, streaming):
#: random bytes are row gathers and scatters (at the lookup bandwidth), streaming bytes copies,
#: conversions and element-wise arithmetic (at the copy bandwidth). Counted from the tensor
#: operations of ``replication/rounds.py`` and ``quantized.py`` (fp32 elements 4 bytes, bf16 2,
#: int8 1), launch and apply together, for touched rows gathered into a buffer and for shards
#: reduced whole in place. Both are worked on in cache-sized chunks (of elements, or of touched
#: rows): a chunk's scratch costs no memory traffic, and each element of a buffer or a shard is
#: read and written about once per pass over it.
ROUND_TRAFFIC = {
    # (sync_overlap, sync_dtype): {"gathered": (random, streaming), "whole": (random, streaming)}
    (False, "fp32"): {"gathered": (8, 12), "whole": (0, 8)},
    (False, "bf16"): {"gathered": (20, 4), "whole": (0, 24)},
    (False, "int8"): {"gathered": (32, 18), "whole": (0, 38)},
    (True, "fp32"): {"gathered": (12, 16), "whole": (0, 28)},
    (True, "bf16"): {"gathered": (24, 8), "whole": (0, 32)},
    (True, "int8"): {"gathered": (32, 26), "whole": (0, 46)},
}
#: Streaming bytes per row of the replicated shards for the row mask of a round: take and clear
#: it, pack it eight rows a byte, unpack the OR, count per shard (``replication/reducer.py``).
MASK_TRAFFIC_PER_ROW = 16
#: Shares of the probe's lookup and copy rates (``LinkModel``) that a round's passes over its rows
#: reach on CPU ranks, (random, streaming), measured on the two-node testbed (4 ranks on 2 cores,
#: 1 Gbit/s): the rounds' ``part_pack`` and ``part_apply`` over their payload elements (64
#: rank-rounds of ``benchmarks/overlap.py`` and ``scaling.py``, 2026-12-07: bf16 and fp32 wires,
#: groups of 2 and of 1, the Criteo-like and pooled workloads) against ``ROUND_TRAFFIC``'s bytes at
#: the rates of the 10 s ``calibrate`` probe of the same day (the fastest of 3 probes: lookup
#: 11.9 GB/s, copy 13.8). Streaming from the shards sent whole (24 rank-rounds, median: they move
#: only streaming bytes), random from the gathered rows' rest (40, median; quartiles 0.12 and
#: 0.18); with both, the predicted passes are the measured ones at the median of either path
#: (quartiles 0.84x-1.17x gathered, 0.95x-1.4x whole). The probe times one kernel at a time, a
#: round's index gathers and scatters run beside the training of the other ranks and gloo's
#: threads on the same cores. GPU ranks (``CPU_DENSE_FLOPS`` and up) keep the rates as they are:
#: nothing was measured there, and their presets' rates are already efficiency ASSUMPTIONS
#: (``hardware.py``).
ROUND_PASS_EFFICIENCY = (0.145, 0.21)
#: Dense FLOP/s of a rank below which the model takes it for a CPU rank (the testbed's: 0.06 to
#: 0.14 TFLOP/s; a GPU's, and every preset's, above 10).
CPU_DENSE_FLOPS = 1e12
#: FLOPs per sample per dense parameter for forward + backward (2 forward, 4 backward): the usual
#: 6 N rule for dense layers (Kaplan et al. 2020, "Scaling Laws for Neural Language Models").
DENSE_FLOPS_PER_PARAM = 6.0
#: Share of the dense compute that is backward, under which DDP's all-reduce runs (2 of the 6
#: FLOPs per parameter and sample are forward: ``DENSE_FLOPS_PER_PARAM``).
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class DenseModel:
    """The dense (DDP) part as the model sees it: parameters and FLOPs per sample.

    ``local_step_seconds``: a measured step of this model with nothing to exchange (one rank per
    shard group, no reduction): dense layers, kernels and framework together. When given it is
    the ``dense_compute`` phase and replaces the lookup and FLOP estimates (what every layout
    does alike); the model then adds only what the layouts exchange.
    """

    params: float = 0.0  # dense parameters; their fp32 gradients are all-reduced every step
    flops_per_sample: float | None = None  # forward + backward; None: 6 x params
    local_step_seconds: float | None = None

    @property
    def flops(self) -> float:
        return DENSE_FLOPS_PER_PARAM * self.params if self.flops_per_sample is None else self.flops_per_sample


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by phase (exposed time), and the reduction's round in detail."""

    lookup: float = 0.0
    input_all_to_all: float = 0.0
    output_all_to_all: float = 0.0
    reduction: float = 0.0
    dense_all_reduce: float = 0.0
    dense_compute: float = 0.0
    round_transfer: float = 0.0  # s per round on the wire (mask + payload)
    round_traffic: float = 0.0  # s per round of memory traffic (gather, convert, apply)
    dense_wait: float = 0.0  # what the dense all-reduce adds waiting for its link (``dense_wait``)

    PHASES = ("lookup", "input_all_to_all", "output_all_to_all", "reduction", "dense_all_reduce", "dense_wait",
              "dense_compute")
    SHORT = {"lookup": "lookup", "input_all_to_all": "in a2a", "output_all_to_all": "out a2a",
             "reduction": "x-group", "dense_all_reduce": "dense AR", "dense_wait": "AR wait", "dense_compute": "dense"}

    @property
    def total(self) -> float:
        return sum(getattr(self, phase) for phase in self.PHASES)

    def phases_ms(self) -> str:
        """``lookup 1.20, in a2a 0.31, ...`` in milliseconds."""
        return ", ".join(f"{self.SHORT[p]} {getattr(self, p) * 1e3:.2f}" for p in self.PHASES)

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def all_to_all_time(links: LinkModel, group: GroupShape, sent: float, received: float, ranks_per_node: int,
                    calls: int = 1) -> float:
    """Seconds of ``calls`` all-to-alls in which a rank sends ``sent`` and receives ``received``
    bytes in total (every group of the layout at once)."""
    if group.size <= 1:
        return 0.0
    nbytes = max(sent, received)
    remote = group.size - group.local
    intra = links.all_to_all_intra
    seconds = nbytes * (group.local - 1) / (group.size - 1) / intra.bandwidth
    latency = intra.latency
    if remote:
        node_bytes = nbytes * remote / (group.size - 1) * ranks_per_node
        seconds = max(seconds, node_bytes / links.node_link_capacity("all_to_all"))
        latency = max(latency, remote * links.all_to_all_inter.latency)
    return calls * latency + seconds


def all_reduce_time(links: LinkModel, group: GroupShape, nbytes: float, ranks_per_node: int) -> float:
    """Seconds of a ring all-reduce of a buffer of ``nbytes`` over every group of this shape at once."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    sent = 2 * (group.size - 1) / group.size * nbytes
    rounds = 2 * math.ceil(math.log2(group.size))
    if not group.spans_nodes:
        return rounds * links.all_reduce_intra.latency + sent / links.all_reduce_intra.bandwidth
    node_bytes = max(1, ranks_per_node // group.local) * sent
    seconds = node_bytes / links.node_link_capacity("all_reduce")
    if group.local > 1:
        seconds = max(seconds, sent / links.all_reduce_intra.bandwidth)
    return rounds * links.all_reduce_inter.latency + seconds


def overlapped(transfer: float, room: float, share: float) -> float:
    """Exposed seconds of a collective of ``transfer`` seconds run beside ``room`` seconds of other
    work: the ``share`` of it that work still pays (``LinkModel.overlap_share``), and what of the
    rest does not fit under ``room``."""
    return share * transfer + max(0.0, (1.0 - share) * transfer - room)


def round_seconds(links: LinkModel, group: GroupShape, rnd: ReductionRound, workload: Workload,
                  ranks_per_node: int) -> tuple[float, float]:
    """(transfer, the rest) seconds of one reduction round over ``group``: the rest, never hidden
    by overlap, is the memory traffic and the int8 wire's scale exchange (waited for at launch)."""
    if group.size <= 1 or rnd.rows == 0:
        return 0.0, 0.0
    transfer = (all_reduce_time(links, group, rnd.mask_bytes, ranks_per_node)
                + all_reduce_time(links, group, rnd.elements * workload.sync_bytes, ranks_per_node))
    scales = all_reduce_time(links, group, rnd.scales, ranks_per_node) if rnd.scales else 0.0
    traffic = ROUND_TRAFFIC[(workload.sync_overlap, workload.sync_dtype)]
    random = rnd.gathered * traffic["gathered"][0] + rnd.whole * traffic["whole"][0]
    streaming = (rnd.gathered * traffic["gathered"][1] + rnd.whole * traffic["whole"][1]
                 + rnd.rows * MASK_TRAFFIC_PER_ROW)
    share_random, share_streaming = ROUND_PASS_EFFICIENCY if links.dense_flops < CPU_DENSE_FLOPS else (1.0, 1.0)
    passes = random / (links.lookup_bandwidth * share_random) + streaming / (links.copy_bandwidth * share_streaming)
    return transfer, scales + passes


def _collection(specs: Sequence[TableSpec], shardings, world: int, group_size: int, workload: Workload,
                links: LinkModel, shapes, rpn: int) -> tuple[list[float], list[float], list[float], list, object]:
    """Per shard position: lookup, input and output all-to-all seconds; the reduction rounds."""
    shard_shape = shapes[0]
    lookups = [0.0] * group_size
    by_name = {spec.name: spec for spec in specs}
    for name, sharding in shardings.items():
        spec = by_name[name]
        data_parallel = sharding.sharding_type == ShardingType.DATA_PARALLEL
        for shard in sharding.shards:
            samples = workload.batch_size if data_parallel else group_size * workload.batch_size
            seconds = lookup_bytes(spec, (shard.row_start, shard.row_end), shard.dim, samples, workload)
            seconds /= links.lookup_bandwidth
            for owner in (range(group_size) if data_parallel else [shard.owner]):
                lookups[owner] += seconds
    weighted = any(spec.weighted for spec in specs)
    volumes = all_to_all_volumes(specs, shardings, group_size, workload)
    header = (group_size - 1) * HEADER_INT64S * INDEX_BYTES
    ins = [all_to_all_time(links, shard_shape, header, header, rpn)
           + all_to_all_time(links, shard_shape, v.input_sent - header, v.input_received - header, rpn,
                             calls=2 if weighted else 1) for v in volumes]
    outs = [2 * all_to_all_time(links, shard_shape, v.output_sent, v.output_received, rpn) for v in volumes]
    rounds, local = reduction_rounds(specs, shardings, group_size, world // group_size, workload)
    return lookups, ins, outs, rounds, local


def step_time(specs_by_module: Mapping[str, Sequence[TableSpec]], modules: Mapping[str, Mapping], world: int,
              group_size: int, placement: str, ranks_per_node: int | None, workload: Workload, links: LinkModel,
              dense: DenseModel = DenseModel()) -> StepTime:
    """Seconds of one step of the busiest rank of a plan (``modules``: ``ShardingPlan.modules``)."""
    rpn = ranks_per_node or world
    shapes = group_shapes(world, group_size, placement, rpn)
    shard_shape, replica_shape, world_shape = shapes
    lookup = [0.0] * group_size
    ins, outs = [0.0] * group_size, [0.0] * group_size
    rounds = [ReductionRound()] * group_size
    local = ReductionRound()
    for module, specs in specs_by_module.items():
        lk, i, o, r, dp = _collection(specs, modules[module], world, group_size, workload, links, shapes, rpn)
        for p in range(group_size):
            lookup[p] += lk[p]
            ins[p] += i[p]
            outs[p] += o[p]
            rounds[p] = rounds[p] + r[p]
        local = local + dp
    compute = dense.flops * workload.batch_size / links.dense_flops
    lookup_time = max(lookup)
    if dense.local_step_seconds is not None:
        compute, lookup_time = dense.local_step_seconds, 0.0
    dense_ar = all_reduce_time(links, world_shape, dense.params * FP32_BYTES, rpn)
    # a measured local step already holds what DDP's all-reduce costs the compute beside it
    share = 0.0 if dense.local_step_seconds is not None else links.overlap_share
    base = StepTime(lookup=lookup_time, input_all_to_all=max(ins), output_all_to_all=max(outs),
                    dense_all_reduce=overlapped(dense_ar, BACKWARD_SHARE * compute, share), dense_compute=compute)
    base = replace(base, dense_wait=dense_wait(base, dense_ar, shard_shape.spans_nodes, share))
    if workload.sync_mode == "gradients":
        return _with_gradient_sync(base, specs_by_module, modules, world, group_size, workload, links, shapes, rpn)
    t_dp, c_dp = round_seconds(links, world_shape, local, workload, rpn)  # data-parallel tables, world-wide
    transfer, traffic = t_dp, c_dp
    for p in range(group_size):
        t_rep, c_rep = round_seconds(links, replica_shape, rounds[p], workload, rpn)
        if t_rep + c_rep + t_dp + c_dp > transfer + traffic:
            transfer, traffic = t_rep + t_dp, c_rep + c_dp
    k = workload.sync_interval
    if workload.sync_overlap:
        busy = 0.0  # what else of the step uses the link the reduction uses
        if replica_shape.spans_nodes:
            busy = dense_ar + (base.input_all_to_all + base.output_all_to_all if shard_shape.spans_nodes else 0.0)
        room = max(0.0, base.total - busy)
        exposed = traffic + overlapped(transfer, k * room, links.overlap_share)
    else:
        exposed = transfer + traffic
    return replace(base, reduction=exposed / k, round_transfer=transfer, round_traffic=traffic)


def dense_wait(base: StepTime, dense_ar: float, behind_all_to_all: bool, share: float) -> float:
    """Seconds DDP's all-reduce (``dense_ar`` on a free link) adds to the step beyond
    ``base.dense_all_reduce`` because it waits for its link.

    Behind the output all-to-all's backward on the same link (``behind_all_to_all``: the shard
    group crosses nodes too) it ends after that, so only the lookups' backward (half their seconds)
    is left to hide it, not the dense backward. On the testbed (1 Gbit/s, ``benchmarks/auto.py``'s
    ``phases.md``) the rank whose backward ended last waited 0-9 ms for DDP's all-reduce after its
    backward's own work (14-15 on the pooled model in groups of 2, rounds in flight), where the model
    predicts 1-7; the other ranks wait 5-64 ms, for that rank, whose step is as long as theirs and
    holds the time in its other phases. A small all-reduce beside a bulk transfer across the
    testbed's shaper waits about 40 ms more than alone, but DDP's, launched before the backward's
    own work ends, meets little of an overlapped round's transfer.
    """
    if not behind_all_to_all:
        return 0.0
    return max(0.0, overlapped(dense_ar, base.lookup / 2, share) - base.dense_all_reduce)


def _with_gradient_sync(base: StepTime, specs_by_module, modules, world, group_size, workload, links, shapes,
                        rpn) -> StepTime:
    """``sync_mode="gradients"``: every step, the touched rows' ids are gathered and their
    gradients all-reduced over the replica group (``traffic.predict_traffic``'s bytes)."""
    replica_shape = shapes[1]
    m = world // group_size
    worst = 0.0
    for p in range(group_size):
        sent = sum(predict_traffic(specs, modules[module], group_size, m, workload)[p].get("replica_grad_sync", 0.0)
                   for module, specs in specs_by_module.items())
        buffer = sent * m / (2 * (m - 1)) if m > 1 else 0.0
        worst = max(worst, all_reduce_time(links, replica_shape, buffer, rpn))
    return replace(base, reduction=worst, round_transfer=worst, round_traffic=0.0)
