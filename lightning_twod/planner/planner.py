"""Sharding plans: a balanced partitioner inside one shard group, ``shard_group_size="auto"``,
and a ``ShardingPlan`` that prints as a table and round-trips through YAML.

The partitioner decides, for every table of a collection, a sharding type and the owners of its
shards inside a group of ``S`` ranks (every group holds the same plan):

1. every table starts table-wise (or as its constraint says);
2. shards are placed longest first, each on the least loaded rank that still has memory for it
   (column-wise blocks of one table on distinct ranks), then moved or swapped away from the
   busiest rank while that lowers its load;
3. while the busiest rank is above the mean by more than ``tolerance``, the heaviest splittable
   table on it is cut finer (table-wise -> column-wise 2, 4, ... blocks -> row-wise over the
   group) if that lowers the predicted step time; a shard that fits no rank's memory forces the
   same cut. A table that fits nowhere even row-wise raises ``PlanError`` with the options.

Load is the cost model's predicted seconds per step (``cost.shard_cost``: lookup work plus the
bytes the owner receives and returns); everything is deterministic (sorted by cost, then name,
ties to the lowest rank), so every rank computes the same plan.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lightning_twod.planner.cost import (
    GIB,
    H100,
    Hardware,
    Links,
    RankLoad,
    RankStorage,
    TableSpec,
    Workload,
    local_members,
    predict_load,
    predict_storage,
    shard_cost,
)
from lightning_twod.planner.plan import PlanReport, RankReport, ShardingPlan, _gib
from lightning_twod.sparse.sharding import (
    SCHEMES,
    ShardingType,
    TableSharding,
    parse_sharding_type,
)
from lightning_twod.sparse.sharding.base import chunk_bounds

#: Smallest column block: FBGEMM's kernels need dims that are multiples of 4.
MIN_COLUMN_BLOCK = 4
#: The partitioner stops cutting tables once the busiest rank is within this of the mean.
DEFAULT_TOLERANCE = 0.05


class PlanError(ValueError):
    """The tables do not fit the ranks' memory (the message names the tables and the options)."""


