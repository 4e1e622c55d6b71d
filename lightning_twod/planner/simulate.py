"""At-scale model: step time of 1D and 2D sparse parallelism from 8 to 4,096 GPUs.

For every world size ``W`` the simulator plans the tables with the real partitioner
(``partition.py``) and predicts a step of the busiest rank with the planner's own step-time model
(``steptime.py``: lookup, all-to-alls, the cross-group reduction with its interval, overlap and
wire type, DDP's dense all-reduce, dense compute) on a ``LinkModel`` (a preset built from the
scenario's hardware, or a file written by ``calibrate``):

* ``1D``: one shard group of all ``W`` GPUs;
* ``2D``: the best layout with at least two replica groups, over the group sizes (all divisors of
  ``W`` below it, or the scenario's fixed one), both placements, and the scenario's candidate
  reduction intervals. A longer interval is chosen only when it saves at least
  ``INTERVAL_GAIN`` of the step (it costs quality: ``docs/quality.md``);
* ``PT`` (with ``per_table``): every table its own group size (``per_table.PerTableSearch``),
  searched from the faster of 1D and 2D at its placement, interval and round (from the least-memory
  global layout where neither fits).

A layout whose busiest rank needs more memory than a GPU has (tables, optimizer state, step
buffers, the reduction's buffers, the dense model with Adam, ``RESERVED_BYTES``) is out of memory
(OOM) and not chosen. The reduction's buffers depend on its round (``Scenario.rounds``): the
scenario's round (overlapped, or a bf16 or int8 wire) holds a snapshot of what it sent, or a
reference copy of every replicated shard, that the blocking fp32 round does not. So every layout
is also tried with the rounds that need less memory, down to the blocking fp32 one, and the
fastest round that fits is chosen: a layout is never slower, nor out of memory, for a round that
only the scenario allows on top of the blocking fp32 one.
Weak scaling: the batch per GPU is fixed; efficiency at ``W`` is ``step(W0) / step(W)`` against
the faster layout at the smallest ``W0`` where one fits. World sizes smaller than a fixed group
size are skipped with a note.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_twod.planner.hardware import A100_P4D, H100, Hardware
from lightning_twod.planner.inputs import FP32_BYTES, TableSpec, Workload
from lightning_twod.planner.layout import Candidate, evaluate_layout, layout_options
from lightning_twod.planner.links import LinkModel, from_hardware
from lightning_twod.planner.memory import reduction_buffers
from lightning_twod.planner.per_table import PerTableSearch
from lightning_twod.planner.steptime import DenseModel, step_time
from lightning_twod.planner.storage import RESERVED_BYTES, dense_memory

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


#: A longer reduction interval is chosen only when its step is at least this much shorter than
#: the shortest interval's best (a policy: longer intervals let the copies drift further apart).
INTERVAL_GAIN = 0.02

#: A round of the cross-group reduction: (overlapped, bytes per element on the wire).
Round = tuple[bool, int]
#: The round with the fewest buffers: blocking, fp32 (touched rows gathered, whole shards in place).
LEAST_MEMORY_ROUND: Round = (False, FP32_BYTES)


def round_label(round_: Round) -> str:
    """``"ov bf16"``, ``"bl fp32"``, ...: overlapped or blocking, and the wire type."""
    overlap, sync_bytes = round_
    return f"{'ov' if overlap else 'bl'} {Workload(sync_bytes=sync_bytes).sync_dtype}"


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
    sync_intervals: tuple[int, ...] = (1, 4, 16)  # candidates (the intervals docs/quality.md measured)
    sync_overlap: bool = False
    sync_bytes: int = FP32_BYTES  # cost.SYNC_BYTES of the sync_dtype
    placement: str = "auto"  # "auto": both compared, or "contiguous" / "strided"
    group_size: int | str = "auto"  # 2D group: "auto" (the fastest that fits), "node", or a number
    links: LinkModel | None = None  # None: the hardware's preset (links.from_hardware)
    name: str = "custom"
    per_table: bool = False  # also the per-table layout ("PT") at every world size

    def workload(self, interval: int, round_: Round | None = None) -> Workload:
        """The workload of a reduction every ``interval`` steps by ``round_`` (None: the scenario's round)."""
        overlap, sync_bytes = round_ or (self.sync_overlap, self.sync_bytes)
        return Workload(self.batch_size, self.optimizer, self.comm_bytes, "weights", interval, sync_bytes, overlap)

    @property
    def rounds(self) -> tuple[Round, ...]:
        """The rounds compared, the scenario's first, then those that hold less: blocking (no snapshot of what
        was sent), the fp32 wire (no reference copy), both (``LEAST_MEMORY_ROUND``, always the last)."""
        return tuple(dict.fromkeys((overlap, sync_bytes) for overlap in (self.sync_overlap, False)
                                   for sync_bytes in (self.sync_bytes, FP32_BYTES)))

    @property
    def link_model(self) -> LinkModel:
        return self.links or replace(from_hardware(self.hardware), ranks_per_node=self.gpus_per_node)

    @property
    def dense(self) -> DenseModel:
        return DenseModel(self.dense_params, self.dense_flops_per_sample)

    @property
    def sparse_memory_per_gpu(self) -> float:
        """Bytes a GPU may spend on tables and step buffers (dense model and reserve taken out)."""
        return self.hardware.memory_bytes - RESERVED_BYTES - dense_memory(self.dense_params)

    @property
    def fixed_memory(self) -> float:
        return RESERVED_BYTES + dense_memory(self.dense_params)


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
        # 1 to 8 nodes. Dense work: 490k examples/s / 7.5 per node = 8.2k examples/s per GPU, i.e.
        # ~125 ms per 1,024-sample step on one node, which at 312 TFLOPS x DENSE_MFU is ~13 GFLOP per
        # sample (derived from their published throughput; their model is not public).
        "pinterest": Scenario(tuple(mlperf_dlrmv2_tables(row_scale=0.1, dim=64)), hardware=A100_P4D,
                              world_sizes=(8, 16, 32, 64), dense_flops_per_sample=13e9, name="pinterest"),
        "mlperf": Scenario(tuple(mlperf_dlrmv2_tables()), name="mlperf"),
    }


