"""Analytic at-scale model: step time of 1D and 2D sparse parallelism from 8 to 4,096 GPUs.

For every world size ``W`` and each layout (1D: one shard group of ``W`` ranks; 2D: the group
size ``"auto"`` chooses), the model plans the tables with the real partitioner and cost model
(``planner.py``, ``cost.py``) and predicts one training step of the busiest rank as a sum of
phases, with no overlap between them (a pessimistic assumption; real trainers overlap some):

* ``lookup``: the busiest rank's embedding kernels, forward and fused backward (HBM bound);
* ``input_all_to_all``: ids and bag lengths to the owners (``cost.all_to_all_volumes``);
* ``output_all_to_all``: pooled rows home in forward, their gradients back in backward;
* ``cross_group_reduction``: averaging the touched rows (and row-wise AdaGrad state) over the
  replica group, every ``sync_interval`` steps, amortized per step (2D only);
* ``dense_all_reduce``: DDP's gradient all-reduce of the dense parameters over all ranks;
* ``dense_compute``: the dense layers, ``6 x params`` FLOPs per sample at ``DENSE_MFU``.

An all-to-all over a group of ``S`` ranks costs a latency (one intra-node collective plus one
message per remote peer) plus the larger of the bytes a rank sends or receives over the slowest
link it uses. Weak scaling: the batch per GPU is fixed, so scaling efficiency at ``W`` is
``step_time(W0) / step_time(W)`` against the faster layout at the smallest ``W0``. A layout whose
busiest rank needs more memory than a GPU has is reported as out of memory (OOM).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_twod.planner.cost import (
    ALL_REDUCE_EFFICIENCY, DENSE_FLOPS_PER_PARAM, DENSE_MFU, FP32_BYTES, H100, RESERVED_BYTES, Breakdown,
    Hardware, TableSpec, Workload, all_to_all_volumes, dense_memory, local_members, predict_traffic,
)
from lightning_twod.planner.plan import ShardingPlan
from lightning_twod.planner.planner import (
    PlanError, choose_group_size, group_links, plan_model,
)

# --------------------------------------------------------------------------------- workloads
# MLPerf Training DLRM-DCNv2 (Criteo 1TB multi-hot): rows per table capped at 40M, dim 128, and the
# multi-hot sizes (ids per sample) of each of the 26 features -- from the MLPerf Training reference
# (mlcommons/training, recommendation_v2/torchrec_dlrm, and TorchRec's dlrm example README).
MLPERF_DLRMV2_ROWS = (
    40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10,
    2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36,
)
MLPERF_DLRMV2_MULTI_HOT = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
#: Dense parameters of DLRM-DCNv2: bottom MLP 512-256-128, 3 low-rank (512) DCN layers over the
#: 3,456-wide interaction input, top MLP 1024-1024-512-256-1: about 16 M (our count from the
#: reference's layer sizes).
MLPERF_DLRMV2_DENSE_PARAMS = 16e6


#: Popularity skew of the simulated ids (``TableSpec.id_skew``, hashed over the rows). ASSUMPTION:
#: click logs are heavy-tailed; with 8, half of all lookups hit the hottest 0.4 % of a table's rows
#: (0.5 ** 8) and 90 % hit 43 % of them (0.9 ** 8). It sets how many distinct rows a step touches,
#: and so the cost of the cross-group reduction; uniform ids (1.0) are the pessimistic extreme.
DEFAULT_ID_SKEW = 8.0


def mlperf_dlrmv2_tables(row_scale: float = 1.0, dim: int = 128, id_skew: float = DEFAULT_ID_SKEW) -> list[TableSpec]:
    """The 26 DLRM-DCNv2 tables; ``row_scale`` multiplies the rows (a stand-in for larger models)."""
    return [TableSpec(f"t{i:02d}", max(1, int(rows * row_scale)), dim, pooling_factor=float(hot),
                      id_skew=id_skew, hashed=True)
            for i, (rows, hot) in enumerate(zip(MLPERF_DLRMV2_ROWS, MLPERF_DLRMV2_MULTI_HOT, strict=True))]


@dataclass(frozen=True)
class Scenario:
    """Everything the simulator needs; every field is an input a user can change."""

    tables: tuple[TableSpec, ...]
    batch_size: int = 1024  # samples per GPU per step
    hardware: Hardware = H100
    gpus_per_node: int = 8
    world_sizes: tuple[int, ...] = tuple(2 ** k for k in range(3, 13))  # 8 .. 4096
    dense_params: float = MLPERF_DLRMV2_DENSE_PARAMS
    dense_flops_per_sample: float | None = None  # FLOPs per sample, forward + backward; None: 6 x params
    optimizer: str = "rowwise_adagrad"
    comm_bytes: int = FP32_BYTES
    sync_interval: int = 1
    placement: str = "contiguous"
    group_size: int | str = "auto"  # 2D group: "auto" (smallest that fits), "node", or a number
    name: str = "custom"

    @property
    def workload(self) -> Workload:
        return Workload(self.batch_size, self.optimizer, self.comm_bytes, "weights", self.sync_interval)

    @property
    def sparse_memory_per_gpu(self) -> float:
        """Bytes a GPU may spend on tables and step buffers (dense model and reserve taken out)."""
        return self.hardware.memory_bytes - RESERVED_BYTES - dense_memory(self.dense_params)


def _scenario_presets() -> dict[str, Scenario]:
    return {
        # The paper (arXiv 2508.03854) trains "trillions of parameters" on up to 4K GPUs; its model is
        # not public. Stand-in: the DLRM-DCNv2 tables with 50x the rows (1.3 T parameters, 5.2 TB of
        # fp32 weights), H100 nodes of 8 GPUs, 1,024 samples per GPU, 10 GFLOP of dense work per sample
        # (ASSUMPTION: industrial interaction/transformer towers are in the 1-100 GFLOP range).
        "paper": Scenario(tuple(mlperf_dlrmv2_tables(row_scale=50)), dense_flops_per_sample=10e9, name="paper"),
        # Pinterest's blog (2D all-to-all optimized: 78 ms -> 13 ms, 7.5x at 8 nodes, 490k examples/s)
        # names AWS EFA; stand-in: p4d.24xlarge (8 x A100 40 GB, 400 Gb/s EFA), the DLRM-DCNv2 tables
        # at 1/10 of the rows with embedding dim 64 (their dims were halved), 1,024 samples per GPU,
        # 1 to 8 nodes. Their 2D keeps the all-to-all inside a node: group_size="node". Dense work:
        # 490k examples/s / 7.5 per node = 8.2k examples/s per GPU, i.e. ~125 ms per 1,024-sample
        # step on one node, which at 312 TFLOPS x DENSE_MFU is ~13 GFLOP per sample (derived from
        # their published throughput; their model is not public).
        "pinterest": Scenario(tuple(mlperf_dlrmv2_tables(row_scale=0.1, dim=64)), hardware=_a100(),
                              world_sizes=(8, 16, 32, 64), group_size="node", dense_flops_per_sample=13e9,
                              name="pinterest"),
        "mlperf": Scenario(tuple(mlperf_dlrmv2_tables()), name="mlperf"),
    }


def _a100() -> Hardware:
    from lightning_twod.planner.cost import A100_P4D

    return A100_P4D


PRESETS = _scenario_presets()


# --------------------------------------------------------------------------------- the model
@dataclass
class SimPoint:
    """One layout at one world size."""

    layout: str  # "1D" or "2D"
    world_size: int
    group_size: int
    memory: float  # bytes the busiest rank needs (tables, optimizer state, step buffers, dense, reserve)
    fits: bool
    breakdown: Breakdown = field(default_factory=Breakdown)
    imbalance: float = 1.0
    efficiency: float | None = None

    @property
    def replicas(self) -> int:
        return self.world_size // self.group_size

    @property
    def step_time(self) -> float:
        return self.breakdown.total

    def throughput(self, batch_size: int) -> float:
        return self.world_size * batch_size / self.step_time if self.step_time > 0 else math.inf


def _all_to_all_time(sent: float, received: float, links) -> float:
    return links.latency + max(sent, received) * links.seconds_per_byte


def _all_reduce_time(sent_bytes: float, group: int, local: int, hardware: Hardware) -> float:
    """A ring all-reduce in which each rank sends ``sent_bytes``; tree latency ``2 log2(group)``."""
    if group <= 1:
        return 0.0
    bandwidth = hardware.intra_node_bandwidth if local >= group else hardware.inter_node_bandwidth
    latency = hardware.intra_node_latency if local >= group else hardware.inter_node_latency
    return sent_bytes / (bandwidth * ALL_REDUCE_EFFICIENCY) + 2 * math.ceil(math.log2(group)) * latency


def step_breakdown(scenario: Scenario, plan: ShardingPlan) -> Breakdown:
    """Seconds of one step of the busiest rank for a plan (see the module docstring)."""
    hw, w, s = scenario.hardware, plan.world_size, plan.shard_group_size
    m, workload = plan.num_replicas, scenario.workload
    specs = list(scenario.tables)
    shardings = plan.shardings("model")
    links = group_links(hw, w, s, scenario.placement, scenario.gpus_per_node)
    volumes = all_to_all_volumes(specs, shardings, s, workload)
    out = Breakdown()
    out.lookup = max(r.load.lookup for r in plan.report.ranks)
    if s > 1:
        out.input_all_to_all = max(_all_to_all_time(v.input_sent, v.input_received, links) for v in volumes)
        out.output_all_to_all = 2 * max(_all_to_all_time(v.output_sent, v.output_received, links) for v in volumes)
    if m > 1:
        traffic = predict_traffic(specs, shardings, s, m, workload, steps=scenario.sync_interval)
        sent = max(t.get("replica_sync", 0.0) for t in traffic)
        stride = s if scenario.placement == "contiguous" else 1
        local = local_members(m, stride, scenario.gpus_per_node)
        out.cross_group_reduction = _all_reduce_time(sent, m, local, hw) / scenario.sync_interval
    dense = scenario.dense_params * FP32_BYTES
    flops = scenario.dense_flops_per_sample or DENSE_FLOPS_PER_PARAM * scenario.dense_params
    out.dense_compute = flops * scenario.batch_size / (hw.dense_flops * DENSE_MFU)
    # DDP all-reduces gradient buckets while backward (2/3 of the dense compute) runs: only the rest shows.
    all_reduce = _all_reduce_time(2 * (w - 1) / w * dense, w, min(w, scenario.gpus_per_node), hw)
    out.dense_all_reduce = max(0.0, all_reduce - out.dense_compute * 2 / 3)
    return out


def simulate_point(scenario: Scenario, world_size: int, layout: str) -> SimPoint:
    """Plan and time one layout ("1D" or "2D") at one world size."""
    specs = {"model": list(scenario.tables)}
    budget = scenario.sparse_memory_per_gpu
    common = dict(placement=scenario.placement, hardware=scenario.hardware)
    fixed = RESERVED_BYTES + dense_memory(scenario.dense_params)
    try:
        fixed_size = {"1D": world_size, "2D": scenario.group_size}[layout]
        if fixed_size == "node":
            fixed_size = min(world_size, scenario.gpus_per_node)
        if fixed_size != "auto":
            plan = plan_model(specs, world_size, int(fixed_size), scenario.workload, memory_per_rank=budget,
                              ranks_per_node=scenario.gpus_per_node, **common)
        else:
            plan, _ = choose_group_size(specs, world_size, scenario.gpus_per_node, budget, scenario.workload,
                                        **common)
        fits = True
    except PlanError:  # report what the smallest-memory layout (one group of all ranks) would need
        size = world_size if fixed_size == "auto" else int(fixed_size)
        plan = plan_model(specs, world_size, size, scenario.workload, ranks_per_node=scenario.gpus_per_node,
                          **common)
        fits = False
    point = SimPoint(layout, world_size, plan.shard_group_size, plan.report.max_memory + fixed, fits,
                     step_breakdown(scenario, plan), plan.report.imbalance)
    return point


def simulate(scenario: Scenario) -> list[SimPoint]:
    """Both layouts at every world size, with scaling efficiency against the best at the smallest."""
    points = [simulate_point(scenario, w, layout) for w in scenario.world_sizes for layout in ("1D", "2D")]
    feasible = [p for p in points if p.fits]
    if feasible:
        smallest = min(p.world_size for p in feasible)
        reference = min(p.step_time for p in feasible if p.world_size == smallest)
        for p in feasible:
            p.efficiency = reference / p.step_time
    return points


def reference_world(points: Sequence[SimPoint]) -> int | None:
    """The smallest world size at which some layout fits: the efficiency baseline."""
    feasible = [p.world_size for p in points if p.fits]
    return min(feasible) if feasible else None


# --------------------------------------------------------------------------------- output
def format_table(scenario: Scenario, points: Sequence[SimPoint]) -> str:
    """A text table: per world size and layout, group size, memory, phases (ms), step, efficiency."""
    hw = scenario.hardware
    lines = [
        f"scenario {scenario.name}: {len(scenario.tables)} tables, "
        f"{sum(t.rows * t.dim for t in scenario.tables) / 1e9:.2f} B embedding parameters, "
        f"{scenario.batch_size} samples/GPU, {scenario.gpus_per_node} GPUs/node, {hw.name} "
        f"({hw.memory_bytes / 1e9:.0f} GB, NVLink {hw.intra_node_bandwidth / 1e9:.0f} GB/s, "
        f"network {hw.inter_node_bandwidth / 1e9:.2f} GB/s per GPU), sync every {scenario.sync_interval} step(s)",
        f"{'GPUs':>5} {'lay':>3} {'S':>5} {'M':>4} {'mem GB':>7} {'imbal':>6} {'lookup':>7} {'in a2a':>7} "
        f"{'out a2a':>7} {'x-group':>7} {'dense AR':>8} {'dense':>6} {'step ms':>8} {'eff':>6}",
    ]
    for p in points:
        b = p.breakdown
        eff = f"{p.efficiency:6.1%}" if p.efficiency is not None else ("   OOM" if not p.fits else "     -")
        ms = [x * 1e3 for x in (b.lookup, b.input_all_to_all, b.output_all_to_all, b.cross_group_reduction,
                                b.dense_all_reduce, b.dense_compute, p.step_time)]
        lines.append(
            f"{p.world_size:>5} {p.layout:>3} {p.group_size:>5} {p.replicas:>4} {p.memory / 1e9:>7.1f} "
            f"{p.imbalance:>6.2f} {ms[0]:>7.2f} {ms[1]:>7.2f} {ms[2]:>7.2f} {ms[3]:>7.2f} {ms[4]:>8.2f} "
            f"{ms[5]:>6.2f} {ms[6]:>8.2f} {eff}")
    base = reference_world(points)
    if base is not None:
        lines.append(f"efficiency = step time of the faster layout at {base} GPUs (the smallest that fits) / step "
                     "time; OOM: the busiest rank needs more than a GPU's memory")
    return "\n".join(lines)


def plot(scenario: Scenario, points: Sequence[SimPoint], path: str) -> str:
    """Write a PNG: scaling efficiency (left) and step-time breakdown (right) of 1D and 2D."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for layout, style in (("1D", "o--"), ("2D", "s-")):
        mine = [p for p in points if p.layout == layout]
        xs = [p.world_size for p in mine if p.fits]
        left.plot(xs, [p.efficiency * 100 for p in mine if p.fits], style, label=layout)
        oom = [p.world_size for p in mine if not p.fits]
        if oom:
            left.plot(oom, [0] * len(oom), "x", color="red", markersize=10,
                      label=f"{layout} out of memory")
    left.set_xscale("log", base=2)
    left.set_xlabel("GPUs")
    left.set_ylabel("weak-scaling efficiency (%)")
    left.set_ylim(0, 105)
    left.grid(alpha=0.3)
    left.legend()
    left.set_title(f"{scenario.name}: predicted scaling")
    worlds = list(scenario.world_sizes)
    width = 0.38
    phases = Breakdown.PHASES
    colors = plt.get_cmap("tab10").colors
    for k, layout in enumerate(("1D", "2D")):
        mine = {p.world_size: p for p in points if p.layout == layout}
        bottom = [0.0] * len(worlds)
        for j, phase in enumerate(phases):
            heights = [getattr(mine[w].breakdown, phase) * 1e3 for w in worlds]
            xs = [i + (k - 0.5) * width for i in range(len(worlds))]
            right.bar(xs, heights, width, bottom=bottom, color=colors[j], hatch="//" if layout == "1D" else None,
                      label=phase.replace("_", " ") if k == 1 else None, edgecolor="white")
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    right.set_xticks(range(len(worlds)), [str(w) for w in worlds])
    right.set_xlabel("GPUs (left bar 1D, hatched; right bar 2D)")
    right.set_ylabel("predicted step time (ms)")
    right.legend(fontsize=8)
    right.set_title("step-time breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def with_links(scenario: Scenario, *, intra_gbps: float | None = None, inter_gbps: float | None = None,
               intra_latency_us: float | None = None, inter_latency_us: float | None = None,
               memory_gb: float | None = None) -> Scenario:
    """The scenario with some hardware numbers replaced (GB/s, microseconds, GB)."""
    changes = {}
    if intra_gbps is not None:
        changes["intra_node_bandwidth"] = intra_gbps * 1e9
    if inter_gbps is not None:
        changes["inter_node_bandwidth"] = inter_gbps * 1e9
    if intra_latency_us is not None:
        changes["intra_node_latency"] = intra_latency_us * 1e-6
    if inter_latency_us is not None:
        changes["inter_node_latency"] = inter_latency_us * 1e-6
    if memory_gb is not None:
        changes["memory_bytes"] = memory_gb * 1e9
    if not changes:
        return scenario
    return replace(scenario, hardware=replace(scenario.hardware, name=scenario.hardware.name + "*", **changes))