# ----------------------------------------------------------------------------- options
def _column_blocks(dim: int, group_size: int) -> list[int]:
    """Numbers of equal column blocks a table may be cut into (FBGEMM-friendly widths first)."""
    blocks = [k for k in range(2, min(group_size, dim) + 1) if dim % k == 0 and (dim // k) % MIN_COLUMN_BLOCK == 0]
    if not blocks and dim % MIN_COLUMN_BLOCK:  # an odd dim: equal blocks of any width
        blocks = [k for k in range(2, min(group_size, dim) + 1) if dim % k == 0]
    return blocks


def _ladder(spec: TableSpec, group_size: int, constraint: ShardingType | None,
            column_wise: bool = True) -> list[tuple[ShardingType, int]]:
    """Ways to cut a table, coarsest first: ``(sharding type, number of shards)``.

    ``column_wise=False`` leaves column-wise cuts out unless ``constraint`` asks for one: they give
    each column block its own row-wise AdaGrad accumulator (a different optimizer than the
    unsharded table's), so the planner makes them on its own only under SGD or when allowed.
    """
    tw, cw, rw, dp = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE,
                      ShardingType.DATA_PARALLEL)
    columns = [(cw, k) for k in _column_blocks(spec.dim, group_size)]
    rows = [(rw, group_size)] if group_size > 1 else []
    if constraint is None:
        return [(tw, 1), *(columns if column_wise else []), *rows]
    if constraint == tw:
        return [(tw, 1)]
    if constraint == cw:
        return columns or [(cw, min(group_size, spec.dim))]
    if constraint == rw:
        return [(rw, group_size)]
    return [(dp, 1)]


# ----------------------------------------------------------------------------- placement
@dataclass
class _Item:
    """Shards of one table placed together: ``count`` ranks, each with ``time`` s and ``memory`` B."""

    table: str
    kind: ShardingType
    count: int
    time: float
    memory: float


@dataclass
class _Placement:
    owners: dict[str, list[int]]  # table -> owner of each shard, in shard order
    load: list[float]
    free: list[float]
    failed: str | None = None  # a table that fit no rank

    @property
    def max_load(self) -> float:
        return max(self.load)

    @property
    def mean_load(self) -> float:
        return sum(self.load) / len(self.load)


def _objective(placement: _Placement) -> tuple[float, int]:
    """What cutting a table must lower: the busiest rank's load, then how many ranks are that busy
    (so that cutting one of several equally heavy tables counts as progress)."""
    peak = placement.max_load
    return round(peak, 15), sum(1 for x in placement.load if x >= peak * (1 - 1e-6))


class _Partitioner:
    """Partition the tables of one collection over one shard group (see the module docstring)."""

    def __init__(self, specs: Sequence[TableSpec], group_size: int, workload: Workload, hardware: Hardware,
                 links: Links, capacity: Sequence[float], base_load: Sequence[float],
                 constraints: Mapping[str, ShardingType], tolerance: float) -> None:
        self.specs = list(specs)
        self.by_name = {spec.name: spec for spec in specs}
        self.size = group_size
        self.workload, self.hardware, self.links = workload, hardware, links
        self.capacity, self.base_load = list(capacity), list(base_load)
        self.tolerance = tolerance
        self.weighted = any(spec.weighted for spec in specs)
        column_wise = workload.allow_column_wise or workload.column_wise_exact
        self.ladders = {spec.name: _ladder(spec, group_size, constraints.get(spec.name), column_wise)
                        for spec in specs}
        self._items: dict[tuple[str, int], _Item] = {}
        self._fixed: dict[tuple[str, int], tuple[list[float], list[float]]] = {}

    # -- costs
    def _cost(self, spec: TableSpec, rows: tuple[int, int], dim: int, size: int | None = None):
        links = self.links if size is None else Links(0.0, 0.0)
        return shard_cost(spec, rows, dim, size or self.size, self.workload, self.hardware, links, self.weighted)

    def _item(self, spec: TableSpec, kind: ShardingType, count: int) -> _Item:
        if kind == ShardingType.COLUMN_WISE:
            width = max(hi - lo for lo, hi in chunk_bounds(spec.dim, count))
            cost = self._cost(spec, (0, spec.rows), width)
            return _Item(spec.name, kind, len(chunk_bounds(spec.dim, count)), cost.time, cost.memory)
        cost = self._cost(spec, (0, spec.rows), spec.dim)
        return _Item(spec.name, kind, 1, cost.time, cost.memory)

    def _fixed_vectors(self, spec: TableSpec, level: int) -> tuple[list[float], list[float]]:
        """Per-rank seconds and bytes of a row-wise or data-parallel table (owners are fixed)."""
        key = (spec.name, level)
        if key not in self._fixed:
            kind, count = self.ladders[spec.name][level]
            if kind == ShardingType.ROW_WISE:
                # every rank also receives one partial sum [B, D] per feature from every owner (x2: grad)
                extra = 0.0
                if spec.pooled:
                    extra = (self.size - 1) * self.workload.batch_size * spec.features * spec.dim * 4 * 2
                load, memory = [0.0] * self.size, [extra] * self.size
                for rank, rows in enumerate(chunk_bounds(spec.rows, count)):
                    cost = self._cost(spec, rows, spec.dim)
                    load[rank] += cost.time
                    memory[rank] += cost.memory
            else:
                cost = self._cost(spec, (0, spec.rows), spec.dim, size=1)
                load, memory = [cost.time] * self.size, [cost.memory] * self.size
            self._fixed[key] = (load, memory)
        return self._fixed[key]

    # -- one placement for given cut levels
    def place(self, levels: Mapping[str, int]) -> _Placement:
        load, free = list(self.base_load), list(self.capacity)
        owners: dict[str, list[int]] = {}
        items: list[_Item] = []
        for spec in self.specs:
            kind, count = self.ladders[spec.name][levels[spec.name]]
            if kind in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL):
                add_load, add_memory = self._fixed_vectors(spec, levels[spec.name])
                for rank in range(self.size):
                    load[rank] += add_load[rank]
                    free[rank] -= add_memory[rank]
                owners[spec.name] = (list(range(len(chunk_bounds(spec.rows, count))))
                                     if kind == ShardingType.ROW_WISE else [-1])
            else:
                key = (spec.name, levels[spec.name])
                if key not in self._items:
                    self._items[key] = self._item(spec, kind, count)
                items.append(self._items[key])
        if any(f < 0 for f in free):  # the fixed shards alone overflow a rank: blame the biggest
            worst = min(range(self.size), key=lambda r: (free[r], r))
            fixed = [s for s in self.specs if s.name in owners]
            biggest = max(fixed, key=lambda s: (self._fixed_vectors(s, levels[s.name])[1][worst], s.name),
                          default=self.specs[0])
            return _Placement(owners, load, free, failed=biggest.name)

        heap = [(load[r], r) for r in range(self.size)]
        heapq.heapify(heap)
        for item in sorted(items, key=lambda it: (-it.time, -it.memory, it.table)):
            chosen, skipped = [], []
            while heap and len(chosen) < item.count:
                entry = heapq.heappop(heap)
                (chosen if free[entry[1]] >= item.memory else skipped).append(entry)
            for entry in skipped:
                heapq.heappush(heap, entry)
            if len(chosen) < item.count:
                return _Placement(owners, load, free, failed=item.table)
            for _, rank in chosen:
                load[rank] += item.time
                free[rank] -= item.memory
                heapq.heappush(heap, (load[rank], rank))
            owners[item.table] = sorted(rank for _, rank in chosen)
        placement = _Placement(owners, load, free)
        self._refine(placement, items)
        return placement

    def _refine(self, placement: _Placement, items: Sequence[_Item], max_rounds: int = 200) -> None:
        """Move or swap shards away from the busiest rank while that lowers its load."""
        by_table = {item.table: item for item in items}
        load, free, owners = placement.load, placement.free, placement.owners
        held: list[list[str]] = [[] for _ in range(self.size)]
        for table in sorted(by_table):
            for rank in owners[table]:
                held[rank].append(table)
        for _ in range(max_rounds):
            top = max(range(self.size), key=lambda r: (load[r], -r))
            if not self._improve(top, held, load, free, owners, by_table):
                break

    def _improve(self, top, held, load, free, owners, by_table) -> bool:
        peak = load[top]
        others = heapq.nsmallest(64, (r for r in range(self.size) if r != top), key=lambda r: (load[r], r))
        mine = sorted(held[top], key=lambda t: (-by_table[t].time, t))
        for other in others:
            for table in mine:  # move one shard
                item = by_table[table]
                if other in owners[table] or free[other] < item.memory:
                    continue
                if load[other] + item.time < peak - 1e-15:
                    self._move(table, top, other, held, load, free, owners, by_table)
                    return True
            for table in mine:  # swap with a lighter shard
                item = by_table[table]
                for theirs in sorted(held[other], key=lambda t: (by_table[t].time, t)):
                    small = by_table[theirs]
                    gain = item.time - small.time
                    if gain <= 1e-15 or load[other] + gain >= peak - 1e-15:
                        continue
                    if other in owners[table] or top in owners[theirs]:
                        continue
                    if free[other] + small.memory < item.memory or free[top] + item.memory < small.memory:
                        continue
                    self._move(table, top, other, held, load, free, owners, by_table)
                    self._move(theirs, other, top, held, load, free, owners, by_table)
                    return True
        return False

    @staticmethod
    def _move(table, src, dst, held, load, free, owners, by_table) -> None:
        item = by_table[table]
        held[src].remove(table)
        held[dst].append(table)
        load[src] -= item.time
        load[dst] += item.time
        free[src] += item.memory
        free[dst] -= item.memory
        owners[table] = sorted(dst if r == src else r for r in owners[table])

    # -- the search over cut levels
    def run(self) -> tuple[dict[str, TableSharding], _Placement]:
        levels = {spec.name: 0 for spec in self.specs}
        placement = self.place(levels)
        while placement.failed is not None:  # memory: cut the table that did not fit, or the biggest
            table = placement.failed
            if levels[table] + 1 >= len(self.ladders[table]):
                table = self._biggest_cuttable(levels)
                if table is None:
                    raise self._error(placement.failed)
            levels[table] += 1
            placement = self.place(levels)
        tried: set[tuple[str, int]] = set()
        while placement.max_load > placement.mean_load * (1 + self.tolerance):
            improved = False
            for table in self._heaviest_on_busiest(placement, levels):
                key = (table, levels[table])
                if key in tried:
                    continue
                tried.add(key)
                trial_levels = dict(levels, **{table: levels[table] + 1})
                trial = self.place(trial_levels)
                if trial.failed is None and _objective(trial) < _objective(placement):
                    levels, placement, improved = trial_levels, trial, True
                    break
            if not improved:
                break
        return self._shardings(levels, placement), placement

    def _heaviest_on_busiest(self, placement: _Placement, levels: Mapping[str, int]) -> list[str]:
        top = max(range(self.size), key=lambda r: (placement.load[r], -r))
        on_top = [t for t, owners in placement.owners.items() if top in owners or owners == [-1]]
        cuttable = [t for t in on_top if levels[t] + 1 < len(self.ladders[t])]
        weight = {spec.name: self._item(spec, *self.ladders[spec.name][levels[spec.name]]).time
                  for spec in self.specs if spec.name in cuttable}
        return sorted(cuttable, key=lambda t: (-weight[t], t))

    def _biggest_cuttable(self, levels: Mapping[str, int]) -> str | None:
        cuttable = [s for s in self.specs if levels[s.name] + 1 < len(self.ladders[s.name])]
        if not cuttable:
            return None
        return min(cuttable, key=lambda s: (-s.rows * s.dim, s.name)).name

    def _shardings(self, levels: Mapping[str, int], placement: _Placement) -> dict[str, TableSharding]:
        plan = {}
        for spec in self.specs:
            kind, _ = self.ladders[spec.name][levels[spec.name]]
            shards = SCHEMES[kind].make_shards(spec.name, spec.rows, spec.dim, placement.owners[spec.name])
            plan[spec.name] = TableSharding(spec.name, kind, tuple(shards))
        return plan

    def _error(self, table: str) -> PlanError:
        spec = self.by_name[table]
        needs = spec.rows * spec.dim * 4 * (1 + self.workload.state_per_row / spec.dim)
        budget = max(self.capacity)
        return PlanError(
            f"table {table!r} ({spec.rows:,} x {spec.dim}) does not fit a shard group of {self.size} rank(s): "
            f"its finest cut ({self.ladders[table][-1][0].value}) still exceeds the free memory of a rank "
            f"(weights + optimizer state of the whole table: {needs / GIB:.2f} GiB, a rank has "
            f"{budget / GIB:.2f} GiB). Options: a larger shard_group_size, row_wise or column_wise sharding "
            f"(sharding={{{table!r}: 'row_wise'}}), a smaller embedding_dim, a smaller batch, or more "
            "memory per rank (memory_per_rank_gb)"
        )