PRESETS = _scenario_presets()


# --------------------------------------------------------------------------------- the model
@dataclass
class SimPoint:
    """One layout at one world size (the chosen one of its kind)."""

    layout: str  # "1D", "2D" or "PT" (every table its own group size)
    world_size: int
    candidate: Candidate
    interval: int = 1
    sync_round: Round = LEAST_MEMORY_ROUND  # the reduction's round (none runs in 1D)
    memory: float = 0.0  # bytes the busiest rank needs (tables, state, buffers, dense, reserve)
    fits: bool = True
    efficiency: float | None = None
    tried: int = 1  # layouts and intervals compared

    @property
    def group_size(self) -> int:
        return self.candidate.group_size

    @property
    def placement(self) -> str:
        return self.candidate.placement

    @property
    def replicas(self) -> int:
        return self.world_size // self.group_size

    @property
    def time(self):
        return self.candidate.time

    @property
    def step_time(self) -> float:
        return self.time.total

    @property
    def imbalance(self) -> float:
        """The predicted imbalance of the shard positions (NaN for a per-table layout: one per size)."""
        report = self.candidate.plan.report
        return math.nan if report is None else report.imbalance

    def tables_by_size(self) -> dict[int, list[str]]:
        """``{group size: tables}`` of the plan, data-parallel tables under 0."""
        plan, out = self.candidate.plan, {}
        for ts in plan.modules["model"].values():
            size = 0 if ts.sharding_type.value == "data_parallel" else ts.size_in(plan.shard_group_size)
            out.setdefault(size, []).append(ts.table)
        return dict(sorted(out.items()))

    def throughput(self, batch_size: int) -> float:
        return self.world_size * batch_size / self.step_time if self.step_time > 0 else math.inf


