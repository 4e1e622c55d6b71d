"""The balanced partitioner inside one shard group (``partition``), and ``plan_model``: a plan for
every collection of a model at one group size (``layout.py`` chooses the group size and placement;
``evaluate.py`` predicts what a plan costs each rank).

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

from lightning_twod.core.mesh import check_group_size
from lightning_twod.core.shards import ShardingType, TableSharding, chunk_bounds, make_shards, parse_sharding_type
from lightning_twod.planner.evaluate import evaluate, shard_group_links
from lightning_twod.planner.inputs import GIB, TableSpec, Workload
from lightning_twod.planner.links import LinkModel, resolve_links
from lightning_twod.planner.load import GroupLinks, shard_cost
from lightning_twod.planner.plan import ShardingPlan, format_gib

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

    def __init__(self, specs: Sequence[TableSpec], group_size: int, workload: Workload, links: LinkModel,
                 group_links: GroupLinks, capacity: Sequence[float], base_load: Sequence[float],
                 constraints: Mapping[str, ShardingType], tolerance: float) -> None:
        self.specs = list(specs)
        self.by_name = {spec.name: spec for spec in specs}
        self.size = group_size
        self.workload, self.links, self.group_links = workload, links, group_links
        self.capacity, self.base_load = list(capacity), list(base_load)
        self.tolerance = tolerance
        self.weighted = any(spec.weighted for spec in specs)
        self.ladders = {spec.name: _ladder(spec, group_size, constraints.get(spec.name),
                                           workload.cuts_columns(spec.name)) for spec in specs}
        self._items: dict[tuple[str, int], _Item] = {}
        self._fixed: dict[tuple[str, int], tuple[list[float], list[float]]] = {}

    # -- costs
    def _cost(self, spec: TableSpec, rows: tuple[int, int], dim: int, size: int | None = None):
        group_links = self.group_links if size is None else GroupLinks(0.0, 0.0)
        return shard_cost(spec, rows, dim, size or self.size, self.workload, self.links, group_links, self.weighted)

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
            shards = make_shards(kind, spec.name, spec.rows, spec.dim, placement.owners[spec.name])
            plan[spec.name] = TableSharding(spec.name, kind, tuple(shards))
        return plan

    def _error(self, table: str) -> PlanError:
        spec = self.by_name[table]
        needs = spec.rows * (spec.dim + self.workload.state_per_row(spec.dim, spec.name)) * 4
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
    links: LinkModel | str | None = None,
    group_links: GroupLinks | None = None,
    memory_per_rank: float | Sequence[float] = math.inf,
    base_load: Sequence[float] | None = None,
    constraints: Mapping[str, str | ShardingType] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, TableSharding]:
    """Balanced sharding of one collection's tables over a group of ``group_size`` ranks.

    ``memory_per_rank``: bytes each rank may use (one number, or one per rank when other
    collections already use some); ``constraints``: table -> sharding type; ``links``: a
    ``LinkModel`` or preset name (default ``"h100"``), ``group_links`` the group's all-to-all
    (default: all members on one node). Raises ``PlanError`` when a table cannot fit.
    """
    plan, _ = run_partitioner(specs, group_size, workload or Workload(), resolve_links(links), group_links,
                              memory_per_rank, base_load, constraints, tolerance)
    return plan


def run_partitioner(specs, group_size, workload, links, group_links, memory_per_rank, base_load, constraints,
                    tolerance):
    """``partition``, also returning the placement (per-rank load and free memory)."""
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
    group_links = group_links or GroupLinks.for_group(links, group_size, group_size)
    return _Partitioner(specs, group_size, workload, links, group_links, capacity, base, parsed, tolerance).run()


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
    links: LinkModel | str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> ShardingPlan:
    """Plan every collection of a model for groups of ``group_size`` ranks.

    Collections are planned in order and share each rank's memory and load, so a later one
    balances against the earlier ones. ``constraints`` maps table names (of any collection) to a
    sharding type. Raises ``PlanError`` when something does not fit.
    """
    workload = workload or Workload()
    links = resolve_links(links)
    check_group_size(group_size, world_size)
    constraints = dict(constraints or {})
    known = {spec.name for specs in specs_by_module.values() for spec in specs}
    unknown = sorted(set(constraints) - known)
    if unknown:
        raise ValueError(f"sharding constraints name unknown tables {unknown}; the model's tables are {sorted(known)}")
    group_links = shard_group_links(links, world_size, group_size, placement, ranks_per_node)
    free = [float(memory_per_rank)] * group_size
    load = [0.0] * group_size
    modules: dict[str, dict[str, TableSharding]] = {}
    for module, specs in specs_by_module.items():
        mine = {spec.name: constraints[spec.name] for spec in specs if spec.name in constraints}
        fixed = _fixed_bytes(specs, group_size, workload)
        try:
            plan, placement_ = run_partitioner(specs, group_size, workload, links, group_links,
                                               [f - fixed for f in free], load, mine, tolerance)
        except PlanError as err:
            raise PlanError(f"{module or 'model'}: {err}") from None
        modules[module] = plan
        load = list(placement_.load)
        free = list(placement_.free)  # what this collection left, its fixed buffers included
    sharding_plan = ShardingPlan(group_size, world_size, modules, placement, ranks_per_node)
    sharding_plan.report = evaluate(specs_by_module, modules, group_size, workload, links, group_links)
    over = [r for r in sharding_plan.report.ranks if r.memory > memory_per_rank]
    if over:
        worst = max(over, key=lambda r: r.memory)
        raise PlanError(
            f"rank {worst.rank} of each shard group of {group_size} needs {format_gib(worst.memory)} (tables "
            f"{list(worst.tables)}) but a rank has {format_gib(memory_per_rank)}. Options: a larger shard_group_size, "
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