def partition(
    specs: Sequence[TableSpec],
    group_size: int,
    workload: Workload | None = None,
    *,
    hardware: Hardware = H100,
    links: Links | None = None,
    memory_per_rank: float | Sequence[float] = math.inf,
    base_load: Sequence[float] | None = None,
    constraints: Mapping[str, str | ShardingType] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, TableSharding]:
    """Balanced sharding of one collection's tables over a group of ``group_size`` ranks.

    ``memory_per_rank``: bytes each rank may use (one number, or one per rank when other
    collections already use some); ``constraints``: table -> sharding type. Raises ``PlanError``
    when a table cannot fit.
    """
    plan, _ = _run_partitioner(specs, group_size, workload or Workload(), hardware, links, memory_per_rank,
                               base_load, constraints, tolerance)
    return plan


def _run_partitioner(specs, group_size, workload, hardware, links, memory_per_rank, base_load, constraints,
                     tolerance):
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"table names repeat: {names}")
    parsed = {name: parse_sharding_type(kind, name) for name, kind in (constraints or {}).items()}
    unknown = sorted(set(parsed) - set(names))
    if unknown:
        raise ValueError(f"sharding constraints name unknown tables {unknown}; tables: {names}")
    capacity = ([float(memory_per_rank)] * group_size if isinstance(memory_per_rank, (int, float))
                else [float(m) for m in memory_per_rank])
    base = [0.0] * group_size if base_load is None else [float(x) for x in base_load]
    links = links or Links.for_group(hardware, group_size, group_size)
    return _Partitioner(specs, group_size, workload, hardware, links, capacity, base, parsed, tolerance).run()


