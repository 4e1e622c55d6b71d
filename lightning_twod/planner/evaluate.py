"""What a plan costs each shard position: tables, shards, rows, predicted memory and load (``PlanReport``);
and per table, where it goes and what it alone costs (``table_rows``, what ``lightning-twod plan`` prints).

Also the links of a layout's shard group, which both the partitioner and the report price the
all-to-all with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_twod.core.mesh import group_shapes, group_strides
from lightning_twod.core.shards import ShardingType, TableSharding
from lightning_twod.planner.inputs import TableSpec, Workload
from lightning_twod.planner.links import LinkModel, resolve_links
from lightning_twod.planner.load import GroupLinks, RankLoad, predict_load
from lightning_twod.planner.plan import PlanReport, RankReport, ShardingPlan, format_gib
from lightning_twod.planner.storage import ZERO_STORAGE, predict_storage


def evaluate(specs_by_module: Mapping[str, Sequence[TableSpec]], modules: Mapping[str, Mapping[str, TableSharding]],
             group_size: int, workload: Workload, links: LinkModel | str | None = None,
             group_links: GroupLinks | None = None) -> PlanReport:
    """Per shard position: tables, shards, rows, predicted memory and load of a plan."""
    links = resolve_links(links)
    group_links = group_links or GroupLinks.for_group(links, group_size, group_size)
    storage = [ZERO_STORAGE] * group_size
    load = [RankLoad()] * group_size
    tables: list[list[str]] = [[] for _ in range(group_size)]
    shards, rows = [0] * group_size, [0] * group_size
    for module, specs in specs_by_module.items():
        plan = modules[module]
        for p, (st, ld) in enumerate(zip(predict_storage(specs, plan, group_size, workload),
                                         predict_load(specs, plan, group_size, workload, links, group_links),
                                         strict=True)):
            storage[p] = storage[p] + st
            load[p] = load[p] + ld
        for spec in specs:
            ts = plan[spec.name]
            tag = {"table_wise": "", "row_wise": "[rw]", "column_wise": "[cw]", "data_parallel": "[dp]"}
            for sh in ts.shards:
                for p in (range(group_size) if sh.owner < 0 else [sh.owner]):
                    label = spec.name + tag[ts.sharding_type.value] + ("[fp16]" if spec.half else "")
                    if label not in tables[p]:
                        tables[p].append(label)
                    shards[p] += 1
                    rows[p] += sh.rows
    return PlanReport(tuple(RankReport(p, tuple(tables[p]), shards[p], rows[p], storage[p], load[p])
                            for p in range(group_size)), workload.batch_size, links.name)


def shard_group_links(links: LinkModel, world_size: int, group_size: int, placement: str,
                      ranks_per_node: int | None) -> GroupLinks:
    """A shard group's all-to-all links: the node's for the members on it, the network for the rest."""
    shard_group = group_shapes(world_size, group_size, placement, ranks_per_node)[0]
    return GroupLinks.for_group(links, group_size, shard_group.local)


@dataclass(frozen=True)
class TableRow:
    """Where one table of a plan goes, and what it alone costs a rank that holds it.

    ``ranks``: the global ranks of the first shard group of its size that hold a shard (every rank
    for a data-parallel table); ``bytes_per_rank``: the most such a rank allocates for it (rows,
    optimizer state and step buffers: ``predict_storage``); ``seconds``: the most it adds to such a
    rank's predicted step (lookup and all-to-alls: ``predict_load``).
    """

    module: str
    table: str
    sharding_type: str
    group_size: int
    copies: int
    ranks: tuple[int, ...]
    rows: int
    dim: int
    bytes_per_rank: float
    seconds: float

    def to_dict(self) -> dict:
        return {"module": self.module, "table": self.table, "type": self.sharding_type, "group_size": self.group_size,
                "copies": self.copies, "ranks": list(self.ranks), "rows": self.rows, "dim": self.dim,
                "bytes_per_rank": int(self.bytes_per_rank), "ms": round(self.seconds * 1e3, 4)}


def table_rows(specs_by_module: Mapping[str, Sequence[TableSpec]], plan: ShardingPlan, workload: Workload,
               links: LinkModel) -> list[TableRow]:
    """One ``TableRow`` per table of ``plan``, in the plan's order, each costed on its own group size."""
    out = []
    for module, tables in plan.modules.items():
        specs = {spec.name: spec for spec in specs_by_module[module]}
        for name, ts in tables.items():
            data_parallel = ts.sharding_type == ShardingType.DATA_PARALLEL
            size = plan.shard_group_size if data_parallel else ts.size_in(plan.shard_group_size)
            stride, _ = group_strides(plan.placement, plan.world_size, size)
            positions = sorted({p for sh in ts.shards for p in (range(size) if sh.owner < 0 else [sh.owner])})
            group_links = shard_group_links(links, plan.world_size, size, plan.placement, plan.ranks_per_node)
            stored = predict_storage([specs[name]], {name: ts}, size, workload)
            loads = predict_load([specs[name]], {name: ts}, size, workload, links, group_links)
            out.append(TableRow(
                module, name, ts.sharding_type.value, plan.world_size if data_parallel else size,
                plan.world_size if data_parallel else plan.world_size // size,
                tuple(range(plan.world_size)) if data_parallel else tuple(p * stride for p in positions),
                specs[name].rows, specs[name].dim, max(stored[p].total for p in positions),
                max(loads[p].total for p in positions)))
    return out


def format_table_rows(rows: Sequence[TableRow]) -> str:
    """``table_rows`` for a terminal: one line per table, every column in full."""
    width = max([len("table")] + [len(f"{r.module}.{r.table}") for r in rows])
    lines = [f"  {'table':<{width}}  {'type':<13} {'group':>5} {'copies':>6}  {'memory':>10} {'ms':>9}  "
             "ranks of its first shard group"]
    for r in rows:
        ranks = "every rank" if r.sharding_type == "data_parallel" else ", ".join(map(str, r.ranks))
        lines.append(f"  {f'{r.module}.{r.table}':<{width}}  {r.sharding_type:<13} {r.group_size:>5} {r.copies:>6}  "
                     f"{format_gib(r.bytes_per_rank):>10} {r.seconds * 1e3:>9.3g}  {ranks}")
    return "\n".join(lines)