@dataclass
class Simulation:
    """The points of every world size, and the notes on the world sizes that were skipped."""

    points: list[SimPoint] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _fixed_group(scenario: Scenario, world_size: int) -> int | None:
    if scenario.group_size == "auto":
        return None
    if scenario.group_size == "node":
        return min(world_size, scenario.gpus_per_node)
    return int(scenario.group_size)


def _plan(scenario: Scenario, world_size: int, group_size: int, placement: str, budget: float,
          **kwargs) -> Candidate:
    """One layout planned, fitting ``budget`` with the least-memory round at the first interval."""
    specs = {"model": list(scenario.tables)}
    workload = scenario.workload(scenario.sync_intervals[0], LEAST_MEMORY_ROUND)
    return evaluate_layout(specs, world_size, group_size, placement, scenario.gpus_per_node, budget,
                           workload, scenario.link_model, scenario.dense, **kwargs)


def _timed(scenario: Scenario, candidate: Candidate, interval: int, round_: Round, budget: float) -> Candidate | None:
    """``candidate`` (planned) with its step and memory predicted for ``round_`` every ``interval`` steps;
    None when its busiest rank needs more than ``budget`` with that round's buffers."""
    plan, workload = candidate.plan, scenario.workload(interval, round_)
    buffers = reduction_buffers(list(scenario.tables), plan.modules["model"], plan.shard_group_size, plan.num_replicas,
                                workload)  # the reduction's buffers grow with the rows an interval touches
    memory = max(r.memory + b for r, b in zip(plan.report.ranks, buffers, strict=True))
    if memory > budget:
        return None
    time = step_time({"model": list(scenario.tables)}, plan.modules, plan.world_size, plan.shard_group_size,
                     plan.placement, scenario.gpus_per_node, workload, scenario.link_model, scenario.dense)
    return replace(candidate, time=time, memory=memory)


def _choices(scenario: Scenario, layout: str, world_size: int, options: Sequence[tuple[int, str]]) -> list[SimPoint]:
    """Per round of ``scenario.rounds`` that some layout fits with, the best of ``options`` and of the
    intervals (for 2D); [the smallest-memory layout, out of memory] when none fits. 1D runs no round:
    it is timed once, the same point for every round."""
    budget = scenario.sparse_memory_per_gpu
    fitting = [c for c in (_plan(scenario, world_size, size, where, budget) for size, where in options) if c.fits]
    intervals = sorted(scenario.sync_intervals if layout == "2D" else scenario.sync_intervals[:1])
    rounds = scenario.rounds if layout == "2D" else scenario.rounds[:1]
    tried = len(fitting) * len(intervals) * len(rounds)
    points = []
    for round_ in rounds:
        best: tuple[Candidate, int] | None = None
        for interval in intervals:
            # the buffers grow with the interval and with the round: a layout that fits one may not fit another
            timed_all = [t for t in (_timed(scenario, c, interval, round_, budget) for c in fitting) if t is not None]
            if not timed_all:
                continue
            timed = min(timed_all, key=lambda c: c.time.total)
            if best is None or timed.time.total < best[0].time.total * (1 - INTERVAL_GAIN):
                best = (timed, interval)
        if best is not None:
            candidate, interval = best
            points.append(SimPoint(layout, world_size, candidate, interval, round_,
                                   candidate.memory + scenario.fixed_memory, tried=tried))
    if points:
        return points + [replace(points[0], sync_round=r) for r in scenario.rounds[len(rounds):]]
    # what the largest group with every table cut row-wise (the least memory) would need
    size, where = max(options)
    unlimited = _plan(scenario, world_size, size, where, math.inf,
                      constraints={t.name: "row_wise" for t in scenario.tables if size > 1})
    return [SimPoint(layout, world_size, unlimited, memory=unlimited.memory + scenario.fixed_memory, fits=False,
                     tried=len(options))]