def evaluate(specs_by_module: Mapping[str, Sequence[TableSpec]], modules: Mapping[str, Mapping[str, TableSharding]],
             group_size: int, workload: Workload, hardware: Hardware = H100, links: Links | None = None) -> PlanReport:
    """Per shard position: tables, shards, rows, predicted memory and load of a plan."""
    links = links or Links.for_group(hardware, group_size, group_size)
    storage = [RankStorage(0, 0, 0, 0, 0, 0, 0)] * group_size
    load = [RankLoad()] * group_size
    tables: list[list[str]] = [[] for _ in range(group_size)]
    shards, rows = [0] * group_size, [0] * group_size
    for module, specs in specs_by_module.items():
        plan = modules[module]
        for p, (st, ld) in enumerate(zip(predict_storage(specs, plan, group_size, workload),
                                         predict_load(specs, plan, group_size, workload, hardware, links),
                                         strict=True)):
            storage[p] = storage[p] + st
            load[p] = load[p] + ld
        for spec in specs:
            ts = plan[spec.name]
            tag = {"table_wise": "", "row_wise": "[rw]", "column_wise": "[cw]", "data_parallel": "[dp]"}
            for sh in ts.shards:
                for p in (range(group_size) if sh.owner < 0 else [sh.owner]):
                    label = spec.name + tag[ts.sharding_type.value]
                    if label not in tables[p]:
                        tables[p].append(label)
                    shards[p] += 1
                    rows[p] += sh.rows
    return PlanReport(tuple(RankReport(p, tuple(tables[p]), shards[p], rows[p], storage[p], load[p])
                            for p in range(group_size)), workload.batch_size, hardware.name)


