"""Per-table shard group sizes: plan a model whose tables each have their own, and choose them by cost.

A table ``t`` sharded over groups of ``S_t`` ranks has ``M_t = W / S_t`` copies. An *assignment*
``{table: S_t}`` is planned one group size at a time: the tables of each size go through the
partitioner (``partition.plan_model``) for groups of that size, and the plans are merged into one
``ShardingPlan`` whose tables carry their own ``group_size``. What it costs:

* **memory**, per global rank: the sum over the sizes of what the rank's position in its group of
  that size holds (tables, state, step buffers, the reduction's buffers); the busiest rank must fit;
* **step time**: the dense phases once; per size, its lookup, input and output all-to-alls and its
  reduction (``steptime.step_time`` of that size's tables), added up. The parts run one after the
  other on a rank (their collectives may overlap each other; the sum does not count on it).

``PerTableSearch.search`` starts from a global layout (every table at one size; ``layout.choose_layout``'s
choice) and searches: **exactly** where the assignments are few (at most ``EXACT_LIMIT``: every one
is planned), else **greedily**: first the ``k`` smallest tables together to each size (a new group
size pays its own all-to-all latencies and round before the second table in it gains, which
single moves never see), then, per pass, each free table, largest first, to the size that lowers
the predicted step most while the busiest rank fits, until a pass moves nothing or after
``MAX_PASSES`` passes. The greedy search costs at most ``sizes x tables + MAX_PASSES x tables x
(sizes - 1)`` evaluations; each plans at most two new (size, tables) subsets, the rest come from a
cache. The assignment found replaces the global layout only where it ``beats`` it on the links'
probes (``layout.py``: faster on every probe and their fastest numbers, or by 10 % on the fastest numbers), for which
``total_on`` predicts it on each.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_twod.core.mesh import divisors, group_strides
from lightning_twod.core.shards import ShardingType, TableSharding
from lightning_twod.planner.evaluate import evaluate as evaluate_plan
from lightning_twod.planner.evaluate import shard_group_links
from lightning_twod.planner.inputs import TableSpec, Workload
from lightning_twod.planner.links import LinkModel
from lightning_twod.planner.memory import reduction_buffers
from lightning_twod.planner.partition import PlanError, plan_model
from lightning_twod.planner.plan import ShardingPlan, format_gib
from lightning_twod.planner.steptime import DenseModel, StepTime, step_time

#: Assignments planned one by one when there are at most this many; above, the greedy search.
EXACT_LIMIT = 256
#: Passes of the greedy search over the tables.
MAX_PASSES = 3


@dataclass
class SizedPart:
    """The tables of one group size, planned: their plan, step and memory per position."""

    size: int
    plan: ShardingPlan
    time: StepTime
    memory: list[float]  # bytes per position 0 .. size - 1, the reduction's buffers included


@dataclass
class Assignment:
    """One ``{table: group size}`` of a model, planned: the merged plan, its step and busiest rank."""

    sizes: dict[str, int]
    plan: ShardingPlan | None = None
    time: StepTime | None = None
    memory: float = 0.0
    error: str = ""
    parts: list[SizedPart] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.plan is not None


class PerTableSearch:
    """Plans and predicts assignments of one model on one world and placement; tables are named by their
    names, which must not repeat across collections (``ValueError`` otherwise)."""

    def __init__(self, specs_by_module: Mapping[str, Sequence[TableSpec]], world_size: int, placement: str,
                 ranks_per_node: int | None, memory_per_rank: float, workload: Workload, links: LinkModel,
                 dense: DenseModel = DenseModel(), **kwargs: Any) -> None:
        self.specs_by_module = {m: list(specs) for m, specs in specs_by_module.items()}
        names = [spec.name for specs in self.specs_by_module.values() for spec in specs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tables {repeated} are named in several collections; per-table group sizes name "
                             "tables by their names: rename them, or give every table one group size")
        self.world, self.placement, self.rpn = world_size, placement, ranks_per_node
        self.memory_per_rank, self.workload, self.links, self.dense = memory_per_rank, workload, links, dense
        self.kwargs = kwargs  # constraints (table -> type), tolerance
        self._parts: dict[tuple[int, tuple[str, ...]], SizedPart | str] = {}
        self.evaluations = 0
        self.exact = False  # the last search planned every assignment

    @property
    def tables(self) -> list[str]:
        return [spec.name for specs in self.specs_by_module.values() for spec in specs]

    def _part(self, size: int, names: tuple[str, ...]) -> SizedPart | str:
        """The tables ``names`` planned for groups of ``size`` (cached), or why they do not fit."""
        key = (size, names)
        if key not in self._parts:
            chosen = set(names)
            specs = {m: [s for s in specs if s.name in chosen] for m, specs in self.specs_by_module.items()}
            specs = {m: s for m, s in specs.items() if s}
            constraints = {t: k for t, k in (self.kwargs.get("constraints") or {}).items() if t in chosen}
            try:
                plan = plan_model(specs, self.world, size, self.workload, memory_per_rank=self.memory_per_rank,
                                  placement=self.placement, ranks_per_node=self.rpn, links=self.links,
                                  constraints=constraints, tolerance=self.kwargs.get("tolerance", 0.05))
            except PlanError as err:
                self._parts[key] = str(err).split(". Options")[0]
                return self._parts[key]
            self._parts[key] = self._costed(size, specs, plan)
        return self._parts[key]

    def _costed(self, size: int, specs: Mapping[str, Sequence[TableSpec]], plan: ShardingPlan) -> SizedPart:
        """The step and the memory per position of ``plan``, the tables ``specs`` in groups of ``size``."""
        if plan.report is None:
            group_links = shard_group_links(self.links, self.world, size, self.placement, self.rpn)
            plan.report = evaluate_plan(specs, plan.modules, size, self.workload, self.links, group_links)
        buffers = [0.0] * size
        for module, module_specs in specs.items():
            extra = reduction_buffers(module_specs, plan.modules[module], size, self.world // size, self.workload)
            buffers = [a + b for a, b in zip(buffers, extra, strict=True)]
        time = step_time(specs, plan.modules, self.world, size, self.placement, self.rpn, self.workload,
                         self.links, self.dense)
        return SizedPart(size, plan, time, [r.memory + b for r, b in zip(plan.report.ranks, buffers, strict=True)])

    def predict(self, plan: ShardingPlan) -> Assignment:
        """A given plan with per-table group sizes (a pinned one): its step and busiest rank, unplanned."""
        default = plan.shard_group_size
        sizes = {t: ts.size_in(default) for tables in plan.modules.values() for t, ts in tables.items()}
        out = Assignment(sizes)
        for size in sorted(set(sizes.values())):
            modules = {m: {t: ts for t, ts in tables.items() if sizes[t] == size} for m, tables in plan.modules.items()}
            modules = {m: tables for m, tables in modules.items() if tables}
            specs = {m: [s for s in self.specs_by_module[m] if s.name in modules[m]] for m in modules}
            shardings = {m: {t: TableSharding(ts.table, ts.sharding_type, ts.shards) for t, ts in tables.items()}
                         for m, tables in modules.items()}
            out.parts.append(self._costed(size, specs, ShardingPlan(size, self.world, shardings, self.placement,
                                                                    self.rpn)))
        out.memory = max(self._rank_memory(out.parts, rank) for rank in self._ranks(out.parts))
        out.time, out.plan = combine([part.time for part in out.parts]), plan
        return out

    def evaluate(self, sizes: Mapping[str, int], default: int | None = None) -> Assignment:
        """Plan the assignment ``sizes`` (every table of the model) and predict its step; ``default``:
        the merged plan's ``shard_group_size`` (None: the size of the most tables)."""
        self.evaluations += 1
        out = Assignment(dict(sizes))
        by_size: dict[int, list[str]] = {}
        for name in self.tables:
            by_size.setdefault(sizes[name], []).append(name)
        for size in sorted(by_size):
            part = self._part(size, tuple(by_size[size]))
            if isinstance(part, str):
                out.error = f"tables {by_size[size]} in groups of {size}: {part}"
                return out
            out.parts.append(part)
        out.memory = max(self._rank_memory(out.parts, rank) for rank in self._ranks(out.parts))
        if out.memory > self.memory_per_rank:
            out.error = (f"the busiest rank needs {format_gib(out.memory)}, a rank has "
                         f"{format_gib(self.memory_per_rank)}")
            return out
        out.time = combine([part.time for part in out.parts])
        out.plan = self._merged(out.parts, default)
        return out

    def _ranks(self, parts: list[SizedPart]) -> range:
        """The ranks whose positions repeat every rank's (contiguous: the least common multiple of the sizes)."""
        if self.placement != "contiguous":
            return range(self.world)
        period = 1
        for part in parts:
            period = period * part.size // _gcd(period, part.size)
        return range(period)

    def _rank_memory(self, parts: list[SizedPart], rank: int) -> float:
        total = 0.0
        for part in parts:
            shard_stride, _ = group_strides(self.placement, self.world, part.size)
            total += part.memory[(rank // shard_stride) % part.size]  # the rank's position in its group
        return total

    def _merged(self, parts: list[SizedPart], default: int | None) -> ShardingPlan:
        """One plan of the model: each table's sharding with its own group size where it is not the
        plan's ``default`` (None: the size of the most tables; ties: the smaller)."""
        if default is None:
            counts = {part.size: sum(len(t) for t in part.plan.modules.values()) for part in parts}
            default = max(sorted(counts), key=lambda s: counts[s])
        found: dict[str, TableSharding] = {}
        for part in parts:
            for tables in part.plan.modules.values():
                for name, ts in tables.items():
                    own = None if part.size == default or ts.sharding_type == ShardingType.DATA_PARALLEL else part.size
                    found[name] = TableSharding(ts.table, ts.sharding_type, ts.shards, own)
        modules = {m: {s.name: found[s.name] for s in specs} for m, specs in self.specs_by_module.items()}
        return ShardingPlan(default, self.world, modules, self.placement, self.rpn)

    # ------------------------------------------------------------------ the search
    def search(self, start: Mapping[str, int], pinned: Mapping[str, int]) -> Assignment:
        """The fastest assignment found from ``start``; ``pinned`` tables keep their size."""
        options = divisors(self.world)
        free = [name for name in self.tables if name not in pinned]
        self.exact = len(options) ** len(free) <= EXACT_LIMIT
        if self.exact:
            best = None
            for choice in itertools.product(options, repeat=len(free)):
                candidate = self.evaluate({**start, **dict(zip(free, choice, strict=True)), **pinned})
                if candidate.fits and (best is None or candidate.time.total < best.time.total):
                    best = candidate
            return best if best is not None else self.evaluate({**start, **pinned})
        best = self.evaluate({**start, **pinned})
        # the k smallest tables together: a new group size pays its own all-to-all latencies and
        # round before the second table in it gains anything, which one table at a time never sees
        smallest = sorted(free, key=self._bytes)
        for size in options:
            for k in range(1, len(smallest) + 1):
                candidate = self.evaluate({**best.sizes, **dict.fromkeys(smallest[:k], size)})
                if candidate.fits and (not best.fits or candidate.time.total < best.time.total):
                    best = candidate
        order = smallest[::-1]
        for _ in range(MAX_PASSES):
            moved = False
            for name in order:
                for size in options:
                    if size == best.sizes[name]:
                        continue
                    candidate = self.evaluate({**best.sizes, name: size})
                    if candidate.fits and (not best.fits or candidate.time.total < best.time.total):
                        best, moved = candidate, True
            if not moved:
                break
        return best

    def total_on(self, chosen: Assignment, links: LinkModel) -> float:
        """The predicted step (s) of ``chosen`` on other numbers of the links (a probe, an end of the probes)."""
        times = []
        for part in chosen.parts:
            specs = {m: [s for s in specs if s.name in chosen.sizes and chosen.sizes[s.name] == part.size]
                     for m, specs in self.specs_by_module.items()}
            specs = {m: s for m, s in specs.items() if s}
            times.append(step_time(specs, part.plan.modules, self.world, part.size, self.placement, self.rpn,
                                   self.workload, links, self.dense))
        return combine(times).total

    def _bytes(self, name: str) -> int:
        spec = next(s for specs in self.specs_by_module.values() for s in specs if s.name == name)
        return spec.rows * spec.dim

    def alternatives(self, chosen: Assignment, name: str) -> dict[int, Assignment]:
        """``chosen`` with ``name`` at every other size: what decided its size."""
        return {size: self.evaluate({**chosen.sizes, name: size})
                for size in divisors(self.world) if size != chosen.sizes[name]}


def combine(times: Sequence[StepTime]) -> StepTime:
    """One step of several parts: the dense phases once (every part predicts the same), the rest added."""
    first = times[0]
    summed = first
    for other in times[1:]:
        summed = summed + other
    return StepTime(summed.lookup, summed.input_all_to_all, summed.output_all_to_all, summed.reduction,
                    first.dense_all_reduce, first.dense_compute, summed.round_transfer, summed.round_traffic,
                    max(t.dense_wait for t in times))


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def describe_tables(search: PerTableSearch, chosen: Assignment) -> list[str]:
    """Per table: type, group size, and the predicted step with it in groups of each other size
    (what decided its size; the chosen assignment's step is in the header)."""
    lines = [f"  {'table':<20} {'type':<14} {'group':>5}  predicted ms per step with the table in groups of "
             f"another size (this assignment: {chosen.time.total * 1e3:.3g})"]
    for module, tables in chosen.plan.modules.items():
        for name, ts in tables.items():
            label = f"{module}.{name}" if len(chosen.plan.modules) > 1 else name
            if ts.sharding_type == ShardingType.DATA_PARALLEL:
                lines.append(f"  {label:<20} {ts.sharding_type.value:<14} {'world':>5}  -")
                continue
            others = [f"{size}: {candidate.time.total * 1e3:.3g}" if candidate.fits else f"{size}: no fit"
                      for size, candidate in search.alternatives(chosen, name).items()]
            size = ts.size_in(chosen.plan.shard_group_size)
            lines.append(f"  {label:<20} {ts.sharding_type.value:<14} {size:>5}  {', '.join(others)}")
    return lines