def _fastest(points: Sequence[SimPoint]) -> SimPoint:
    """The fastest of ``points`` that fit (the first of equal ones: the scenario's round before the others);
    the first when none does."""
    fitting = [p for p in points if p.fits]
    return min(fitting, key=lambda p: p.step_time) if fitting else points[0]


def simulate(scenario: Scenario) -> Simulation:
    """1D and the best 2D layout at every world size, with weak-scaling efficiency."""
    out, choices = Simulation(), {}
    for w in scenario.world_sizes:
        choices[w] = _choices(scenario, "1D", w, [(w, "contiguous")])
        out.points.append(_fastest(choices[w]))
        fixed = _fixed_group(scenario, w)
        if fixed is not None and (fixed >= w or w % fixed):
            out.notes.append(f"{w} GPUs: no 2D layout with shard_group_size={scenario.group_size} "
                             f"({fixed} {'is not below' if fixed >= w else 'does not divide'} {w}); skipped")
            continue
        options = [(s, p) for s, p in layout_options(w, fixed or "auto", scenario.placement) if s < w]
        if not options:
            out.notes.append(f"{w} GPUs: no 2D layout (one GPU cannot be split into replica groups); skipped")
            continue
        two_d = _choices(scenario, "2D", w, options)
        choices[w] += two_d
        out.points.append(_fastest(two_d))
    if scenario.per_table:
        out.points += [_per_table_point(scenario, w, choices[w]) for w in scenario.world_sizes]
        out.points.sort(key=lambda p: p.world_size)  # stable: 1D, 2D, PT at each size
    feasible = [p for p in out.points if p.fits and p.layout != "PT"]  # per-table is measured against them
    if feasible:
        smallest = min(p.world_size for p in feasible)
        reference = min(p.step_time for p in feasible if p.world_size == smallest)
        for p in out.points:
            if p.fits:
                p.efficiency = reference / p.step_time
    return out


def _per_table_point(scenario: Scenario, world_size: int, globals_: list[SimPoint]) -> SimPoint:
    """Every table its own group size, searched from the best global layout at ``world_size`` (1D and 2D,
    every round; the least-memory one where none fits), and from the best with the least-memory round
    where that is another one (the scenario's round leaves less memory to the search): the faster."""
    fitting = [p for p in globals_ if p.fits]
    starts = [_fastest(fitting) if fitting else globals_[-1]]
    least = [p for p in fitting if p.sync_round == LEAST_MEMORY_ROUND]
    if least and _fastest(least) is not starts[0]:
        starts.append(_fastest(least))
    found_points = [_search_from(scenario, world_size, start) for start in starts]
    return replace(_fastest(found_points), tried=sum(p.tried for p in found_points))


def _search_from(scenario: Scenario, world_size: int, start: SimPoint) -> SimPoint:
    """The per-table search from the global layout ``start``, at its placement, interval and round; ``start``
    itself (as ``PT``) when no assignment fits."""
    search = PerTableSearch({"model": list(scenario.tables)}, world_size, start.placement, scenario.gpus_per_node,
                            scenario.sparse_memory_per_gpu, scenario.workload(start.interval, start.sync_round),
                            scenario.link_model, scenario.dense)
    found = search.search({t.name: start.group_size for t in scenario.tables}, {})
    if not found.fits:
        return replace(start, layout="PT", tried=search.evaluations)
    own = {t: ts.group_size for t, ts in found.plan.modules["model"].items() if ts.group_size is not None}
    candidate = Candidate(found.plan.shard_group_size, start.placement, found.plan, found.time, memory=found.memory,
                          own_sizes=own)
    return SimPoint("PT", world_size, candidate, start.interval, start.sync_round, found.memory + scenario.fixed_memory,
                    tried=search.evaluations)


def reference_world(points: Sequence[SimPoint]) -> int | None:
    """The smallest world size at which some global layout (1D or 2D) fits: the efficiency baseline."""
    feasible = [p.world_size for p in points if p.fits and p.layout != "PT"]
    return min(feasible) if feasible else None


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