# ----------------------------------------------------------------------------- whole models
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_group_sizes(world_size: int, ranks_per_node: int | None) -> list[int]:
    """Group sizes ``"auto"`` tries, in order: divisors of one node's ranks (groups inside a node),
    then multiples of it (groups of whole nodes), each ascending."""
    divisors = _divisors(world_size)
    if not ranks_per_node or world_size % ranks_per_node:
        return divisors
    inside = [d for d in divisors if d <= ranks_per_node and ranks_per_node % d == 0]
    across = [d for d in divisors if d > ranks_per_node and d % ranks_per_node == 0]
    return inside + across


def group_links(hardware: Hardware, world_size: int, group_size: int, placement: str,
                ranks_per_node: int | None) -> Links:
    """Links of a shard group's all-to-all: NVLink for the members on the node, the NIC for the rest."""
    rpn = ranks_per_node or world_size
    stride = 1 if placement == "contiguous" else world_size // group_size
    return Links.for_group(hardware, group_size, local_members(group_size, stride, rpn))


def plan_model(
    specs_by_module: Mapping[str, Sequence[TableSpec]],
    world_size: int,
    group_size: int,
    workload: Workload | None = None,
    *,
    memory_per_rank: float = math.inf,
    constraints: Mapping[str, str | ShardingType] | None = None,
    placement: str = "contiguous",
    ranks_per_node: int | None = None,
    hardware: Hardware = H100,
    tolerance: float = DEFAULT_TOLERANCE,
) -> ShardingPlan:
    """Plan every collection of a model for groups of ``group_size`` ranks.

    Collections are planned in order and share each rank's memory and load, so a later one
    balances against the earlier ones. ``constraints`` maps table names (of any collection) to a
    sharding type. Raises ``PlanError`` when something does not fit.
    """
    workload = workload or Workload()
    if world_size % group_size:
        raise ValueError(f"group_size={group_size} does not divide world_size={world_size}")
    constraints = dict(constraints or {})
    known = {spec.name for specs in specs_by_module.values() for spec in specs}
    unknown = sorted(set(constraints) - known)
    if unknown:
        raise ValueError(f"sharding constraints name unknown tables {unknown}; the model's tables are {sorted(known)}")
    links = group_links(hardware, world_size, group_size, placement, ranks_per_node)
    free = [float(memory_per_rank)] * group_size
    load = [0.0] * group_size
    modules: dict[str, dict[str, TableSharding]] = {}
    for module, specs in specs_by_module.items():
        mine = {spec.name: constraints[spec.name] for spec in specs if spec.name in constraints}
        fixed = _fixed_bytes(specs, group_size, workload)
        try:
            plan, placement_ = _run_partitioner(specs, group_size, workload, hardware, links,
                                                [f - fixed for f in free], load, mine, tolerance)
        except PlanError as err:
            raise PlanError(f"{module or 'model'}: {err}") from None
        modules[module] = plan
        load = list(placement_.load)
        free = list(placement_.free)  # what this collection left, its fixed buffers included
    sharding_plan = ShardingPlan(group_size, world_size, modules, placement, ranks_per_node)
    sharding_plan.report = evaluate(specs_by_module, modules, group_size, workload, hardware, links)
    over = [r for r in sharding_plan.report.ranks if r.memory > memory_per_rank]
    if over:
        worst = max(over, key=lambda r: r.memory)
        raise PlanError(
            f"rank {worst.rank} of each shard group of {group_size} needs {_gib(worst.memory)} (tables "
            f"{list(worst.tables)}) but a rank has {_gib(memory_per_rank)}. Options: a larger shard_group_size, "
            "row_wise or column_wise sharding of the big tables, smaller embedding dims, a smaller batch, or "
            "more memory per rank")
    return sharding_plan


def _fixed_bytes(specs: Sequence[TableSpec], group_size: int, workload: Workload) -> float:
    """Step buffers every rank holds whatever it owns: the ids it sends, its output and gradient."""
    b = workload.batch_size
    weighted = any(spec.weighted for spec in specs)
    ids = sum(b * spec.ids_per_sample for spec in specs)
    sent = ids * (8 + (4 if weighted else 0)) + b * sum(spec.features for spec in specs) * 8
    out = sum(spec.features * b * (spec.dim if spec.pooled else spec.pooling_factor * spec.dim) for spec in specs) * 4
    return sent + 4 * out  # output and its gradient, and what the all-to-all returns (x2)


def choose_group_size(
    specs_by_module: Mapping[str, Sequence[TableSpec]],
    world_size: int,
    ranks_per_node: int | None,
    memory_per_rank: float,
    workload: Workload | None = None,
    **kwargs: Any,
) -> tuple[ShardingPlan, str]:
    """The smallest shard group that fits (groups inside one node first), its plan and why.

    Smaller groups mean more replicas, so all-to-alls stay on fewer (and faster) links, at the
    cost of memory: every group holds a whole copy of the tables.
    """
    workload = workload or Workload()
    tried: list[str] = []
    for size in candidate_group_sizes(world_size, ranks_per_node):
        try:
            plan = plan_model(specs_by_module, world_size, size, workload, memory_per_rank=memory_per_rank,
                              ranks_per_node=ranks_per_node, **kwargs)
        except PlanError as err:
            tried.append(f"S={size}: {_short(err)}")
            continue
        return plan, explain(plan, memory_per_rank, tried)
    raise PlanError(
        f"the tables do not fit even one shard group of all {world_size} ranks ({'; '.join(tried)}). Options: more "
        "ranks, row_wise or column_wise sharding, smaller embedding dims, a smaller batch, or more memory per rank")


def _short(err: Exception) -> str:
    text = str(err)
    return text.split(". Options")[0][:160]


def explain(plan: ShardingPlan, memory_per_rank: float, rejected: Sequence[str] = ()) -> str:
    """One line: the group size, why, and what it means for locality and balance."""
    rep = plan.report
    s, m = plan.shard_group_size, plan.num_replicas
    budget = "unlimited" if math.isinf(memory_per_rank) else _gib(memory_per_rank)
    where = ""
    if plan.ranks_per_node:
        if plan.placement == "contiguous" and plan.ranks_per_node % s == 0:
            where = f", shard groups inside one node ({plan.ranks_per_node} ranks per node)"
        elif plan.placement == "contiguous" and s % plan.ranks_per_node == 0:
            where = f", shard groups span {s // plan.ranks_per_node} whole node(s)"
        else:
            where = ", shard groups cross node boundaries"
    why = f"smaller groups do not fit ({rejected[-1]})" if rejected else "the smallest size"
    line = (f"shard_group_size={s}: {why}; busiest rank needs {_gib(rep.max_memory) if rep else '?'} of "
            f"{budget}; {m} replica group(s) x {s} rank(s){where}")
    if rep is not None:
        line += f"; predicted imbalance {rep.imbalance:.2f}"
    return line


class StrategyPlan(NamedTuple):
    """What ``plan_for_strategy`` returns: unpacks to ``(group_size, plans, explanation)``."""

    group_size: int
    plans: dict[str, dict[str, TableSharding]]
    explanation: str
    plan: ShardingPlan


def specs_from_configs(tables_by_module: Mapping[str, Sequence[Any]],
                       stats: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, list[TableSpec]]:
    """``{module: [EmbeddingTableConfig | (name, rows, dim) | TableSpec]}`` -> ``TableSpec``s.

    ``stats`` (table -> ``{"pooling_factor": .., "weighted": .., "id_skew": ..}``) adds lookup
    statistics; by default a feature has one id per sample, uniform over the rows.
    """
    stats = stats or {}
    out: dict[str, list[TableSpec]] = {}
    for module, tables in tables_by_module.items():
        specs = []
        for table in tables:
            if isinstance(table, TableSpec):
                specs.append(table)
                continue
            if isinstance(table, tuple):
                name, rows, dim = table[:3]
                spec = TableSpec(name, rows, dim)
            else:
                spec = TableSpec.from_config(table)
            extra = dict(stats.get(spec.name, {}))
            if extra:
                from dataclasses import replace

                spec = replace(spec, **extra)
            specs.append(spec)
        out[module] = specs
    return out


def plan_for_strategy(
    tables_by_module: Mapping[str, Sequence[Any]],
    world_size: int,
    ranks_per_node: int | None,
    batch_size_per_rank: int,
    memory_per_rank_bytes: float,
    constraints: Mapping[str, str] | None,
    shard_group_size: int | str,
    *,
    placement: str = "contiguous",
    optimizer: str = "rowwise_adagrad",
    sync_interval: int = 1,
    sync_mode: str = "weights",
    sync_dtype: str = "fp32",
    stats: Mapping[str, Mapping[str, Any]] | None = None,
    pinned: ShardingPlan | str | Path | None = None,
    hardware: Hardware = H100,
    allow_column_wise: bool = False,
) -> StrategyPlan:
    """Everything ``TwoDSparseStrategy`` needs: group size, per-collection plans, one log line.

    ``shard_group_size``: an int, or ``"auto"`` (``choose_group_size``). ``pinned``: a
    ``ShardingPlan`` (or a path to its YAML) to use instead of planning; it is checked against the
    tables, the world size and an explicit group size.
    """
    specs = specs_from_configs(tables_by_module, stats)
    workload = Workload(batch_size=max(1, int(batch_size_per_rank)), optimizer=optimizer,
                        sync_mode=sync_mode, sync_interval=sync_interval, allow_column_wise=allow_column_wise,
                        sync_bytes=2 if sync_dtype == "bf16" else 4)
    common = dict(constraints=constraints, placement=placement, hardware=hardware)
    if pinned is not None:
        plan = pinned if isinstance(pinned, ShardingPlan) else ShardingPlan.load(pinned)
        if plan.world_size != world_size:
            raise ValueError(f"the pinned plan is for world_size={plan.world_size}, this run has {world_size}")
        if shard_group_size != "auto" and shard_group_size != plan.shard_group_size:
            raise ValueError(f"shard_group_size={shard_group_size} but the pinned plan has "
                             f"{plan.shard_group_size}; drop one of them")
        plan.validate(specs)
        links = group_links(hardware, world_size, plan.shard_group_size, placement, ranks_per_node)
        plan.report = evaluate(specs, plan.modules, plan.shard_group_size, workload, hardware, links)
        line = f"shard_group_size={plan.shard_group_size}: from the pinned plan; " + explain(
            plan, memory_per_rank_bytes).split("; ", 1)[1]
    elif shard_group_size == "auto":
        plan, line = choose_group_size(specs, world_size, ranks_per_node, memory_per_rank_bytes, workload, **common)
    else:
        plan = plan_model(specs, world_size, int(shard_group_size), workload, memory_per_rank=memory_per_rank_bytes,
                          ranks_per_node=ranks_per_node, **common)
        line = f"shard_group_size={shard_group_size}: as configured; " + explain(
            plan, memory_per_rank_bytes).split("; ", 1)[1]
    return StrategyPlan(plan.shard_group_size, {m: plan.shardings(m) for m in plan.modules}, line, plan)
